"""User env factories for the plug-in tests of ``envs.make("plugin_envs:...")``.

Not a test module (no ``test_`` prefix): ``tests/test_envs*.py`` put this directory on
``sys.path`` and load these factories by ``module:callable`` id.
"""

import dm_env
import numpy as np
from dm_env import specs

NOT_CALLABLE = 3


class Counter(dm_env.Environment):
    """A single-array observation (float32 [2]: step count, offset), reward 1 per step.

    Episodes terminate after ``length`` steps (discount 0). ``offset`` comes from the seed,
    so seeded runs are reproducible and different seeds differ.
    """

    def __init__(self, length=5, label="counter", seed=None):
        self.length = int(length)
        self.label = label
        self._offset = float(np.random.default_rng(seed).integers(1000))
        self._t = 0

    def observation_spec(self):
        return specs.Array((2,), np.float32, name="counter")

    def action_spec(self):
        return specs.DiscreteArray(2, dtype=np.int32, name="action")

    def _obs(self):
        return np.array([self._t, self._offset], np.float32)

    def reset(self):
        self._t = 0
        return dm_env.restart(self._obs())

    def step(self, action):
        if self._t >= self.length:
            return self.reset()
        self._t += 1
        if self._t >= self.length:
            return dm_env.termination(1.0, self._obs())
        return dm_env.transition(1.0, self._obs())


def make_counter(length=5, label="counter", seed=None):
    return Counter(length=length, label=label, seed=seed)


def make_counter_no_seed(length=5):
    return Counter(length=length, seed=0)


class FailingStep(Counter):
    """Makes and resets fine; every step raises (an env the launcher's cost probe cannot time)."""

    def step(self, action):
        raise RuntimeError("step is not implemented yet")


def make_failing_step(seed=None):
    return FailingStep(seed=seed)


class Chatty(Counter):
    """Prints on creation, on close and at exit, as some user envs do."""

    def __init__(self, seed=None):
        print("chatty env: hello")
        import atexit

        atexit.register(print, "chatty env: goodbye")
        super().__init__(seed=seed)

    def close(self):
        print("chatty env: closing")


def make_chatty(seed=None):
    return Chatty(seed=seed)


def make_raising(**kwargs):
    raise RuntimeError("simulator licence not found")


def make_not_env():
    return 42


class Factories:
    @staticmethod
    def counter(seed=None):
        return Counter(seed=seed)


class VectorReward(Counter):
    """Declares (and returns) a reward of two parts: impala_rep trains on one number per step."""

    def reward_spec(self):
        return specs.Array((2,), np.float32, name="reward")


def make_vector_reward(seed=None):
    return VectorReward(seed=seed)


def make_catch(seed=None):
    """The built-in catch through a plug-in factory that takes no options of its own."""
    import envs

    return envs.make("catch", seed=seed)


class IntegerAction(Counter):
    """Acts with the integers 1..4 (an int BoundedArray, as Gym adapters give a Discrete space);
    records the actions it received."""

    def __init__(self, seed=None):
        super().__init__(seed=seed)
        self.received = []

    def action_spec(self):
        return specs.BoundedArray((), np.int64, minimum=1, maximum=4, name="action")

    def step(self, action):
        self.received.append(action)
        return super().step(0)


def make_integer_action(seed=None):
    return IntegerAction(seed=seed)
