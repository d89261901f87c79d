"""Environments: the env registry, DeepMind Control pixel tasks, wrappers, built-in envs.

TensorFlow-free, and importing ``envs`` has no side effects: ``dm_control`` (and the
``MUJOCO_GL`` default, see :mod:`envs.dmc`) is loaded only when a ``dmc/`` env is made.

Every env :func:`make` returns is a ``dm_env.Environment`` whose observations are a flat
``dict[str, np.ndarray]``: uint8 ``[H, W, C]`` arrays are pixels, rank-1 arrays vectors.

Usage::

    import envs
    env = envs.make("dmc/walker-walk", seed=0, size=84, action_repeat=4, render="auto")
    env = envs.make("catch", seed=0)
    env = envs.make("my_pkg.envs:make_env", seed=0, **envs.parse_env_args(["level=2"]))
    timestep = env.reset()
    while not timestep.last():
        timestep = env.step(policy(timestep.observation))
"""

from envs.errors import EnvError
from envs.registry import WRAPPER_OPTIONS, list_ids, make, parse_env_args, register
from envs.wrappers import (
    ActionRepeat,
    ClipReward,
    DiscretizeActions,
    FrameStack,
    MultiDiscreteArray,
    IntegerActions,
    ObservationDict,
    SelectObservation,
    TimeLimit,
    Wrapper,
)

__all__ = [
    "EnvError",
    "make",
    "register",
    "list_ids",
    "parse_env_args",
    "WRAPPER_OPTIONS",
    "Wrapper",
    "IntegerActions",
    "ObservationDict",
    "ActionRepeat",
    "TimeLimit",
    "FrameStack",
    "ClipReward",
    "DiscretizeActions",
    "MultiDiscreteArray",
    "SelectObservation",
]
