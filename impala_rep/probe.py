"""Reads an env's specs in a short-lived subprocess.

The learner must know the env's observation and action specs, but it must not create the
env itself: DM Control pixel envs open a MuJoCo rendering context to compute their spec, and
that crashes a process that has loaded TensorFlow (DESIGN.md). :func:`probe_env_spec` runs
``python -m impala_rep.probe`` instead, which makes the env, prints its :class:`EnvSpec` as
JSON and exits. TensorFlow-free.

:func:`probe_env` can also time, in that subprocess, what one agent step costs the actors
(the env step and the NumPy policy's forward pass, :mod:`impala_rep.costs`); the launcher
sizes the learner's threads from it. The subprocess runs with one BLAS and one llvmpipe
thread, as actor processes do.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Dict, Mapping, Optional, Tuple

from impala_rep.plan import actor_process_env
from impala_rep.specs import EnvSpec

__all__ = ["probe_env_spec", "probe_env", "EnvProbeError"]

_EXIT_ENV_ERROR = 3


class EnvProbeError(ValueError):
    """The env could not be made; the message is the env registry's sentence."""


def probe_env_spec(env_id: str, env_kwargs: Optional[Mapping[str, Any]] = None, timeout: float = 300.0) -> EnvSpec:
    """Makes ``env_id`` in a subprocess and returns its spec (raises :class:`EnvProbeError`)."""
    return probe_env(env_id, env_kwargs, timeout=timeout)[0]


def probe_env(
    env_id: str,
    env_kwargs: Optional[Mapping[str, Any]] = None,
    costs: Optional[Mapping[str, Any]] = None,
    timeout: float = 300.0,
) -> Tuple[EnvSpec, Optional[Dict[str, Any]]]:
    """Makes ``env_id`` in a subprocess; returns its spec and, if asked, the actors' step costs.

    ``costs`` asks for the timings: ``{"network": <RunConfig.network>, "frame_stack": K,
    "batch": envs per actor process}``. The second value is then ``{"env": {...},
    "policy": {...}}`` (see :func:`impala_rep.costs.time_env_step` and
    :func:`~impala_rep.costs.time_policy_step`), or ``{"error": sentence}`` if the policy could
    not be timed; it is None when not asked. Raises :class:`EnvProbeError` if the env cannot
    be made.
    """
    request: Dict[str, Any] = {"env_id": env_id, "env_kwargs": dict(env_kwargs or {})}
    if costs is not None:
        request["costs"] = dict(costs)
    payload = json.dumps(request)
    env = actor_process_env()  # as in the actor processes, whose costs it times
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "impala_rep.probe", payload],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        raise EnvProbeError(f"making env {env_id!r} took more than {timeout:.0f} s; check that it can be created on its own.") from exc
    if proc.returncode == _EXIT_ENV_ERROR:
        raise EnvProbeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"env {env_id!r} could not be made.")
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise EnvProbeError(f"making env {env_id!r} failed (exit code {proc.returncode}):\n{tail}")
    # The env may print too (on creation, on close, at exit): the result is the marked line.
    marked = [line[len(_RESULT_MARK):] for line in proc.stdout.splitlines() if line.startswith(_RESULT_MARK)]
    if not marked:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        raise EnvProbeError(f"the probe of env {env_id!r} ended without its result; its output ended with:\n{tail}")
    result = json.loads(marked[-1])
    return EnvSpec.from_json(result["spec"]), result.get("costs")


_RESULT_MARK = "impala_rep.probe result: "


def _time_costs(env, spec: EnvSpec, request: Mapping[str, Any]) -> Dict[str, Any]:
    from impala_rep.config import frame_stack_keys
    from impala_rep.costs import time_env_step, time_policy_step
    from impala_rep.distributions import make_policy
    from impala_rep.networks import NetworkConfig
    from impala_rep.networks.numpy_backend import NumpyNetwork
    from impala_rep.specs import stacked_observation_specs

    # Timing is advisory (the launcher falls back to a fixed thread count), so any failure
    # here is reported, not raised: the spec is what the launch needs.
    out: Dict[str, Any] = {}
    try:
        out["env"] = time_env_step(env)
    except Exception as exc:  # noqa: BLE001 (a user env may raise anything on random actions)
        return {"error": f"could not time the env under random actions: {type(exc).__name__}: {exc}"}
    try:
        config = NetworkConfig(**request["network"])
        obs_specs = stacked_observation_specs(spec.observations, frame_stack_keys(spec.observations, request["frame_stack"]))
        network = NumpyNetwork(config, obs_specs, spec.action)
        out["policy"] = time_policy_step(network, make_policy(spec.action, config), obs_specs, int(request["batch"]))
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"could not time the policy: {exc}"
    return out


def _main(argv) -> int:
    request = json.loads(argv[1])
    import envs  # noqa: WPS433 (TensorFlow-free)
    from impala_rep.specs import env_spec_from_dm_env

    try:
        env = envs.make(request["env_id"], **request["env_kwargs"])
        spec = env_spec_from_dm_env(env)
    except ValueError as exc:  # envs.EnvError is a ValueError
        print(str(exc), file=sys.stderr)
        return _EXIT_ENV_ERROR
    result: Dict[str, Any] = {"spec": spec.to_json()}
    if "costs" in request:
        result["costs"] = _time_costs(env, spec, request["costs"])
    print("\n" + _RESULT_MARK + json.dumps(result))  # on a line of its own, whatever the env printed
    sys.stdout.flush()
    close = getattr(env, "close", None)
    if close is not None:
        close()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
