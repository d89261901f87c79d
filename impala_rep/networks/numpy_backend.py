"""NumPy backend of the agent network: one step, batched over envs, inference only.

TensorFlow-free (actors and evaluation use it; see DESIGN.md). Built from the same
:func:`~impala_rep.networks.config.plan_network` plan as the TensorFlow backend, with the
same parameter names and layouts, so ``numpy_net.set_params(tf_net.get_params())`` gives
the same outputs. Each convolution is one float32 matmul: the shallow CNN's strided convs
(kernel a multiple of the stride) by space-to-depth, the deep ResNet's 3x3 convs by im2col
(a strided view, one copy).

Shape letter: ``B`` batch (envs stepped together).

Usage on an actor::

    net = NumpyNetwork(NetworkConfig(), obs_specs, env_spec.action)
    net.set_params(params_from_learner)
    state = net.initial_state(num_envs)
    policy_params, value, state = net.step(obs, state, first)
    action, log_prob = net.policy.sample_np(policy_params, rng)
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Tuple

import numpy as np
from numpy.lib.stride_tricks import as_strided

from impala_rep.distributions import make_policy
from impala_rep.framestack import FrameHistory
from impala_rep.networks.config import (
    DEEP_SECTIONS,
    RESIDUAL_BLOCKS,
    SHALLOW_CONVS,
    NetworkConfig,
    plan_network,
)

__all__ = ["NumpyNetwork", "FrameStacks", "init_params"]


def init_params(plan, seed: int = 0) -> Dict[str, np.ndarray]:
    """Initial parameters: Glorot-uniform kernels, zero biases, LSTM forget-gate bias 1."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in plan.param_shapes.items():
        if name.endswith("/bias"):
            value = np.zeros(shape, np.float32)
            if name == "core/lstm/bias":
                n = shape[0] // 4
                value[n : 2 * n] = 1.0
        else:
            receptive = int(math.prod(shape[:-2])) if len(shape) > 2 else 1
            fan_in, fan_out = shape[-2] * receptive, shape[-1] * receptive
            limit = math.sqrt(6.0 / (fan_in + fan_out))
            value = rng.uniform(-limit, limit, size=shape).astype(np.float32)
        params[name] = value
    return params


def _pad_same(x: np.ndarray, k: int, s: int, value: float) -> np.ndarray:
    """Pads [B, H, W, C] the way TF's SAME padding does (extra on the bottom/right)."""
    b, h, w, c = x.shape
    ph = max((-(-h // s) - 1) * s + k - h, 0)
    pw = max((-(-w // s) - 1) * s + k - w, 0)
    if ph == 0 and pw == 0:
        return x
    out = np.full((b, h + ph, w + pw, c), value, dtype=x.dtype)
    out[:, ph // 2 : ph // 2 + h, pw // 2 : pw // 2 + w] = x
    return out


def _windows(x: np.ndarray, k: int, s: int) -> np.ndarray:
    """[B, H, W, C] -> strided view [B, OH, OW, k, k, C] of VALID windows."""
    b, h, w, c = x.shape
    oh, ow = (h - k) // s + 1, (w - k) // s + 1
    sb, sh, sw, sc = x.strides
    return as_strided(x, (b, oh, ow, k, k, c), (sb, sh * s, sw * s, sh, sw, sc), writeable=False)


def _conv(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray, s: int, same: bool, scale=None) -> np.ndarray:
    k = kernel.shape[0]
    if same:
        x = _pad_same(x, k, s, 0)
    win = _windows(np.ascontiguousarray(x), k, s)
    b, oh, ow = win.shape[:3]
    cols = win.reshape(b * oh * ow, -1)
    if cols.dtype != np.float32:
        cols = cols.astype(np.float32)
    out = cols @ kernel.reshape(-1, kernel.shape[-1])
    if scale is not None:
        out *= np.float32(scale)
    out += bias
    return out.reshape(b, oh, ow, -1)


def _s2d_kernel(kernel: np.ndarray, s: int) -> np.ndarray:
    """[k, k, C, O] (k = m*s) -> [s*s*C, m*m*O], the kernel of :func:`_conv_s2d`."""
    k, _, c, o = kernel.shape
    m = k // s
    big = kernel.reshape(m, s, m, s, c, o).transpose(1, 3, 4, 0, 2, 5)
    return np.ascontiguousarray(big.reshape(s * s * c, m * m * o), dtype=np.float32)


def _conv_s2d(x: np.ndarray, big_kernel: np.ndarray, bias: np.ndarray, k: int, s: int, scale=None) -> np.ndarray:
    """VALID conv with stride ``s`` and kernel ``k = m*s`` by space-to-depth.

    The input is regrouped into ``s x s`` blocks (``[B, H/s, W/s, s*s*C]``, no duplication),
    one matmul with the regrouped kernel gives each block's contribution to the ``m x m``
    outputs it touches, and ``m*m`` shifted adds assemble the output. Same result as
    im2col, with a 4x smaller matmul input and a wider, BLAS-friendlier product.
    """
    blocks = _s2d_blocks(x, k, s)
    return _s2d_assemble(blocks.reshape(-1, blocks.shape[-1]) @ big_kernel, x.shape, k, s, bias, scale)


def _s2d_grid(h: int, w: int, k: int, s: int) -> Tuple[int, int]:
    """``(hb, wb)``: the ``s x s`` blocks along each side that a VALID conv of kernel ``k``
    and stride ``s`` reads from an ``h x w`` image."""
    return (h - k) // s + k // s, (w - k) // s + k // s


def _s2d_view(x: np.ndarray, k: int, s: int) -> np.ndarray:
    """``x`` ``[B, H, W, C]`` regrouped into blocks, ``[B, hb, wb, s, s, C]`` (a view, no copy)."""
    b, h, w, c = x.shape
    hb, wb = _s2d_grid(h, w, k, s)
    return x[:, : hb * s, : wb * s].reshape(b, hb, s, wb, s, c).transpose(0, 1, 3, 2, 4, 5)


def _s2d_blocks(x: np.ndarray, k: int, s: int) -> np.ndarray:
    """The matmul input of :func:`_conv_s2d`: ``[B, hb*wb, s*s*C]`` float32."""
    view = _s2d_view(x, k, s)
    blocks = view.reshape(view.shape[0], view.shape[1] * view.shape[2], -1)
    return blocks if blocks.dtype == np.float32 else blocks.astype(np.float32)


def _s2d_assemble(z: np.ndarray, x_shape, k: int, s: int, bias, scale) -> np.ndarray:
    """The shifted adds of :func:`_conv_s2d`: ``z`` (``B*hb*wb`` rows of ``m*m*O``, in any
    shape that holds them in that order) -> ``[B, oh, ow, O]``."""
    b, h, w, _ = x_shape
    m = k // s
    oh, ow = (h - k) // s + 1, (w - k) // s + 1
    z = z.reshape(b, oh + m - 1, ow + m - 1, m, m, -1)
    out = z[:, :oh, :ow, 0, 0].copy()
    for i in range(m):
        for j in range(m):
            if i or j:
                out += z[:, i : i + oh, j : j + ow, i, j]
    if scale is not None:
        out *= np.float32(scale)
    if bias is not None:
        out += bias
    return out


def _frame_s2d_kernel(kernel: np.ndarray, k: int, s: int) -> np.ndarray:
    """[kh, kw, K*C, O] -> [K, s*s*C, m*m*O]: the :func:`_s2d_kernel` of each of the kernel's
    K slot slices.

    One frame's blocks times slice j give that frame's part of the :func:`_conv_s2d` product
    of a stack that holds it in slot j: the convolution is linear in its input channels, and
    slot j of a stack is its channels ``j*C .. (j+1)*C``.
    """
    c = kernel.shape[2] // k
    return np.stack([_s2d_kernel(kernel[:, :, j * c:(j + 1) * c], s) for j in range(k)])


def _max_pool_same(x: np.ndarray, k: int = 3, s: int = 2) -> np.ndarray:
    """Max-pool with TF's SAME padding: the maximum of k*k strided slices."""
    _, h, w, _ = x.shape
    oh, ow = -(-h // s), -(-w // s)
    x = _pad_same(x, k, s, -np.inf)
    out = None
    for i in range(k):
        for j in range(k):
            part = x[:, i : i + (oh - 1) * s + 1 : s, j : j + (ow - 1) * s + 1 : s]
            out = part.copy() if out is None else np.maximum(out, part, out=out)
    return out


def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0, out=x)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (0.5 * (np.tanh(0.5 * x) + 1.0)).astype(np.float32)


class NumpyNetwork:
    """The agent network in NumPy (see the module docstring and ``networks.config``).

    Args:
      config: the :class:`NetworkConfig`.
      obs_specs: ``{key: ArraySpec}`` per-step observations as the network sees them
        (frame-stacked keys with their stacked channels).
      action_spec: the env's action spec (the policy is ``make_policy(action_spec, config)``).
      seed: seed of the initial parameters (replaced by ``set_params`` in practice).
    """

    def __init__(self, config: NetworkConfig, obs_specs: Mapping[str, Any], action_spec: Any, seed: int = 0):
        self.config = config
        self.policy = make_policy(action_spec, config)
        self.plan = plan_network(config, obs_specs, self.policy)
        self.obs_specs = dict(obs_specs)
        self._params = init_params(self.plan, seed)
        self._derived: Dict[str, np.ndarray] = {}

    # -- parameters --
    @property
    def params(self) -> Dict[str, np.ndarray]:
        return dict(self._params)

    def set_params(self, params: Mapping[str, Any]) -> None:
        """Replaces every parameter; raises ``ValueError`` on missing, extra or misshapen ones."""
        new = {name: np.ascontiguousarray(v) for name, v in self.plan.check_params(params).items()}
        self._params = new
        self._derived = {}

    def _s2d(self, name: str, s: int, frames: int = 0) -> np.ndarray:
        """The space-to-depth form of kernel ``name``, cached until ``set_params``.

        With ``frames=K``, its per-frame form (:func:`_frame_s2d_kernel`).
        """
        cache_key = f"{name}@{frames}"
        big = self._derived.get(cache_key)
        if big is None:
            kernel = self._params[name]
            big = _frame_s2d_kernel(kernel, frames, s) if frames else _s2d_kernel(kernel, s)
            self._derived[cache_key] = big
        return big

    def initial_state(self, batch: int) -> Dict[str, np.ndarray]:
        """Zero LSTM state ``{"h": [B, H], "c": [B, H]}``; empty without an LSTM."""
        return {name: np.zeros((batch,) + shape, np.float32) for name, shape in self.config.core_state_shapes().items()}

    # -- forward --
    def _torso(self, t, x: np.ndarray, first_layer: int = 0) -> np.ndarray:
        """Torso ``t`` on ``x``; ``first_layer=1`` (shallow only): ``x`` is conv_0's output."""
        p = self._params
        pre = f"torso/{t.key}"
        b = x.shape[0]
        if t.kind == "mlp":
            h = x.reshape(b, -1)
            h = h.astype(np.float32) if h.dtype != np.float32 else h
            if t.scale is not None:
                h = h * np.float32(t.scale)
            for i in range(len(self.config.mlp_sizes)):
                h = _relu(h @ p[f"{pre}/dense_{i}/kernel"] + p[f"{pre}/dense_{i}/bias"])
            return h
        if t.kind == "shallow":
            h = x
            for i in range(first_layer, len(SHALLOW_CONVS)):
                _, k, s = SHALLOW_CONVS[i]
                scale = t.scale if i == 0 else None
                kernel, bias = p[f"{pre}/conv_{i}/kernel"], p[f"{pre}/conv_{i}/bias"]
                if k % s == 0:
                    h = _relu(_conv_s2d(h, self._s2d(f"{pre}/conv_{i}/kernel", s), bias, k, s, scale))
                else:
                    h = _relu(_conv(h, kernel, bias, s, False, scale))
        else:
            h = x.astype(np.float32)
            if t.scale is not None:
                h *= np.float32(t.scale)
            for si in range(len(DEEP_SECTIONS)):
                sp = f"{pre}/section_{si}"
                h = _conv(h, p[f"{sp}/conv/kernel"], p[f"{sp}/conv/bias"], 1, True)
                h = _max_pool_same(h)
                for r in range(RESIDUAL_BLOCKS):
                    rp = f"{sp}/res_{r}"
                    y = _conv(np.maximum(h, 0), p[f"{rp}/conv_0/kernel"], p[f"{rp}/conv_0/bias"], 1, True)
                    y = _conv(_relu(y), p[f"{rp}/conv_1/kernel"], p[f"{rp}/conv_1/bias"], 1, True)
                    h = h + y
            h = np.maximum(h, 0)
        h = h.reshape(b, -1)
        return _relu(h @ p[f"{pre}/dense/kernel"] + p[f"{pre}/dense/bias"])

    def step(
        self, obs: Mapping[str, np.ndarray], state: Mapping[str, np.ndarray], first: Any
    ) -> Tuple[Dict[str, np.ndarray], np.ndarray, Dict[str, np.ndarray]]:
        """One step for a batch of envs.

        Args:
          obs: ``{key: [B, *obs_shape]}`` (uint8 pixels stay uint8).
          state: the core state from :meth:`initial_state` or the previous step.
          first: [B] bool, true where the step starts an episode (resets the LSTM state).

        Returns:
          ``(policy_params {name: [B, *param_shape]}, value [B], new_state)``.
        """
        self._check_keys(obs)
        batch = None
        feats = []
        for t in self.plan.torsos:
            x = np.asarray(obs[t.key])
            batch = self._check_obs(t.key, x, t.input_shape, batch)
            feats.append(self._torso(t, x))
        return self._heads(feats, state, first, batch)

    def frame_stacks(self, frame_stack: Mapping[str, int], batch: int) -> "FrameStacks":
        """A :class:`FrameStacks` for :meth:`step_frames` on ``batch`` envs.

        ``frame_stack``: key -> K, the keys whose observations the network gets stacked K deep
        (their specs have K times the channels of one frame). Depths of 1 are dropped.
        """
        depths = {}
        torsos = {t.key: t for t in self.plan.torsos}
        for key, k in frame_stack.items():
            k = int(k)
            if k <= 1:
                continue
            t = torsos.get(key)
            if t is None:
                raise ValueError(f"frame_stack names {key!r}, which is not one of the network's keys {sorted(torsos)}.")
            if t.input_shape[-1] % k:
                raise ValueError(
                    f"observation {key!r} has {t.input_shape[-1]} channels, which is not a stack of {k} frames."
                )
            depths[key] = k
        return FrameStacks(depths, int(batch))

    def step_frames(
        self, obs: Mapping[str, np.ndarray], state: Mapping[str, np.ndarray], first: Any, stacks: "FrameStacks"
    ) -> Tuple[Dict[str, np.ndarray], np.ndarray, Dict[str, np.ndarray]]:
        """:meth:`step` on single frames: the network stacks the keys of ``stacks`` itself.

        ``obs[key]`` is the newest frame ``[B, H, W, C]`` for each key of ``stacks`` (from
        :meth:`frame_stacks`), the whole observation for the others. Same outputs as
        :meth:`step` on the stacks :class:`~impala_rep.framestack.FrameStacker` builds from
        the same frames and ``first`` flags (up to float rounding), and ``stacks`` is updated.

        A shallow torso regroups only the new frame into space-to-depth blocks and keeps the
        K newest frames' blocks, so its first convolution is one matmul on them (see
        :meth:`_stacked_conv0`). Other torsos get the stack, concatenated from the kept frames.
        """
        self._check_keys(obs)
        first = np.asarray(first, dtype=bool).reshape(-1)
        batch = stacks.batch
        if first.shape != (batch,):
            raise ValueError(f"first must have shape [B] = [{batch}], got {list(np.shape(first))}.")
        xs = {}
        for t in self.plan.torsos:  # check every key before any stack changes
            x = xs[t.key] = np.asarray(obs[t.key])
            k = stacks.depths.get(t.key)
            if k is None:
                self._check_obs(t.key, x, t.input_shape, batch)
            else:
                frame_shape = t.input_shape[:-1] + (t.input_shape[-1] // k,)
                self._check_obs(t.key, x, frame_shape, batch, f" (one frame of a stack of {k})")
        feats = []
        for t in self.plan.torsos:
            x = xs[t.key]
            k = stacks.depths.get(t.key)
            if k is None:
                feats.append(self._torso(t, x))
                continue
            frames = stacks.frames[t.key]
            frames.push(x, first)
            if t.kind == "shallow" and SHALLOW_CONVS[0][1] % SHALLOW_CONVS[0][2] == 0:
                feats.append(self._torso(t, self._stacked_conv0(t, k, x, first, stacks), first_layer=1))
            else:
                feats.append(self._torso(t, np.concatenate(frames.items(), axis=-1)))
        return self._heads(feats, state, first, batch)

    def _stacked_conv0(self, t, k: int, frame: np.ndarray, first: np.ndarray, stacks: "FrameStacks") -> np.ndarray:
        """The shallow torso's first layer (conv, ReLU) on the stacks, from a ring of blocks.

        ``stacks`` keeps the space-to-depth blocks of each env's K newest frames
        (:class:`_BlockRing`), so a step converts only the new frame. The ring's positions do
        not move: the newest frame overwrites the oldest, and the kernel's slot slices are
        put in the ring's order instead (:meth:`_ring_kernel`), so one matmul over all K
        frames' blocks gives the stack's product, and the shifted adds then run once on it.
        The blocks do not depend on the parameters: new ones take effect at the next step.
        """
        _, kernel, stride = SHALLOW_CONVS[0]
        ring = stacks.rings.get(t.key)
        if ring is None:
            ring = stacks.rings[t.key] = _BlockRing(k, frame.shape, kernel, stride)
        ring.push(frame, first)
        z = ring.matrix() @ self._ring_kernel(f"torso/{t.key}/conv_0/kernel", stride, k, ring.newest)
        bias = self._params[f"torso/{t.key}/conv_0/bias"]
        return _relu(_s2d_assemble(z, frame.shape, kernel, stride, bias, t.scale))

    def _ring_kernel(self, name: str, s: int, k: int, newest: int) -> np.ndarray:
        """Kernel ``name`` for a :class:`_BlockRing` whose newest frame is at ``newest``:
        ``[K*s*s*C, m*m*O]``, ring position r's rows being the slice of the stack slot the
        frame there fills (the newest frame slot K-1, the one before it K-2, ...).
        Cached until ``set_params``."""
        cache_key = f"{name}@ring{k}/{newest}"
        out = self._derived.get(cache_key)
        if out is None:
            slices = self._s2d(name, s, frames=k)  # [K, s*s*C, m*m*O], by stack slot
            out = np.ascontiguousarray(np.concatenate([slices[k - 1 - (newest - r) % k] for r in range(k)]))
            self._derived[cache_key] = out
        return out

    def _check_keys(self, obs: Mapping[str, np.ndarray]) -> None:
        missing = [t.key for t in self.plan.torsos if t.key not in obs]
        if missing:
            raise ValueError(f"obs lacks keys {missing}; the network needs {[t.key for t in self.plan.torsos]}.")

    @staticmethod
    def _check_obs(key: str, x: np.ndarray, shape: Tuple[int, ...], batch, what: str = "") -> int:
        """Checks ``x`` is ``[B, *shape]`` with the batch of the other keys; returns B."""
        if x.shape[1:] != tuple(shape):
            raise ValueError(f"obs[{key!r}] must have shape [B, {', '.join(map(str, shape))}]{what}, got {list(x.shape)}.")
        if batch is not None and x.shape[0] != batch:
            raise ValueError(f"obs[{key!r}] has batch {x.shape[0]}, other keys have {batch}.")
        return x.shape[0]

    def _heads(self, feats, state: Mapping[str, np.ndarray], first: Any, batch: int):
        """The core and the heads on the torso outputs: ``(policy_params, value, new_state)``."""
        p = self._params
        h = feats[0] if len(feats) == 1 else np.concatenate(feats, axis=-1)
        new_state: Dict[str, np.ndarray] = {}
        if self.plan.lstm_size is not None:
            n = self.plan.lstm_size
            first = np.asarray(first, dtype=bool).reshape(-1)
            if first.shape != (batch,):
                raise ValueError(f"first must have shape [B] = [{batch}], got {list(np.shape(first))}.")
            keep = (~first).astype(np.float32)[:, None]
            h_prev = np.asarray(state["h"], np.float32) * keep
            c_prev = np.asarray(state["c"], np.float32) * keep
            z = h @ p["core/lstm/kernel"] + h_prev @ p["core/lstm/recurrent_kernel"] + p["core/lstm/bias"]
            i, f, g, o = z[:, :n], z[:, n : 2 * n], z[:, 2 * n : 3 * n], z[:, 3 * n :]
            c = _sigmoid(f) * c_prev + _sigmoid(i) * np.tanh(g)
            h = _sigmoid(o) * np.tanh(c)
            new_state = {"h": h.astype(np.float32), "c": c.astype(np.float32)}
        raw = {}
        for name, shape in self.plan.head_shapes.items():
            out = h @ p[f"policy/{name}/kernel"] + p[f"policy/{name}/bias"]
            raw[name] = out.reshape((batch,) + tuple(shape))
        policy_params = self.policy.params_from_head_np(raw)
        value = (h @ p["value/kernel"] + p["value/bias"])[:, 0]
        return policy_params, value, new_state


class FrameStacks:
    """What :meth:`NumpyNetwork.step_frames` keeps between steps (make it with
    :meth:`NumpyNetwork.frame_stacks`).

    Per stacked key: ``frames[key]``, the K newest frames of each env's episode (a
    :class:`~impala_rep.framestack.FrameHistory`), and for a shallow torso ``rings[key]``,
    those frames' space-to-depth blocks (a :class:`_BlockRing`, made at the first step).
    """

    def __init__(self, depths: Mapping[str, int], batch: int):
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}.")
        self.depths = dict(depths)
        self.batch = batch
        self.frames = {key: FrameHistory(k) for key, k in self.depths.items()}
        self.rings: Dict[str, "_BlockRing"] = {}

    def prefix(self, key: str, upcoming: np.ndarray) -> np.ndarray:
        """The K-1 frames before the next step, time-major ``[K-1, B, ...]``: the frame prefix
        of an unroll that the next step opens (before any step, copies of ``upcoming``, the
        next step's frames, which the rule then uses)."""
        frames = self.frames[key]
        if frames.empty:
            return np.repeat(np.asarray(upcoming)[None], frames.k - 1, axis=0)
        return np.stack(frames.items()[1:])


class _BlockRing:
    """The space-to-depth blocks (:func:`_s2d_blocks`) of each env's K newest frames, float32.

    ``blocks`` is ``[B, hb, wb, K, s, s, C]``: for every block of the image, the K frames'
    ``s x s x C`` pixels side by side, so that ``matrix()``, ``[B*hb*wb, K*s*s*C]``, times a
    kernel whose rows follow the same order is the first convolution's product on the
    stacks. Position ``newest`` holds the newest frame, ``newest - 1`` (mod K) the one before
    it, and so on; a push overwrites the oldest position. Rows that start an episode get the
    new frame in every position (the stacking rule: the missing older frames are copies of
    the first).
    """

    def __init__(self, k: int, frame_shape: Tuple[int, ...], kernel: int, stride: int):
        b, h, w, c = frame_shape
        self.k, self.kernel, self.s = k, kernel, stride
        hb, wb = _s2d_grid(h, w, kernel, stride)
        self.blocks = np.empty((b, hb, wb, k, stride, stride, c), np.float32)
        self.newest = -1  # nothing pushed yet

    def push(self, frame: np.ndarray, first: np.ndarray) -> None:
        """Writes the newest frame ``[B, H, W, C]``; ``first`` [B] marks rows that start an episode."""
        fresh = self.newest < 0
        self.newest = (self.newest + 1) % self.k
        # The frame's blocks, converted to float32 as they are written.
        self.blocks[:, :, :, self.newest] = _s2d_view(frame, self.kernel, self.s)
        if fresh:
            self.blocks[:] = self.blocks[:, :, :, self.newest : self.newest + 1]
        elif first.any():
            rows = np.flatnonzero(first)
            self.blocks[rows] = self.blocks[rows][:, :, :, self.newest : self.newest + 1]

    def matrix(self) -> np.ndarray:
        """``[B*hb*wb, K*s*s*C]``, a view of the blocks."""
        b, hb, wb = self.blocks.shape[:3]
        return self.blocks.reshape(b * hb * wb, -1)
