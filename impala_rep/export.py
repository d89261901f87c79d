"""Exported policies: the network spec plus NumPy weights, loadable without TensorFlow.

Layout of an exported policy directory (``RUN_DIR/policy`` by default)::

    policy.json   {"format": 1, "env": ..., "env_kwargs": ..., "env_spec": ..., "network": ...,
                   "frame_stack": {...}, "learner_step": ..., "agent_steps": ..., "version": ...}
    params.npz    one array per parameter name (NumPy backend names)

Writes are atomic (a temporary directory renamed into place), so a crash never leaves a
half-written policy. TensorFlow-free: evaluation renders, and renders only without TF.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import zipfile
from typing import Any, Dict, Mapping

import numpy as np

from impala_rep.specs import EnvSpec, stacked_observation_specs

__all__ = ["save_policy", "load_policy", "LoadedPolicy", "PolicyLoadError", "FORMAT_VERSION"]

FORMAT_VERSION = 1
_META = "policy.json"
_PARAMS = "params.npz"


class PolicyLoadError(ValueError):
    """An exported policy is missing, corrupt, or of another format."""


@dataclasses.dataclass
class LoadedPolicy:
    metadata: Dict[str, Any]
    env_spec: EnvSpec
    network: Any  # NumpyNetwork with the exported weights
    policy: Any  # Policy from impala_rep.distributions
    frame_stack: Dict[str, int]

    @property
    def env(self) -> str:
        return self.metadata["env"]

    @property
    def env_kwargs(self) -> Dict[str, Any]:
        return dict(self.metadata.get("env_kwargs", {}))


def save_policy(directory: str, params: Mapping[str, np.ndarray], metadata: Mapping[str, Any]) -> str:
    """Writes ``params`` and ``metadata`` to ``directory`` atomically; returns the directory."""
    for required in ("env", "env_spec", "network", "frame_stack"):
        if required not in metadata:
            raise ValueError(f"policy metadata needs {required!r}; got keys {sorted(metadata)}.")
    directory = os.path.abspath(directory)
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".policy-", dir=parent)
    try:
        meta = dict(metadata)
        meta["format"] = FORMAT_VERSION
        with open(os.path.join(tmp, _META), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
        np.savez(os.path.join(tmp, _PARAMS), **{k: np.asarray(v) for k, v in params.items()})
        old = None
        if os.path.exists(directory):
            old = directory + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(directory, old)
        os.rename(tmp, directory)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _resolve(path: str) -> str:
    if os.path.isfile(path) and os.path.basename(path) == _META:
        return os.path.dirname(path)
    if os.path.isfile(os.path.join(path, _META)):
        return path
    if os.path.isfile(os.path.join(path, "policy", _META)):
        return os.path.join(path, "policy")
    if not os.path.exists(path):
        raise PolicyLoadError(f"{path} does not exist; pass a run directory or an exported policy directory.")
    raise PolicyLoadError(
        f"no exported policy at {path}: expected {_META} there or in {os.path.join(path, 'policy')} "
        "(a run exports its policy at every checkpoint; has it saved one yet?)."
    )


def load_policy(path: str) -> LoadedPolicy:
    """Loads a run directory's or a policy directory's exported policy (no TensorFlow)."""
    from impala_rep.distributions import make_policy
    from impala_rep.networks import NetworkConfig
    from impala_rep.networks.numpy_backend import NumpyNetwork

    directory = _resolve(path)
    try:
        with open(os.path.join(directory, _META)) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise PolicyLoadError(f"{os.path.join(directory, _META)} is unreadable or not JSON ({exc}).") from exc
    if not isinstance(meta, dict):
        raise PolicyLoadError(f"{os.path.join(directory, _META)} holds {type(meta).__name__}, not a JSON object.")
    if meta.get("format") != FORMAT_VERSION:
        raise PolicyLoadError(
            f"{directory} holds policy format {meta.get('format')!r}; this version reads format {FORMAT_VERSION}."
        )
    try:
        with np.load(os.path.join(directory, _PARAMS)) as data:
            params = {k: data[k] for k in data.files}
    except (OSError, ValueError, TypeError, AttributeError, zipfile.BadZipFile, EOFError) as exc:
        # TypeError/AttributeError: a .npy (one array, no archive) saved under the archive's name
        raise PolicyLoadError(f"{os.path.join(directory, _PARAMS)} is missing or corrupt ({exc}).") from exc
    bad = sorted(k for k, v in params.items() if v.dtype.kind == "f" and not np.all(np.isfinite(v)))
    if bad:
        raise PolicyLoadError(
            f"{os.path.join(directory, _PARAMS)} holds NaN or infinite values (in {', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}): the run that saved it had diverged; use an earlier export."
        )
    try:
        if not isinstance(meta.get("env"), str) or not isinstance(meta.get("env_kwargs", {}), dict):
            raise ValueError("'env' must be an env id and 'env_kwargs' an object")
        env_spec = EnvSpec.from_json(meta["env_spec"])
        frame_stack = {k: int(v) for k, v in meta["frame_stack"].items()}
        config = NetworkConfig(**meta["network"])
        obs_specs = stacked_observation_specs(env_spec.observations, frame_stack)
        network = NumpyNetwork(config, obs_specs, env_spec.action)
        policy = make_policy(env_spec.action, config)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # AttributeError: a list where an object belongs
        raise PolicyLoadError(f"{directory}/{_META} does not describe a network this version can build ({exc}).") from exc
    try:
        network.set_params(params)
    except ValueError as exc:
        raise PolicyLoadError(f"{directory}/{_PARAMS} does not match the network: {exc}") from exc
    return LoadedPolicy(metadata=meta, env_spec=env_spec, network=network, policy=policy, frame_stack=frame_stack)
