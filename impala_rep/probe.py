"""Reads an env's specs in a short-lived subprocess.

The learner must know the env's observation and action specs, but it must not create the
env itself: DM Control pixel envs open a MuJoCo rendering context to compute their spec, and
that crashes a process that has loaded TensorFlow (DESIGN.md). :func:`probe_env_spec` runs
``python -m impala_rep.probe`` instead, which makes the env, prints its :class:`EnvSpec` as
JSON and exits. TensorFlow-free.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Mapping, Optional

from impala_rep.specs import EnvSpec

__all__ = ["probe_env_spec", "EnvProbeError"]

_EXIT_ENV_ERROR = 3


class EnvProbeError(ValueError):
    """The env could not be made; the message is the env registry's sentence."""


def probe_env_spec(env_id: str, env_kwargs: Optional[Mapping[str, Any]] = None, timeout: float = 300.0) -> EnvSpec:
    """Makes ``env_id`` in a subprocess and returns its spec (raises :class:`EnvProbeError`)."""
    payload = json.dumps({"env_id": env_id, "env_kwargs": dict(env_kwargs or {})})
    env = dict(os.environ)
    env.setdefault("MUJOCO_GL", "egl")
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
    return EnvSpec.from_json(json.loads(proc.stdout.strip().splitlines()[-1]))


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
    print(json.dumps(spec.to_json()))
    sys.stdout.flush()
    close = getattr(env, "close", None)
    if close is not None:
        close()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
