"""Small built-in ``dm_env`` environments in pure NumPy, for fast tests and examples.

TensorFlow-free. Both envs draw every random choice from ``np.random.default_rng(seed)``:
the same seed gives the same sequence of episodes.

* :class:`Catch` (id ``catch``): bsuite's Catch. A ball falls from a random column of the
  top row, one row per step; the agent moves a paddle on the bottom row (actions 0 left,
  1 stay, 2 right). When the ball reaches the bottom row the episode terminates (``LAST``,
  discount 0) with reward +1 if the paddle is under the ball, else -1; every other reward
  is 0. An episode has ``rows - 1`` steps. Learnable in seconds.
* :class:`Reach` (id ``reach``): a point in ``[-1, 1]^dim`` moved by a continuous
  ``BoundedArray`` action toward a random target; shaped reward ``-distance``; episodes end
  by truncation at ``time_limit`` steps (``LAST``, discount 1). For Gaussian policies.
"""

from __future__ import annotations

from typing import Dict, Optional

import dm_env
import numpy as np
from dm_env import specs

from envs.errors import EnvError

__all__ = ["Catch", "Reach"]


def _int_option(env: str, name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise EnvError(f"{env} option {name} must be an integer of at least {minimum}, got {value!r}.")
    return int(value)


def _bool_option(env: str, name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise EnvError(f"{env} option {name} must be true or false, got {value!r}.")
    return bool(value)


class Catch(dm_env.Environment):
    """bsuite-style Catch on a ``rows`` x ``columns`` board.

    Observations (a flat dict):
      * ``pixels=False`` (default): ``{"observation": float32 [rows * columns]}``, the board
        flattened row-major, 1.0 at the ball and at the paddle, 0.0 elsewhere.
      * ``pixels=True``: ``{"pixels": uint8 [rows * scale, columns * scale, 1]}``, the board
        as an image (255 at ball and paddle), each cell a ``scale`` x ``scale`` block, so a
        convolutional torso applies.

    Action: ``DiscreteArray(3)`` (int scalar): 0 left, 1 stay, 2 right.
    Reward: float64 scalar. Discount: 1.0, and 0.0 on the terminating step.
    """

    def __init__(
        self,
        rows: int = 10,
        columns: int = 5,
        pixels: bool = False,
        scale: int = 8,
        seed: Optional[int] = None,
    ):
        self._rows = _int_option("catch", "rows", rows, 2)
        self._columns = _int_option("catch", "columns", columns, 1)
        self._pixels = _bool_option("catch", "pixels", pixels)
        self._scale = _int_option("catch", "scale", scale, 1)
        self._rng = np.random.default_rng(seed)
        self._ball = (0, 0)
        self._paddle = self._columns // 2
        self._needs_reset = True

    def observation_spec(self) -> Dict[str, specs.Array]:
        if self._pixels:
            shape = (self._rows * self._scale, self._columns * self._scale, 1)
            return {"pixels": specs.BoundedArray(shape, np.uint8, 0, 255, name="pixels")}
        return {
            "observation": specs.BoundedArray(
                (self._rows * self._columns,), np.float32, 0.0, 1.0, name="observation"
            )
        }

    def action_spec(self) -> specs.DiscreteArray:
        return specs.DiscreteArray(3, dtype=np.int32, name="action")

    def _observation(self) -> Dict[str, np.ndarray]:
        board = np.zeros((self._rows, self._columns), np.float32)
        board[self._ball] = 1.0
        board[self._rows - 1, self._paddle] = 1.0
        if not self._pixels:
            return {"observation": board.reshape(-1)}
        image = (board * 255).astype(np.uint8)
        image = np.repeat(np.repeat(image, self._scale, axis=0), self._scale, axis=1)
        return {"pixels": image[:, :, None]}

    def reset(self) -> dm_env.TimeStep:
        self._ball = (0, int(self._rng.integers(self._columns)))
        self._paddle = self._columns // 2
        self._needs_reset = False
        return dm_env.restart(self._observation())

    def step(self, action) -> dm_env.TimeStep:
        if self._needs_reset:
            return self.reset()
        a = np.asarray(action)
        if a.shape != () or a.dtype.kind not in "iu" or not 0 <= int(a) < 3:
            raise ValueError(f"catch: the action must be an integer scalar in [0, 3), got {action!r}.")
        self._paddle = int(np.clip(self._paddle + int(a) - 1, 0, self._columns - 1))
        row, col = self._ball
        self._ball = (row + 1, col)
        if row + 1 == self._rows - 1:
            self._needs_reset = True
            reward = 1.0 if self._paddle == col else -1.0
            return dm_env.termination(reward=reward, observation=self._observation())
        return dm_env.transition(reward=0.0, observation=self._observation())


class Reach(dm_env.Environment):
    """Move a point in ``[-1, 1]^dim`` toward a target.

    Observation: ``{"observation": float32 [2 * dim]}`` = (position, target).
    Action: ``BoundedArray`` float32 ``[dim]`` in ``[-1, 1]``; the point moves by
    ``step_size * action`` and stays in the box.
    Reward: float64 ``-||position - target||`` after the move (shaped, in
    ``[-2 sqrt(dim), 0]``). Episodes last ``time_limit`` steps and end by truncation
    (``LAST`` with discount 1.0).
    """

    def __init__(
        self,
        dim: int = 2,
        time_limit: int = 50,
        step_size: float = 0.1,
        seed: Optional[int] = None,
    ):
        self._dim = _int_option("reach", "dim", dim, 1)
        if self._dim > 2:
            raise EnvError(f"reach option dim must be 1 or 2, got {dim!r}.")
        self._time_limit = _int_option("reach", "time_limit", time_limit, 1)
        if isinstance(step_size, bool) or not isinstance(step_size, (int, float)) or not 0 < step_size <= 2:
            raise EnvError(f"reach option step_size must be a number in (0, 2], got {step_size!r}.")
        self._step_size = float(step_size)
        self._rng = np.random.default_rng(seed)
        self._position = np.zeros(self._dim)
        self._target = np.zeros(self._dim)
        self._t = 0
        self._needs_reset = True

    def observation_spec(self) -> Dict[str, specs.Array]:
        return {
            "observation": specs.BoundedArray((2 * self._dim,), np.float32, -1.0, 1.0, name="observation")
        }

    def action_spec(self) -> specs.BoundedArray:
        return specs.BoundedArray((self._dim,), np.float32, -1.0, 1.0, name="action")

    def _observation(self) -> Dict[str, np.ndarray]:
        return {"observation": np.concatenate([self._position, self._target]).astype(np.float32)}

    def reset(self) -> dm_env.TimeStep:
        self._position = self._rng.uniform(-1.0, 1.0, self._dim)
        self._target = self._rng.uniform(-1.0, 1.0, self._dim)
        self._t = 0
        self._needs_reset = False
        return dm_env.restart(self._observation())

    def step(self, action) -> dm_env.TimeStep:
        if self._needs_reset:
            return self.reset()
        a = np.asarray(action, dtype=np.float64).reshape(-1)
        if a.size != self._dim or not np.all(np.isfinite(a)):
            raise ValueError(f"reach: the action must be {self._dim} finite number(s), got {action!r}.")
        self._position = np.clip(self._position + self._step_size * np.clip(a, -1.0, 1.0), -1.0, 1.0)
        self._t += 1
        reward = -float(np.linalg.norm(self._position - self._target))
        if self._t >= self._time_limit:
            self._needs_reset = True
            return dm_env.truncation(reward=reward, observation=self._observation())
        return dm_env.transition(reward=reward, observation=self._observation())
