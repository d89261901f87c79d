"""TensorFlow test configuration: 4 logical CPU devices, so multi-replica tests run here.

Logical devices must be configured before TensorFlow initialises its devices, so this runs
once when pytest starts, before any test module touches TensorFlow.
"""

import pytest

NUM_LOGICAL_CPUS = 4


def pytest_configure(config):
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS
    )


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same random state (Keras initialisers, NumPy, Python's
    random), so a test's outcome does not hang on weights drawn differently each run."""
    import tf_keras

    tf_keras.utils.set_random_seed(0)


@pytest.fixture(scope="module")
def catch_spec():
    """The spec of the built-in ``catch`` env, for trainers driven by :mod:`fake_batches`."""
    from impala_rep.probe import probe_env_spec

    return probe_env_spec("catch", {})


@pytest.fixture
def poison_update():
    """``poison_update(trainer, at_step)`` makes the parameters that ``trainer``'s update of
    learner step ``at_step`` hands on NaN (the training loop then finds the run diverged)."""
    return _poison_update


def _poison_update(trainer, at_step: int) -> None:
    import numpy as np

    real = trainer.step.train_and_read

    def poisoned(tensors):
        metrics, (step, params) = real(tensors)
        if step == at_step:
            params = {k: np.full_like(v, np.nan) for k, v in params.items()}
        return metrics, (step, params)

    trainer.step.train_and_read = poisoned
