"""TensorFlow test configuration: 4 logical CPU devices, so multi-replica tests run here.

Logical devices must be configured before TensorFlow initialises its devices, so this runs
once when pytest starts, before any test module touches TensorFlow.
"""

NUM_LOGICAL_CPUS = 4


def pytest_configure(config):
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS
    )
