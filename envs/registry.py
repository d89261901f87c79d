"""The env registry: ``make``, ``register``, ``list_ids`` and ``parse_env_args``.

TensorFlow-free, and free of import-time side effects (``dm_control`` is imported only when
a ``dmc/...`` id is made or listed).

Env ids:
  * built-ins: ``catch``, ``reach`` (see :mod:`envs.builtin`) and whatever
    :func:`register` added;
  * ``dmc/DOMAIN-TASK`` for every task of ``dm_control.suite.ALL_TASKS``
    (see :mod:`envs.dmc`);
  * ``package.module:callable``: imports ``package.module``, calls ``callable(**kwargs)``
    (plus ``seed=seed`` when the callable accepts a ``seed`` argument) and checks that it
    returned a ``dm_env.Environment``.

Wrapper options :func:`make` accepts for every id (and does not pass to the factory):
  ``action_repeat`` (int, default 1; 4 for ``dmc/``, where the factory repeats before
  rendering), ``frame_stack`` (int, default 1: stack the K newest ``[H, W, C]`` frames),
  ``time_limit`` (int steps: truncate episodes), ``observation_keys`` (list of keys to
  keep), ``discretize`` (int bins: continuous actions -> discrete, see
  :class:`envs.wrappers.DiscretizeActions`), ``clip_rewards`` (bool: clip to [-1, 1]).
Every other keyword goes to the factory. Built-ins that implement an option themselves get
it instead: ``dmc/`` ids take ``action_repeat`` (repeating below the renderer, so frames
are rendered once per agent step) and ``reach`` takes ``time_limit``.

Usage::

    env = envs.make("dmc/cartpole-swingup", seed=1, size=84, render="fast")
    env = envs.make("catch", seed=0, pixels=True)
    env = envs.make("my_pkg.my_envs:make_env", **envs.parse_env_args(["level=3", "name=x"]))
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import inspect
import json
import re
import traceback
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional

import dm_env
import numpy as np

from envs import builtin, dmc
from envs.errors import EnvError
from envs.wrappers import (
    ActionRepeat,
    ClipReward,
    DiscretizeActions,
    FrameStack,
    IntegerActions,
    ObservationDict,
    needs_integer_actions,
    SelectObservation,
    TimeLimit,
)

__all__ = ["make", "register", "list_ids", "parse_env_args", "WRAPPER_OPTIONS"]

WRAPPER_OPTIONS = (
    "action_repeat",
    "frame_stack",
    "time_limit",
    "observation_keys",
    "discretize",
    "clip_rewards",
)

_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclasses.dataclass(frozen=True)
class _Entry:
    factory: Callable[..., dm_env.Environment]
    # Wrapper options the factory applies itself (with its own defaults).
    native_options: frozenset = frozenset()


_REGISTRY: Dict[str, _Entry] = {
    "catch": _Entry(builtin.Catch),
    "reach": _Entry(builtin.Reach, frozenset({"time_limit"})),
}


def register(env_id: str, factory: Callable[..., dm_env.Environment], *, overwrite: bool = False) -> None:
    """Registers ``factory`` under ``env_id`` for :func:`make`.

    ``factory(**kwargs)`` (plus ``seed=`` when it accepts one) must return a
    ``dm_env.Environment``. Ids are words of letters, digits, ``_ . -`` separated by ``/``;
    ``dmc/`` is reserved and ``:`` marks ``module:callable`` ids. Re-registering an id
    raises unless ``overwrite=True``.
    """
    if not isinstance(env_id, str) or not _ID_RE.match(env_id) or env_id.startswith("dmc/"):
        raise EnvError(
            f"cannot register env id {env_id!r}: ids are letters, digits, '_', '.', '-' in "
            "'/'-separated words, and the prefix 'dmc/' is reserved."
        )
    if not callable(factory):
        raise EnvError(f"cannot register {env_id!r}: the factory {factory!r} is not callable.")
    if env_id in _REGISTRY and not overwrite:
        raise EnvError(f"env id {env_id!r} is already registered; pass overwrite=True to replace it.")
    _REGISTRY[env_id] = _Entry(factory)


def list_ids(include_dmc: bool = True) -> List[str]:
    """Registered ids, sorted, then (with ``include_dmc``) every ``dmc/DOMAIN-TASK`` id.

    Listing DM Control ids imports ``dm_control`` (and may set ``MUJOCO_GL``, see
    :mod:`envs.dmc`).
    """
    ids = sorted(_REGISTRY)
    if include_dmc:
        ids += dmc.dmc_ids()
    return ids


def parse_env_args(items: Iterable[str]) -> Dict[str, Any]:
    """Parses ``["key=value", ...]`` (repeated ``--env-arg``) into keyword arguments.

    Values are parsed as JSON where they parse (``3`` -> int, ``0.5`` -> float,
    ``true`` -> bool, ``[64, 64]`` -> list, ``null`` -> None, ``"x"`` -> str) and kept as
    strings otherwise (``name=walker`` -> ``"walker"``). Keys must be Python identifiers and
    appear once; anything else raises :class:`EnvError`.
    """
    if isinstance(items, (str, bytes)):
        raise EnvError(f"env args must be a list of 'key=value' strings, got the single string {items!r}.")
    out: Dict[str, Any] = {}
    for item in items:
        if not isinstance(item, str):
            raise EnvError(f"env arg {item!r} is not a string; pass each as 'key=value'.")
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise EnvError(
                f"env arg {item!r} is malformed; expected key=value with a Python identifier as "
                "key (e.g. size=64 or camera=1)."
            )
        if key in out:
            raise EnvError(f"env arg {key!r} is given more than once; pass each key once.")
        if key == "seed":
            raise EnvError("seed is not an env arg: each env's seed comes from --seed (the run's seed).")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out[key] = value
    return out


def _unknown_id(env_id: str) -> EnvError:
    candidates = sorted(_REGISTRY)
    try:
        dmc_ids = dmc.dmc_ids()
    except EnvError:
        dmc_ids = []
    candidates += dmc_ids
    # Also compare against the ids without their "dmc/" prefix (users often omit it).
    stripped = {i[len("dmc/"):]: i for i in dmc_ids}
    close = difflib.get_close_matches(env_id, candidates, n=3, cutoff=0.6)
    close += [stripped[m] for m in difflib.get_close_matches(env_id, list(stripped), n=3, cutoff=0.6)]
    close = list(dict.fromkeys(close))[:3]
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return EnvError(
        f"unknown env id {env_id!r}{hint}; accepted: the built-in ids "
        f"{', '.join(sorted(_REGISTRY))}, dmc/DOMAIN-TASK for the {len(dmc_ids) or 'DM Control'} "
        "DM Control suite tasks (e.g. dmc/cartpole-swingup), or package.module:callable naming a "
        "factory that returns a dm_env.Environment."
    )


def _load_callable(env_id: str) -> Callable[..., Any]:
    module_name, sep, attr = env_id.partition(":")
    if not sep or not _MODULE_RE.match(module_name) or not all(p.isidentifier() for p in attr.split(".")):
        raise EnvError(
            f"malformed factory id {env_id!r}; expected package.module:callable, e.g. "
            "my_envs.factories:make_env."
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise EnvError(
                f"cannot import module {module_name!r} for env id {env_id!r} (no module named "
                f"{exc.name!r}); install it or add its directory to PYTHONPATH."
            ) from exc
        raise EnvError(f"importing module {module_name!r} for env id {env_id!r} failed: {exc}.") from exc
    except Exception as exc:
        raise EnvError(
            f"importing module {module_name!r} for env id {env_id!r} raised "
            f"{type(exc).__name__}: {exc}."
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise EnvError(
                f"module {module_name!r} has no attribute {attr!r} (env id {env_id!r}); its public "
                f"callables are: {', '.join(public) or 'none'}."
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise EnvError(
            f"{env_id!r} names a {type(obj).__name__}, not a callable; it must name a function or "
            "class returning a dm_env.Environment."
        )
    return obj


def _accepted_parameters(factory: Callable[..., Any]):
    """(names, takes_var_kwargs) of ``factory``'s keyword parameters, or None if unknown."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return None
    names = [
        p.name
        for p in sig.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    return names, var_kw


def _call_factory(env_id: str, factory: Callable[..., Any], seed: Optional[int], kwargs: Dict[str, Any], user: bool):
    params = _accepted_parameters(factory)
    call_kwargs = dict(kwargs)
    if params is not None:
        names, var_kw = params
        if not var_kw:
            unknown = sorted(k for k in kwargs if k not in names)
            if unknown:
                options = list(dict.fromkeys([n for n in names if n != "seed"] + list(WRAPPER_OPTIONS)))
                raise EnvError(
                    f"env {env_id!r} does not accept the option(s) {', '.join(unknown)}; accepted: "
                    f"{', '.join(options)}."
                )
        takes_seed = var_kw or "seed" in names
    else:
        takes_seed = True
    if takes_seed:
        call_kwargs["seed"] = seed
    elif seed is not None:
        warnings.warn(
            f"env factory {env_id!r} takes no seed argument, so seed={seed} is not applied; add a "
            "seed parameter to make its episodes reproducible.",
            stacklevel=3,
        )
    try:
        env = factory(**call_kwargs)
    except EnvError:
        raise
    except Exception as exc:
        if not user and isinstance(exc, (ValueError, TypeError)):
            raise EnvError(f"bad option for env {env_id!r}: {exc}") from exc
        # Where it was raised (the innermost frame): a command line prints the sentence alone,
        # without the chained traceback a library caller can still read.
        where = traceback.extract_tb(exc.__traceback__)[-1]
        raise EnvError(
            f"the factory for env {env_id!r} raised {type(exc).__name__}: {exc} (in {where.name}, "
            f"{where.filename} line {where.lineno})."
        ) from exc
    if not isinstance(env, dm_env.Environment):
        raise EnvError(
            f"the factory for env {env_id!r} returned an object of type {type(env).__name__}, not a "
            "dm_env.Environment; it must return a dm_env.Environment instance."
        )
    return env


def _option(name: str, value: Any, kind: str) -> Any:
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EnvError(f"option {name} must be an integer of at least 1, got {value!r}.")
    elif kind == "bins":
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 2):
            raise EnvError(f"option {name} must be a number of bins of at least 2 (or null), got {value!r}.")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise EnvError(f"option {name} must be true or false, got {value!r}.")
    elif kind == "opt_int":
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise EnvError(f"option {name} must be an integer of at least 1 (or null), got {value!r}.")
    elif kind == "keys":
        if isinstance(value, str):
            value = [value]
        if value is not None and (
            not isinstance(value, (list, tuple)) or not value or not all(isinstance(k, str) for k in value)
        ):
            raise EnvError(f"option {name} must be a non-empty list of observation keys, got {value!r}.")
    return value


def make(env_id: str, seed: Optional[int] = None, **kwargs: Any) -> dm_env.Environment:
    """Makes the env ``env_id`` (see the module docstring for ids and options).

    Args:
      env_id: a registered id, ``dmc/DOMAIN-TASK`` or ``package.module:callable``.
      seed: integer seed (same seed, same episodes) or ``None`` for fresh entropy.
      **kwargs: wrapper options (``WRAPPER_OPTIONS``) and factory options.

    Returns:
      A ``dm_env.Environment`` whose observations are a flat ``dict[str, np.ndarray]``
      (a single-array observation is exposed under ``"observation"``).

    Raises:
      EnvError: with one sentence naming what was wrong and what is accepted.
    """
    if not isinstance(env_id, str) or not env_id.strip():
        raise EnvError(f"env id must be a non-empty string, got {env_id!r}.")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise EnvError(f"seed must be an integer or None, got {seed!r}.")
        seed = int(seed)
    user = False
    if env_id.startswith("dmc/"):
        # The dmc factory repeats actions itself, below the renderer (one render per agent step).
        entry = _Entry(functools.partial(dmc.make_dmc, env_id), frozenset({"action_repeat"}))
    elif ":" in env_id:
        entry = _Entry(_load_callable(env_id))
        user = True
    elif env_id in _REGISTRY:
        entry = _REGISTRY[env_id]
        user = entry.factory not in (builtin.Catch, builtin.Reach)
    else:
        raise _unknown_id(env_id)

    options = {name: kwargs.pop(name) for name in WRAPPER_OPTIONS if name in kwargs and name not in entry.native_options}
    action_repeat = _option("action_repeat", options.get("action_repeat", 1), "int")
    frame_stack = _option("frame_stack", options.get("frame_stack", 1), "int")
    time_limit = _option("time_limit", options.get("time_limit"), "opt_int")
    keys = _option("observation_keys", options.get("observation_keys"), "keys")
    bins = _option("discretize", options.get("discretize"), "bins")
    clip = _option("clip_rewards", options.get("clip_rewards", False), "bool")

    env = _call_factory(env_id, entry.factory, seed, kwargs, user)
    env = ObservationDict(env)
    if action_repeat > 1:
        env = ActionRepeat(env, action_repeat)
    if time_limit is not None:
        env = TimeLimit(env, time_limit)
    if keys is not None:
        env = SelectObservation(env, keys)
    if frame_stack > 1:
        env = FrameStack(env, frame_stack)
    if bins is not None:
        env = DiscretizeActions(env, bins)
    elif needs_integer_actions(env.action_spec()):
        env = IntegerActions(env)
    if clip:
        env = ClipReward(env)
    return env
