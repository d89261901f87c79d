"""One rendering context for the dm_control envs of a thread whose models render alike.

dm_control gives every ``Physics`` its own OpenGL context and its own MuJoCo render context
(``mjrContext``: the offscreen framebuffer, textures, meshes, plane grids and built-in shapes,
all made from the model). An actor process steps many envs in turn, so every frame switched
the current OpenGL context, and with Mesa's llvmpipe a switch costs about as much as a fifth
of a small frame: 16 cartpole-swingup envs stepped in turn cost 0.94-1.04 ms of CPU per agent
step against 0.76 for one env, and 0.77 once they share one context (84x84, ``fast`` preset;
``docs/BENCHMARKS.md``, twentieth session). The frames are the same bit for bit.

:func:`share_contexts` gives a ``Physics`` that has no contexts yet the contexts shared by
every env of the calling thread whose model matches in everything ``mjr_makeContext`` reads
(:func:`render_signature`); what differs between such envs (poses, colours, sizes of
non-plane geoms, lights) reaches MuJoCo through each env's own ``mjvScene``. Models with
height fields are left alone: a task may re-upload a height field into its context each
episode (``quadruped-escape`` does), which would reach the other envs. Contexts are never
shared across threads (an OpenGL context is current on one thread at a time).

The shared contexts live as long as some env uses them: freeing a ``Physics`` (or losing the
last reference to it) releases its hold, and the last release frees them as dm_control would.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from typing import Any, Dict, Tuple

import numpy as np

__all__ = ["release_contexts", "render_signature", "share_contexts", "shared_context_count"]

# mjr_makeContext reads these model arrays (MuJoCo's render_context.c: makeMaterial,
# makeTexture, makeMesh, makeHField, makeSkin; flex arrays too, to be safe), the geoms'
# types, materials and plane sizes (makePlane), the visual settings and the model's extent.
_ARRAY_PREFIXES = ("tex_", "mat_", "mesh_", "hfield_", "skin_", "flex_")
_VISUAL_GROUPS = ("global_", "quality", "headlight", "map", "scale", "rgba")

_lock = threading.Lock()
_shared: Dict[Tuple[int, bytes], "_Shared"] = {}


def render_signature(model: Any) -> bytes:
    """A digest of what MuJoCo's render context is built from, for a ``mujoco.MjModel``.

    Two models with the same digest give render contexts that render any scene alike.
    """
    digest = hashlib.sha256()

    def add(name: str, value: Any) -> None:
        array = np.ascontiguousarray(value)
        digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
        digest.update(array.tobytes())

    for group in _VISUAL_GROUPS:
        settings = getattr(model.vis, group)
        for name in sorted(n for n in dir(settings) if not n.startswith("_")):
            value = getattr(settings, name)
            if not callable(value):
                add(f"vis.{group}.{name}", value)
    add("stat.extent", model.stat.extent)
    for name in sorted(n for n in dir(model) if n.startswith(_ARRAY_PREFIXES)):
        value = getattr(model, name)
        if isinstance(value, np.ndarray):
            add(name, value)
    import mujoco  # pylint: disable=import-outside-toplevel

    geom_type = np.asarray(model.geom_type)
    add("geom_type", geom_type)
    add("geom_matid", model.geom_matid)
    add("plane_size", np.asarray(model.geom_size)[geom_type == int(mujoco.mjtGeom.mjGEOM_PLANE)])
    return digest.digest()


class _Shared:
    """The OpenGL context and the MuJoCo render context of one (thread, signature)."""

    def __init__(self, key: Tuple[int, bytes], gl: Any, mjr: Any):
        self.key, self.gl, self.mjr = key, gl, mjr
        self.users = 0
        # A thread's id can be reused once it ends: an entry belongs to this thread object.
        self.thread = weakref.ref(threading.current_thread())


class _Lease:
    """One Physics' hold on a :class:`_Shared`; released once, by ``free`` or by collection."""

    def __init__(self, entry: _Shared):
        self._entry = entry
        self._released = False
        entry.users += 1
        entry.gl.increment_refcount()  # so that this Physics freeing its gl context frees nothing

    def release(self, free_now: bool) -> None:
        entry = self._entry
        with _lock:
            if self._released:
                return
            self._released = True
            entry.gl.decrement_refcount()
            entry.users -= 1
            last = entry.users == 0
            if last and _shared.get(entry.key) is entry:
                del _shared[entry.key]
        if last and free_now and entry.thread() is threading.current_thread():
            # As Physics.free does for its own contexts (MjrContext.free also frees the gl
            # context once no one else holds it). Otherwise (collected, or released on another
            # thread, where the context cannot be made current) dm_control's finalizers free
            # them once nothing refers to them.
            entry.mjr.free()


class _MjrRef:
    """Stands in for the shared ``MjrContext`` in one Physics' ``Contexts``."""

    def __init__(self, target: Any, lease: _Lease):
        self._target = target
        self._lease = lease
        weakref.finalize(self, lease.release, False)

    @property
    def ptr(self) -> Any:
        return self._target.ptr

    def free(self) -> None:
        self._lease.release(True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def _thread_id() -> int:
    return threading.get_ident()


def share_contexts(physics: Any) -> bool:
    """Gives ``physics`` (a dm_control ``Physics`` without rendering contexts yet) the calling
    thread's shared contexts for its model, making them if none match. Returns False, changing
    nothing, where it does not apply: the Physics has contexts already, its model has height
    fields, or dm_control's internals are not the ones this was written against (1.0.x)."""
    try:
        from dm_control import _render  # pylint: disable=import-outside-toplevel
        from dm_control.mujoco import engine, wrapper  # pylint: disable=import-outside-toplevel
    except ImportError:
        return False
    renderer = getattr(_render, "Renderer", None)
    lock = getattr(physics, "_contexts_lock", None)
    if renderer is None or lock is None or getattr(physics, "_contexts", False) is not None:
        return False
    if not all(hasattr(renderer, name) for name in ("increment_refcount", "decrement_refcount", "free")):
        return False
    model = physics.model.ptr
    if model.nhfield:
        return False
    key = (_thread_id(), render_signature(model))
    with _lock:
        entry = _shared.get(key)
        if entry is None or entry.thread() is not threading.current_thread():
            gl = renderer(max_width=model.vis.global_.offwidth, max_height=model.vis.global_.offheight)
            entry = _shared[key] = _Shared(key, gl, wrapper.MjrContext(physics.model, gl))
        lease = _Lease(entry)
    with lock:
        physics._contexts = engine.Contexts(gl=entry.gl, mujoco=_MjrRef(entry.mjr, lease))  # pylint: disable=protected-access
    return True


def release_contexts(physics: Any) -> bool:
    """Ends ``physics``' hold on shared contexts now (the last hold, released on the thread
    that made them, frees them); True if it had one. The Physics makes contexts of its own if
    it renders again."""
    lock = getattr(physics, "_contexts_lock", None)
    if lock is None:
        return False
    with lock:
        contexts = getattr(physics, "_contexts", None)
        ref = getattr(contexts, "mujoco", None)
        if not isinstance(ref, _MjrRef):
            return False
        physics._contexts = None  # pylint: disable=protected-access
    ref.free()
    return True


def shared_context_count() -> int:
    """How many shared context pairs are alive in this process (all threads)."""
    with _lock:
        return len(_shared)
