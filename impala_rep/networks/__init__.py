"""The agent network: one definition, a NumPy backend (actors) and a TensorFlow one (learner).

Importing this package is TensorFlow-free. ``NetworkConfig`` and ``NumpyNetwork`` are
available here; the TensorFlow backend is imported on first access of ``TFNetwork`` (or
directly from :mod:`impala_rep.networks.tf_backend`).
"""

from impala_rep.networks.config import NetworkConfig, NetworkPlan, plan_network
from impala_rep.networks.numpy_backend import NumpyNetwork

__all__ = ["NetworkConfig", "NetworkPlan", "plan_network", "NumpyNetwork", "TFNetwork"]


def __getattr__(name):
    if name == "TFNetwork":
        from impala_rep.networks.tf_backend import TFNetwork

        return TFNetwork
    raise AttributeError(f"module 'impala_rep.networks' has no attribute {name!r}")
