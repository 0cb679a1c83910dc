"""The device mesh `('data', 'fsdp', 'expert', 'context', 'tensor')` and helpers to put a
batch on it.

`expert` (size 1 unless a mixture-of-experts run sets it) shards the experts of MoE
layers; for everything else it is one more batch axis, so the batch is sharded over
`BATCH_AXES` = ('data', 'fsdp', 'expert') (docs/moe.md).

`context` splits one sequence's tokens over devices in the training forward and backward
(context parallelism, `models.partitioning.shard_sequence` / `shard_heads`,
docs/sharding.md); the devices of one context group hold the same rows and each computes
its share of their positions. It sits just before tensor: its all-to-alls run every
layer, so its devices are placed close together.

Axis types: every mesh axis is `AxisType.Auto`. Since JAX 0.7, `jax.make_mesh` defaults to
`Explicit` axes, under which each op's output sharding must follow from its inputs without
ambiguity: an FSDP matmul whose contracting dimension is sharded differently on its two
operands raises `ShardingTypeError` instead of all-gathering the weight. The decoder is
written for the classic compiler-propagated (GSPMD) model: parameters and batch carry
shardings, XLA inserts the collectives. So the axis types are chosen here, on purpose.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")


def mesh_shape(
    sizes: Mapping[str, int], num_devices: int, key_prefix: str = "mesh"
) -> tuple[int, ...]:
    """Resolves `{'data': 1, 'fsdp': -1, 'tensor': 1}` (-1 = the rest; a missing axis is
    1) to a full shape in MESH_AXES order."""
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"{key_prefix}: unknown mesh axis {sorted(unknown)}; axes: {MESH_AXES}")
    shape = [int(sizes.get(a, 1)) for a in MESH_AXES]
    free = [a for a, s in zip(MESH_AXES, shape, strict=True) if s == -1]
    for a, s in zip(MESH_AXES, shape, strict=True):
        if s == 0 or s < -1:
            raise ValueError(f"{key_prefix}.{a}={s}: a mesh axis size is positive or -1")
    if len(free) > 1:
        raise ValueError(f"{key_prefix}: only one axis may be -1, got {free}")
    fixed = int(np.prod([s for s in shape if s != -1]))
    if free:
        if num_devices % fixed:
            raise ValueError(
                f"{key_prefix}.{free[0]}=-1: {num_devices} devices are not divisible by the "
                f"other axes' product {fixed}"
            )
        shape[MESH_AXES.index(free[0])] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(
            f"{key_prefix}: {' x '.join(MESH_AXES)} = {fixed} but there are {num_devices} devices"
        )
    return tuple(shape)


def make_mesh(
    sizes: Mapping[str, int] | None = None, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """Mesh over `devices` (default: all) with the given axis sizes (default: all fsdp)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(sizes or {"fsdp": -1}, len(devices))
    types = (AxisType.Auto,) * len(MESH_AXES)
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices > 1:  # TPU multi-slice: jax.make_mesh refuses it
        return Mesh(_hybrid_devices(shape, devices, slices), MESH_AXES, axis_types=types)
    return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)


def _hybrid_devices(shape: tuple[int, ...], devices, slices: int) -> np.ndarray:
    """The devices of several TPU slices laid out for `shape`: the slices (joined by the
    data-center network) split the outermost batch axis they divide, `data` else `fsdp`,
    so that only the batch's gradient reduction crosses between slices."""
    from jax.experimental import mesh_utils

    axis = next((i for i in (0, 1) if shape[i] % slices == 0), None)
    if axis is None:
        raise ValueError(
            f"mesh: {slices} TPU slices must divide mesh.data ({shape[0]}) or mesh.fsdp "
            f"({shape[1]}): the slices split the batch"
        )
    dcn = [1] * len(shape)
    dcn[axis] = slices
    ici = list(shape)
    ici[axis] //= slices
    return mesh_utils.create_hybrid_device_mesh(
        ici, dcn, devices=devices, allow_split_physical_axes=True
    )


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Leading (batch) dimension over data+fsdp, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def to_mesh(tree, mesh: Mesh):
    """The arrays of `tree` on another mesh with the same axis names, device to device
    (`jax.device_put`: no host copy), each keeping its PartitionSpec; a dimension that an
    axis of the new mesh would not divide keeps only the leading axes that do (replicated
    when none does)."""

    def fit(size: int, axes) -> object:
        names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
        kept, product = [], 1
        for name in names:
            if size % (product * mesh.shape[name]):
                break
            kept.append(name)
            product *= mesh.shape[name]
        return tuple(kept) if len(kept) > 1 else (kept[0] if kept else None)

    def target(x):
        spec = tuple(getattr(x.sharding, "spec", None) or ())
        spec += (None,) * (x.ndim - len(spec))
        return NamedSharding(mesh, PartitionSpec(*map(fit, x.shape, spec)))

    return jax.device_put(tree, jax.tree.map(target, tree))


def put(tree, sharding):
    """Host arrays -> arrays of `sharding` (one sharding, or a tree of them), each process
    placing only its own devices' shards of the value every process holds the same: what
    `jax.device_put` does, without its check that the value is the same everywhere (with
    several processes a gather of the whole array from each, an array at a time)."""

    def one(x, s):
        if s is None or s.is_fully_addressable:
            return jax.device_put(x, s)
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda index: x[index])

    if not isinstance(sharding, jax.sharding.Sharding | None):
        return jax.tree.map(one, tree, sharding)
    return jax.tree.map(lambda x: one(x, sharding), tree)


def batch_size_multiple(mesh: Mesh | None) -> int:
    """The global batch must be a multiple of this."""
    return 1 if mesh is None else int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def shard_batch(tree, mesh: Mesh | None):
    """Puts host arrays (global batch, same on every process) on the mesh, batch-sharded."""
    if mesh is None:
        return jax.device_put(tree)
    multiple = batch_size_multiple(mesh)

    def put(x):
        x = np.asarray(x)
        if x.shape[0] % multiple:
            raise ValueError(
                f"batch size {x.shape[0]} is not divisible by data x fsdp x expert = {multiple}"
            )
        return jax.device_put(x, batch_sharding(mesh, x.ndim))

    return jax.tree.map(put, tree)


def shard_local_batch(tree, mesh: Mesh):
    """Builds global arrays from each process's own rows (multi-host input pipelines).

    This is an explicit transfer point: with several processes JAX builds the array
    through a per-shard callback, which `jax.transfer_guard("disallow")` would otherwise
    take for an implicit transfer.
    """

    def put(x):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(batch_sharding(mesh, x.ndim), x)

    with jax.transfer_guard("allow"):
        return jax.tree.map(put, tree)


def local_rows(tree, mesh: Mesh | None):
    """Host numpy copies of this process's rows of batch-sharded global arrays.

    With one process these are the whole arrays. With several, each process gets back
    exactly the rows it contributed through `shard_local_batch` (the same layout).
    """
    if mesh is None or jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    def get(x):
        spec = PartitionSpec(BATCH_AXES, *([None] * (x.ndim - 1)))
        return np.asarray(multihost_utils.global_array_to_host_local_array(x, mesh, spec))

    return jax.tree.map(get, tree)


def to_host(x) -> np.ndarray:
    """The whole value of `x` as a numpy array on this host: an array spanning processes is
    gathered from all of them (a collective: every process calls it, in the same order),
    anything else fetched."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def share(request):
    """Process 0's request (kind, fields, {name: array}) -> the same request on every
    process (itself with one process; the others pass None). Through JAX's
    `multihost_utils.broadcast_one_to_all`: the header's JSON, then each array's bytes as
    uint8 (a broadcast is a sum with zeros: bytes arrive bit for bit, a float's -0.0 too).
    A collective: every process calls it, in the same order. The header is padded to a
    power of two so that the broadcast compiles for few sizes."""
    if jax.process_count() == 1:
        return request
    from jax.experimental import multihost_utils

    source, header, table = jax.process_index() == 0, b"", []
    if source:
        kind, fields, arrays = request
        arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
        table = [[k, list(a.shape), a.dtype.name] for k, a in arrays.items()]
        header = json.dumps({"kind": kind, "fields": fields, "arrays": table}).encode()
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(header))))
    padded = np.zeros(max(256, 1 << (size - 1).bit_length()), np.uint8)
    padded[: len(header)] = np.frombuffer(header, np.uint8)
    head = json.loads(multihost_utils.broadcast_one_to_all(padded)[:size].tobytes())
    table = head["arrays"]
    if source:
        data = [arrays[k].reshape(-1).view(np.uint8) for k, _, _ in table]
    else:  # bfloat16 and the other ml_dtypes names resolve once jax has imported them
        data = [np.zeros(math.prod(s) * np.dtype(d).itemsize, np.uint8) for _, s, d in table]
    data = multihost_utils.broadcast_one_to_all(data) if data else []
    arrays = {
        k: np.asarray(b).view(np.dtype(dtype)).reshape(shape)
        for (k, shape, dtype), b in zip(table, data, strict=True)
    }
    return head["kind"], head["fields"], arrays


def host_max(value: int) -> int:
    """The maximum of an int over all processes (the value itself with one process)."""
    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.int32(value))))


def host_mean(values: dict[str, float]) -> dict[str, float]:
    """Per-process host metrics averaged over processes (`*_max` keys: the maximum)."""
    if jax.process_count() == 1 or not values:
        return values
    from jax.experimental import multihost_utils

    keys = sorted(values)
    table = np.asarray(
        multihost_utils.process_allgather(np.array([values[k] for k in keys], np.float64))
    )
    return {
        k: float(table[:, i].max() if k.endswith("_max") else table[:, i].mean())
        for i, k in enumerate(keys)
    }
