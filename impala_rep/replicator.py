"""The replicator core: one step function, run on N replicas, with named collectives.

A thin, explicit layer over ``tf.distribute`` in the spirit of TF-Replicator (Buchlovsky et
al. 2019): the researcher writes a single-replica ``step_fn``; the replicator places
variables (:meth:`Replicator.scope`), splits a global batch along its batch axis
(:meth:`Replicator.distribute`), runs ``step_fn`` on every replica (:meth:`Replicator.run`)
and offers MPI-style collectives inside a replica (:meth:`Replicator.all_reduce`,
:meth:`Replicator.all_gather`, :meth:`Replicator.broadcast`) plus a gradient all-reduce for
the optimizer (:meth:`Replicator.wrap_optimizer`, TF-Replicator's ``wrap_optimizer``).

Kinds (:func:`make_replicator`):

  ``cpu``          N logical CPU devices in this process (``MirroredStrategy``). How every
                   multi-replica test runs on a machine without accelerators.
  ``gpu``          all or some local GPUs (``MirroredStrategy``).
  ``tpu``          the cores of a TPU, local or at an address (``TPUStrategy``).
  ``multiworker``  one process per host, ``TF_CONFIG``-style cluster
                   (``MultiWorkerMirroredStrategy``); replicas are the devices of all workers.
  ``auto``         a TPU if one is attached, else all local GPUs, else CPU.

Collectives are named by mesh axis (as in Mesh-TensorFlow). Replicas form one axis,
``"batch"`` (:data:`BATCH_AXIS`): data parallelism splits the batch dimension ``B``. Naming
the axis now keeps the API stable if other dimensions are split later.

Usage::

    replicator = make_replicator("cpu", num_replicas=4)   # before TF initialises devices
    with replicator.scope():
        model = build_model()                             # mirrored variables
        optimizer = replicator.wrap_optimizer(tf_keras.optimizers.RMSprop(6e-4), clip_norm=40.0)

    @tf.function
    def train(global_batch):                              # [T+1, B, ...]
        def step_fn(batch):                               # [T+1, B / N, ...] on one replica
            with tf.GradientTape() as tape:
                loss = loss_fn(model, batch)              # summed over the replica's batch
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))  # all-reduced
            return replicator.all_reduce(loss)            # the global loss, on every replica
        per_replica = replicator.run(step_fn, (replicator.distribute(global_batch, axis=1),))
        return replicator.reduce("mean", per_replica)     # identical values: mean = value

Errors: bad arguments raise ``ValueError``/``TypeError``; a missing or unreachable device,
or devices that can no longer be configured, raise :class:`ReplicatorError` (a
``RuntimeError``). Each message is one sentence that names the fix.

This module imports TensorFlow lazily (inside functions): importing it configures nothing.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Tuple, Union

__all__ = [
    "BATCH_AXIS",
    "KINDS",
    "Replicator",
    "ReplicatedOptimizer",
    "ReplicatorError",
    "configure_logical_cpus",
    "make_replicator",
    "parse_cluster_spec",
]

BATCH_AXIS = "batch"
KINDS = ("cpu", "gpu", "tpu", "multiworker", "auto")
_OPS = ("sum", "mean", "max", "min")


class ReplicatorError(RuntimeError):
    """The devices a replicator needs are missing, unreachable or can no longer be configured."""


# --------------------------------------------------------------------------------------
# Device set-up.


def configure_logical_cpus(num: int) -> list:
    """Makes at least ``num`` logical CPU devices exist; returns the names of the first ``num``.

    Must run before TensorFlow initialises its devices (before any other TensorFlow op). If an
    earlier configuration (e.g. a test harness) already gives ``num`` or more, it is kept. If
    TensorFlow has already initialised with fewer devices, raises :class:`ReplicatorError`.
    """
    import tensorflow as tf

    num = _positive_int(num, "num_replicas")
    cpus = tf.config.list_physical_devices("CPU")
    existing = tf.config.get_logical_device_configuration(cpus[0]) or []
    if len(existing) < num:
        try:
            tf.config.set_logical_device_configuration(
                cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(num)]
            )
        except RuntimeError:
            have = len(tf.config.list_logical_devices("CPU"))
            if have < num:
                raise ReplicatorError(
                    f"TensorFlow has already initialised {have} logical CPU device(s), so "
                    f"{num} can no longer be configured: call make_replicator('cpu', "
                    f"num_replicas={num}) before TensorFlow initialises its devices (before any "
                    "other TensorFlow op), or restart the process."
                ) from None
    devices = tf.config.list_logical_devices("CPU")
    if len(devices) < num:  # pragma: no cover - defensive, TF contract
        raise ReplicatorError(
            f"only {len(devices)} logical CPU device(s) exist after configuring {num}: restart "
            "the process and call make_replicator before any other TensorFlow op."
        )
    return [d.name for d in devices[:num]]


def parse_cluster_spec(tf_config: Union[str, Mapping[str, Any], None]) -> dict:
    """Validates a ``TF_CONFIG``-style cluster description and returns it as a dict.

    Expected form (a dict or its JSON text; ``None`` reads the ``TF_CONFIG`` environment
    variable)::

        {"cluster": {"worker": ["host0:port", "host1:port"]},
         "task": {"type": "worker", "index": 0}}

    Raises ``ValueError`` naming what is wrong.
    """
    example = (
        'e.g. {"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}, '
        '"task": {"type": "worker", "index": 0}}'
    )
    if tf_config is None:
        text = os.environ.get("TF_CONFIG")
        if not text:
            raise ValueError(
                "multiworker needs a cluster spec: pass cluster=... or set the TF_CONFIG "
                f"environment variable, {example}."
            )
        tf_config = text
    if isinstance(tf_config, (str, bytes)):
        try:
            tf_config = json.loads(tf_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the cluster spec is not valid JSON ({exc.msg}); give it as {example}.") from None
    if not isinstance(tf_config, Mapping):
        raise ValueError(f"the cluster spec must be a mapping, got {type(tf_config).__name__}; give it as {example}.")
    cluster = tf_config.get("cluster")
    if not isinstance(cluster, Mapping) or not cluster:
        raise ValueError(f"the cluster spec has no 'cluster' mapping of job name to addresses; give it as {example}.")
    workers = cluster.get("worker")
    if not isinstance(workers, (list, tuple)) or not workers:
        raise ValueError(f"the cluster spec needs a non-empty 'worker' list of host:port addresses, {example}.")
    for job, addresses in cluster.items():
        if job != "worker":
            raise ValueError(
                f"the cluster spec has job {job!r}; multiworker replication uses only the "
                f"'worker' job (worker 0 acts as chief), {example}."
            )
        if not isinstance(addresses, (list, tuple)) or not addresses:
            raise ValueError(f"cluster job {job!r} must list at least one host:port address, {example}.")
        for address in addresses:
            host, sep, port = str(address).rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"cluster address {address!r} of job {job!r} is not host:port with a port in "
                    f"1-65535, {example}."
                )
    task = tf_config.get("task")
    if not isinstance(task, Mapping) or "type" not in task or "index" not in task:
        raise ValueError(f"the cluster spec needs a 'task' with 'type' and 'index' saying which worker this is, {example}.")
    task_type, index = task["type"], task["index"]
    if task_type not in cluster:
        raise ValueError(f"task type {task_type!r} is not a job of the cluster {sorted(cluster)}.")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(cluster[task_type]):
        raise ValueError(
            f"task index {index!r} must be an integer in [0, {len(cluster[task_type])}) for job "
            f"{task_type!r}."
        )
    return {
        "cluster": {job: [str(a) for a in addrs] for job, addrs in cluster.items()},
        "task": {"type": str(task_type), "index": int(index)},
    }


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}.")
    return value


def _host_port(address: str) -> Optional[Tuple[str, int]]:
    """``(HOST, PORT)`` of ``[grpc://]HOST:PORT``; None for a TPU name."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def _reachable(address: str, timeout: float = 3.0) -> bool:
    host_port = _host_port(address)
    if host_port is None:
        return True  # a TPU name, not host:port: let the resolver decide
    try:
        with socket.create_connection(host_port, timeout=timeout):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------------------
# The replicator.


class Replicator:
    """A ``tf.distribute.Strategy`` with an explicit, named-axis replica API.

    Build it with :func:`make_replicator`. Attributes: ``kind``, ``strategy`` (the underlying
    ``tf.distribute.Strategy``), ``num_replicas`` (all replicas, over all workers),
    ``devices`` (this process's replica devices), ``worker_index`` and ``num_workers``.
    """

    def __init__(self, strategy: Any, kind: str, num_workers: int = 1, worker_index: int = 0):
        self.strategy = strategy
        self.kind = kind
        self.num_workers = int(num_workers)
        self.worker_index = int(worker_index)

    def __repr__(self) -> str:
        return (
            f"Replicator(kind={self.kind!r}, num_replicas={self.num_replicas}, "
            f"devices={list(self.devices)})"
        )

    @property
    def num_replicas(self) -> int:
        return int(self.strategy.num_replicas_in_sync)

    @property
    def devices(self) -> Tuple[str, ...]:
        return tuple(self.strategy.extended.worker_devices)

    @property
    def is_chief(self) -> bool:
        """True on the worker that should write checkpoints and logs (worker 0)."""
        return self.worker_index == 0

    # -- cross-replica context -------------------------------------------------------

    def scope(self):
        """Context manager: variables created inside are mirrored on every replica."""
        return self.strategy.scope()

    def distribute(self, batch: Any, axis: Any = 1) -> Any:
        """Splits a global batch (a nest of arrays/tensors) into per-replica shards.

        ``axis`` is the batch axis: an int for every entry (default 1, ``B`` of time-major
        ``[T+1, B, ...]`` arrays), or a nest of ints with the structure of ``batch`` (e.g.
        ``0`` for recurrent states ``[B, ...]``). Replica ``r`` (its global id over all
        workers) receives slice ``r`` of ``N`` equal slices. Works eagerly and inside
        ``tf.function``. For ``multiworker`` every worker passes the same global batch and
        keeps its replicas' slices. Raises ``ValueError`` when a batch axis is not divisible
        by ``num_replicas``.
        """
        import tensorflow as tf

        n = self.num_replicas
        flat = tf.nest.flatten(batch)
        if isinstance(axis, int) and not isinstance(axis, bool):
            axes = [axis] * len(flat)
        else:
            try:
                tf.nest.assert_same_structure(batch, axis)
            except (ValueError, TypeError):
                raise ValueError(
                    "axis must be an int or a nest of ints with the structure of the batch."
                ) from None
            axes = tf.nest.flatten(axis)
        for path, x, ax in zip(_paths(batch), flat, axes):
            shape = x.shape
            rank = len(shape)
            if rank == 0 or not -rank <= ax < rank:
                raise ValueError(
                    f"batch entry {path} has shape {list(shape)}, which has no axis {ax} to "
                    "split across replicas."
                )
            size = shape[ax]
            if size is None:
                raise ValueError(
                    f"batch entry {path} has an unknown size on axis {ax}; give the step a "
                    "fixed input signature so the batch can be split across replicas."
                )
            if int(size) % n:
                raise ValueError(
                    f"batch entry {path} has size {int(size)} on axis {ax}, which is not "
                    f"divisible by the {n} replicas: use a batch size that is a multiple of {n} "
                    f"(e.g. {max(n, int(size) // n * n)}) or change num_replicas."
                )
        structure = batch

        def shard(ctx):
            r = ctx.replica_id_in_sync_group
            num = ctx.num_replicas_in_sync
            pieces = [
                tf.convert_to_tensor(x) if num == 1 else tf.split(tf.convert_to_tensor(x), num, axis=ax)[r]
                for x, ax in zip(flat, axes)
            ]
            return tf.nest.pack_sequence_as(structure, pieces)

        return self.strategy.experimental_distribute_values_from_function(shard)

    def run(self, step_fn: Callable, args: Sequence[Any] = (), kwargs: Optional[Mapping] = None) -> Any:
        """Runs ``step_fn(*args, **kwargs)`` on every replica; returns per-replica results.

        Distributed arguments (from :meth:`distribute`) give each replica its shard; other
        arguments are passed to every replica unchanged.
        """
        return self.strategy.run(step_fn, args=tuple(args), kwargs=dict(kwargs or {}))

    def reduce(self, op: str, value: Any) -> Any:
        """Reduces per-replica values (a nest) across replicas, in cross-replica context.

        ``op`` is ``"sum"`` or ``"mean"``; returns ordinary tensors.
        """
        import tensorflow as tf

        reduce_op = _reduce_op(op, allowed=("sum", "mean"))
        # Leaf by leaf: MultiWorkerMirroredStrategy.reduce rejects some nests of tensors.
        return tf.nest.map_structure(lambda v: self.strategy.reduce(reduce_op, v, axis=None), value)

    def local_results(self, value: Any) -> Tuple[Any, ...]:
        """This process's per-replica values of ``value``, in replica order."""
        return self.strategy.experimental_local_results(value)

    # -- replica context (inside step_fn) --------------------------------------------

    def replica_id(self):
        """This replica's index along the ``"batch"`` axis (a scalar int32 tensor)."""
        import tensorflow as tf

        ctx = _replica_context(self.strategy)
        return tf.cast(ctx.replica_id_in_sync_group, tf.int32)

    def all_reduce(self, x: Any, op: str = "sum", axis_name: str = BATCH_AXIS) -> Any:
        """Reduces a nest of tensors over all replicas; every replica gets the result.

        ``op``: ``"sum"`` (sum over replicas), ``"mean"`` (sum / num_replicas), ``"max"`` or
        ``"min"`` (element-wise). Call inside a replica step function.
        """
        import tensorflow as tf

        _check_axis(axis_name)
        op = _check_op(op)
        ctx = _replica_context(self.strategy)
        if op in ("sum", "mean"):
            return ctx.all_reduce(_reduce_op(op), x)

        reducer = tf.reduce_max if op == "max" else tf.reduce_min

        def one(t):
            gathered = ctx.all_gather(tf.expand_dims(t, 0), axis=0)
            return reducer(gathered, axis=0)

        return tf.nest.map_structure(one, x)

    def all_gather(self, x: Any, axis: int = 0, axis_name: str = BATCH_AXIS) -> Any:
        """Concatenates each replica's tensor along ``axis``, in replica order, on every replica.

        Per-replica shapes must be equal; the result's ``axis`` is ``num_replicas`` times longer.
        A scalar is gathered into a vector of ``num_replicas`` values.
        """
        import tensorflow as tf

        _check_axis(axis_name)
        ctx = _replica_context(self.strategy)

        def one(t):
            t = tf.convert_to_tensor(t)
            if t.shape.rank == 0:
                return ctx.all_gather(tf.expand_dims(t, 0), axis=0)
            return ctx.all_gather(t, axis=axis)

        return tf.nest.map_structure(one, x)

    def broadcast(self, x: Any, source: int = 0, axis_name: str = BATCH_AXIS) -> Any:
        """Every replica gets replica ``source``'s value of ``x`` (a nest of numeric tensors).

        Implemented as one sum all-reduce in which every replica but ``source`` contributes
        zeros, so values arrive bit-exact.
        """
        import tensorflow as tf

        _check_axis(axis_name)
        if isinstance(source, bool) or not isinstance(source, int) or not 0 <= source < self.num_replicas:
            raise ValueError(f"broadcast source must be a replica index in [0, {self.num_replicas}), got {source!r}.")
        ctx = _replica_context(self.strategy)
        is_source = tf.equal(tf.cast(ctx.replica_id_in_sync_group, tf.int32), source)

        def one(t):
            t = tf.convert_to_tensor(t)
            if t.dtype == tf.bool:
                masked = tf.where(is_source, tf.cast(t, tf.int32), tf.zeros_like(t, tf.int32))
                return tf.cast(ctx.all_reduce(tf.distribute.ReduceOp.SUM, masked), tf.bool)
            return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.where(is_source, t, tf.zeros_like(t)))

        return tf.nest.map_structure(one, x)

    def all_reduce_gradients(self, grads: Sequence[Any], op: str = "sum") -> list:
        """All-reduces a list of gradients (``None`` entries stay ``None``) in a replica.

        ``"sum"`` matches losses summed over the batch (impala_rep's convention): the summed
        per-replica gradients equal the gradient of the global loss on one replica.
        """
        _check_op(op)
        if op not in ("sum", "mean"):
            raise ValueError(f"gradients are all-reduced with 'sum' or 'mean', got {op!r}.")
        present = [g for g in grads if g is not None]
        reduced = iter(self.all_reduce(present, op=op) if present else [])
        return [None if g is None else next(reduced) for g in grads]

    def wrap_optimizer(self, optimizer: Any, clip_norm: Optional[float] = None, op: str = "sum") -> "ReplicatedOptimizer":
        """Wraps a ``tf_keras`` optimizer so that ``apply_gradients`` all-reduces first.

        TF-Replicator's ``wrap_optimizer``: see :class:`ReplicatedOptimizer`.
        """
        return ReplicatedOptimizer(self, optimizer, clip_norm=clip_norm, op=op)


class ReplicatedOptimizer:
    """An optimizer whose gradients are all-reduced across replicas before they are applied.

    In a replica: ``apply_gradients(grads_and_vars)`` all-reduces the gradients over the
    ``"batch"`` axis (``op``, default ``"sum"``), clips them by global norm when ``clip_norm``
    is set (``tf.clip_by_global_norm``, after the all-reduce, so every replica clips the same
    global gradient), and hands them to the wrapped optimizer with its own aggregation turned
    off. Returns the global gradient norm before clipping. The wrapped optimizer is
    ``.optimizer`` (checkpoint that one).
    """

    def __init__(self, replicator: Replicator, optimizer: Any, clip_norm: Optional[float] = None, op: str = "sum"):
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm must be positive or None, got {clip_norm!r}.")
        self.replicator = replicator
        self.optimizer = optimizer
        self.clip_norm = clip_norm
        self.op = op

    @property
    def iterations(self):
        return self.optimizer.iterations

    def apply_gradients(self, grads_and_vars: Iterable[Tuple[Any, Any]]):
        import tensorflow as tf

        grads_and_vars = list(grads_and_vars)
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        missing = [v.name for g, v in grads_and_vars if g is None]
        if missing:
            raise ValueError(
                f"no gradient for variable(s) {missing}: the loss does not depend on them; drop "
                "them from the optimised variables or check the loss."
            )
        grads = self.replicator.all_reduce_gradients(grads, op=self.op)
        if self.clip_norm is not None:
            grads, norm = tf.clip_by_global_norm(grads, self.clip_norm)
        else:
            norm = tf.linalg.global_norm(grads)
        _apply_without_aggregation(self.optimizer, zip(grads, variables))
        return norm


def _apply_without_aggregation(optimizer, grads_and_vars):
    import inspect

    params = inspect.signature(optimizer.apply_gradients).parameters
    if "skip_gradients_aggregation" in params:  # tf_keras.optimizers (Keras 2.11+ API)
        return optimizer.apply_gradients(grads_and_vars, skip_gradients_aggregation=True)
    if "experimental_aggregate_gradients" in params:  # tf_keras.optimizers.legacy
        return optimizer.apply_gradients(grads_and_vars, experimental_aggregate_gradients=False)
    raise TypeError(
        f"{type(optimizer).__name__}.apply_gradients cannot skip gradient aggregation; use a "
        "tf_keras optimizer (Keras 3 optimizers fail inside tf.distribute custom loops on TF 2.21)."
    )


# --------------------------------------------------------------------------------------
# Helpers.


def _paths(nest: Any, prefix: str = "") -> list:
    """Names of the leaves of a nest of dicts/lists/tuples, in ``tf.nest.flatten`` order."""
    if isinstance(nest, Mapping):
        out = []
        for key in sorted(nest):
            out += _paths(nest[key], f"{prefix}{key}/")
        return out
    if isinstance(nest, (list, tuple)):
        out = []
        for i, item in enumerate(nest):
            out += _paths(item, f"{prefix}{i}/")
        return out
    return [repr(prefix.rstrip("/") or "<root>")]


def _check_axis(axis_name: str) -> None:
    if axis_name != BATCH_AXIS:
        raise ValueError(
            f"unknown replica axis {axis_name!r}: replicas form the single axis {BATCH_AXIS!r} "
            "(data parallelism over the batch dimension)."
        )


def _check_op(op: str) -> str:
    if op not in _OPS:
        raise ValueError(f"reduction op must be one of {list(_OPS)}, got {op!r}.")
    return op


def _reduce_op(op: str, allowed: Sequence[str] = ("sum", "mean")):
    import tensorflow as tf

    if op not in allowed:
        raise ValueError(f"reduction op must be one of {list(allowed)} here, got {op!r}.")
    return tf.distribute.ReduceOp.SUM if op == "sum" else tf.distribute.ReduceOp.MEAN


def _replica_context(strategy):
    import tensorflow as tf

    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.strategy is not strategy:
        raise RuntimeError(
            "replica collectives (all_reduce, all_gather, broadcast) must be called inside the "
            "step function passed to Replicator.run, not in cross-replica context."
        )
    return ctx


# --------------------------------------------------------------------------------------
# Factory.


def make_replicator(
    kind: str = "auto",
    num_replicas: Optional[int] = None,
    *,
    devices: Optional[Sequence[str]] = None,
    tpu: Optional[str] = None,
    cluster: Union[str, Mapping[str, Any], None] = None,
    devices_per_worker: Optional[int] = None,
    timeout_seconds: Optional[float] = 120.0,
) -> Replicator:
    """Builds a :class:`Replicator`.

    Args:
      kind: ``cpu``, ``gpu``, ``tpu``, ``multiworker`` or ``auto`` (TPU, else GPUs, else CPU).
      num_replicas: ``cpu``: logical CPU devices to create and use (default 1); ``gpu``: how
        many local GPUs to use (default all); ``tpu``: must equal the TPU's core count if
        given; ``multiworker``: must equal workers x devices per worker if given.
      devices: ``gpu`` only: explicit device names, e.g. ``["/gpu:0", "/gpu:2"]``.
      tpu: ``tpu``/``auto``: a TPU name or ``grpc://host:port`` address; ``None`` or
        ``"local"`` means a TPU attached to this host.
      cluster: ``multiworker``: a ``TF_CONFIG``-style dict or JSON text (see
        :func:`parse_cluster_spec`); ``None`` reads the ``TF_CONFIG`` environment variable.
      devices_per_worker: ``multiworker``: local replicas per worker: that many logical CPU
        devices, or the local GPUs when there are any (default: all local GPUs, else 1 CPU).
      timeout_seconds: ``multiworker``: how long a collective waits for peers before failing.

    ``cpu`` and ``multiworker`` configure TensorFlow devices, so call this before any other
    TensorFlow op in the process.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown replicator kind {kind!r}; choose one of {list(KINDS)}.")
    if num_replicas is not None:
        _positive_int(num_replicas, "num_replicas")
    if devices is not None and kind != "gpu":
        raise ValueError(f"devices= applies to kind 'gpu' only, got kind {kind!r}.")
    if kind == "auto":
        return _make_auto(num_replicas, tpu)
    if kind == "cpu":
        return _make_cpu(num_replicas or 1)
    if kind == "gpu":
        return _make_gpu(num_replicas, devices)
    if kind == "tpu":
        return _make_tpu(tpu, num_replicas)
    return _make_multiworker(cluster, num_replicas, devices_per_worker, timeout_seconds)


def _make_cpu(num: int) -> Replicator:
    import tensorflow as tf

    names = configure_logical_cpus(num)
    # Reduce through one device rather than with collective ops: MirroredStrategy's in-process
    # collectives key their groups per strategy instance, so two CPU replicators of different
    # sizes in one process (tests, benchmarks) would collide ("joining a group with size 4,
    # but that group has size 2").
    cross_device_ops = tf.distribute.ReductionToOneDevice(reduce_to_device=names[0])
    return Replicator(tf.distribute.MirroredStrategy(devices=names, cross_device_ops=cross_device_ops), "cpu")


def _make_gpu(num: Optional[int], devices: Optional[Sequence[str]]) -> Replicator:
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise ReplicatorError(
            "no GPU is visible to TensorFlow (check the CUDA driver and CUDA_VISIBLE_DEVICES, and "
            "that the installed TensorFlow has GPU support), or use kind='cpu'."
        )
    if devices is not None:
        devices = [str(d) for d in devices]
        if not devices:
            raise ValueError("devices= must name at least one GPU, e.g. ['/gpu:0'].")
        if num is not None and num != len(devices):
            raise ValueError(f"num_replicas={num} disagrees with the {len(devices)} devices given; give one or the other.")
        known = {d.name.lower() for d in tf.config.list_logical_devices("GPU")}
        known |= {n.replace("/device:gpu:", "/gpu:").lower() for n in known} | {
            n.split("/device:", 1)[-1].lower() for n in known
        }
        unknown = [d for d in devices if d.lower() not in known and d.lower().replace("/gpu:", "/device:gpu:") not in known]
        if unknown:
            raise ValueError(f"unknown GPU device(s) {unknown}; this host has {sorted(known)}.")
    else:
        n = len(gpus) if num is None else num
        if n > len(gpus):
            raise ReplicatorError(
                f"{n} GPU replicas were asked for but this host has {len(gpus)} GPU(s): use "
                f"num_replicas<={len(gpus)}."
            )
        devices = [f"/gpu:{i}" for i in range(n)]
    return Replicator(tf.distribute.MirroredStrategy(devices=devices), "gpu")


def _make_tpu(address: Optional[str], num: Optional[int]) -> Replicator:
    import tensorflow as tf

    local = address in (None, "", "local")
    if local:
        if not tf.config.list_physical_devices("TPU"):
            raise ReplicatorError(
                "no TPU is attached to this host: run on a TPU VM, pass tpu='grpc://HOST:PORT' "
                "for a remote TPU, or use kind='cpu' or 'gpu'."
            )
    elif not _reachable(address):
        raise ReplicatorError(
            f"the TPU at {address!r} cannot be reached: check the address and network, or use "
            "kind='cpu' or 'gpu'."
        )
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="local" if local else address)
        if not local:
            tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        strategy = tf.distribute.TPUStrategy(resolver)
    except (ValueError, RuntimeError, OSError, tf.errors.OpError) as exc:
        # OSError: a TPU name (not grpc://HOST:PORT) is looked up through the cloud's metadata
        # server, which urllib fails to reach off the cloud (URLError is an OSError).
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        named = not local and _host_port(address) is None
        raise ReplicatorError(
            f"the TPU {address or 'local'!r} could not be initialised ({first}): check that the "
            "TPU exists and is free"
            + (" (a TPU name is looked up through the cloud's metadata server; off the cloud, give "
               "tpu='grpc://HOST:PORT')" if named else "")
            + ", or use kind='cpu' or 'gpu'."
        ) from None
    replicator = Replicator(strategy, "tpu")
    if num is not None and num != replicator.num_replicas:
        raise ValueError(
            f"num_replicas={num} but the TPU has {replicator.num_replicas} cores; leave "
            "num_replicas unset to use them all."
        )
    return replicator


def _make_auto(num: Optional[int], tpu: Optional[str]) -> Replicator:
    import tensorflow as tf

    if tpu not in (None, "", "local") or tf.config.list_physical_devices("TPU"):
        return _make_tpu(tpu, num)
    if tf.config.list_physical_devices("GPU"):
        return _make_gpu(num, None)
    return _make_cpu(num or 1)


def _make_multiworker(cluster, num, devices_per_worker, timeout_seconds) -> Replicator:
    import tensorflow as tf

    spec = parse_cluster_spec(cluster)
    num_workers = len(spec["cluster"]["worker"])
    gpus = tf.config.list_physical_devices("GPU")
    if devices_per_worker is not None:
        _positive_int(devices_per_worker, "devices_per_worker")
    if gpus:
        per_worker = devices_per_worker or len(gpus)
        if per_worker > len(gpus):
            raise ReplicatorError(f"devices_per_worker={per_worker} but this worker has {len(gpus)} GPU(s).")
        tf.config.set_visible_devices(gpus[:per_worker], "GPU")
    else:
        # MultiWorkerMirroredStrategy runs one replica on the CPU of each worker.
        per_worker = devices_per_worker or 1
        if per_worker != 1:
            raise ValueError(
                f"devices_per_worker={per_worker}, but without GPUs multiworker runs one replica "
                "per worker: use devices_per_worker=1, or kind='cpu' for several replicas in one process."
            )
    if num is not None and num != num_workers * per_worker:
        raise ValueError(
            f"num_replicas={num} but the cluster has {num_workers} worker(s) x {per_worker} "
            f"device(s) = {num_workers * per_worker} replicas; leave num_replicas unset."
        )
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec["cluster"]),
        task_type=spec["task"]["type"],
        task_id=spec["task"]["index"],
        num_accelerators={"GPU": per_worker} if gpus else None,
        rpc_layer="grpc",
    )
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=timeout_seconds,
    )
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver, communication_options=options)
    except (ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise ReplicatorError(
            f"multiworker replication could not start ({first}): create the replicator at program "
            "start, before any other TensorFlow op, and check the cluster addresses."
        ) from None
    return Replicator(strategy, "multiworker", num_workers=num_workers, worker_index=spec["task"]["index"])
