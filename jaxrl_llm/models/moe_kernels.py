"""The experts of an MoE layer through the TPU grouped-matmul kernel (`model.moe_impl='gmm'`),
and which expert path `auto` means on each backend.

`gmm_experts` is `moe.grouped_experts` with each `ragged_dot` replaced by the Pallas
grouped matmul that ships with JAX (`jax.experimental.pallas.ops.tpu.megablox.gmm`, whose
custom VJP computes the input gradient with `gmm` on the transposed weights and the
weight gradient with `tgmm`). The kernel's constraints, met here:

- rows: it walks the lhs in tiles of `tm` rows and needs the row count to be a multiple of
  `tm`. The N*k (token, expert) pairs sorted by expert are padded with zero rows to the
  next multiple, and the padding is counted in the last expert's group, so every row
  belongs to a group: no output row is left unwritten, the padding rows compute
  silu(0) * 0 = 0 and give that expert's weights a zero gradient (their cotangent is
  zero, since they are never read back);
- tiles: (tm, tk, tn) = `GMM_TILING`, each clipped to the matrix's own dimension (a block
  equal to the whole dimension is always allowed; a larger one need not divide it, the
  kernel masks the remainder);
- dtypes: float32 or bfloat16 operands, int32 group sizes; the output is asked for in the
  activations' dtype (accumulation is float32 inside the kernel).

Partitioning: a Pallas call is not partitioned by XLA (it would gather every token and
every expert onto each device). When a mesh with more than one device is set around the
trace (`jax.set_mesh`), `gmm_experts` runs inside `jax.shard_map` instead: each device
takes its rows (split over the batch axes, where they divide the rows) and its share of
the experts (split over `expert`, where it divides them; the weights gathered over
`fsdp` / `tensor` for the layer, as FSDP gathers a dense layer's). With the experts split,
the tokens of the `expert` group are all-gathered, each device multiplies only the rows
routed to its own experts (the kernel's `group_offset`: the other rows come back zero), and
the partial outputs are summed back to each device's rows with a reduce-scatter. Without
a mesh set (the trainer's GSPMD programs), several devices make `auto` choose `ragged`,
which XLA partitions.

On a backend other than TPU the kernel runs in Pallas interpret mode (a slow emulation,
for tests: it checks the kernel's values and gradients on CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl_llm.parallel import target

GMM_TILING = (128, 128, 128)  # (rows, contracting, output) tile of the kernel (its default)


def resolve(name: str, backend: str, num_devices: int = 1, mesh_set: bool = False) -> str:
    """The expert path `auto` means: on TPU the grouped-matmul kernel (`gmm`) when it can
    run per device (one device, or a mesh set around the trace for `shard_map`), else
    `ragged`; on GPU `ragged` (XLA's grouped matmul); on CPU `blocked` (XLA:CPU computes
    `ragged_dot` over every group). Any other name is returned unchanged."""
    if name != "auto":
        return name
    if backend == "tpu":
        return "gmm" if num_devices == 1 or mesh_set else "ragged"
    return "ragged" if backend == "gpu" else "blocked"


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _gmm(lhs, rhs, sizes, offset, interpret: bool):
    """lhs [M, K] (M a multiple of the row tile) @ rhs [G, K, N] per group of rows."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    m, k = lhs.shape
    tiling = (min(GMM_TILING[0], m), min(GMM_TILING[1], k), min(GMM_TILING[2], rhs.shape[2]))
    return gmm(lhs, rhs.astype(lhs.dtype), sizes, lhs.dtype, tiling, offset, interpret=interpret)


def gmm_local(
    x,
    ids,
    weights,
    gate,
    up,
    down,
    num_experts: int,
    offset=None,
    interpret=False,
    glu=None,
    biases=None,
):
    """The experts `offset` .. `offset` + G - 1 (G = gate.shape[0]; offset None: all E) on
    the (token, expert) pairs routed to them: x [N, D], ids / weights [N, k] -> [N, D].
    glu: the gating (None: silu(g) * u); biases: (gate, up, down) of these G experts, or
    None; a row of another device's experts gets none (its output stays zero)."""

    n, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pair index, grouped by expert
    rows = _round_up(n * k, GMM_TILING[0])
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    sizes = sizes.at[num_experts - 1].add(rows - n * k)  # the padding rows: last group
    xs = jnp.pad(jnp.take(x, order // k, axis=0), ((0, rows - n * k), (0, 0)))
    off = None if offset is None else jnp.asarray(offset, jnp.int32)
    local = jnp.pad(flat[order], (0, rows - n * k), constant_values=num_experts - 1)
    local = local - (0 if off is None else off)
    mine = (local >= 0) & (local < gate.shape[0])

    def matmul(a, w, b=None):
        y = _gmm(a, w, sizes, off, interpret)
        if b is None:
            return y
        rows_b = jnp.take(b, jnp.clip(local, 0, gate.shape[0] - 1), axis=0).astype(y.dtype)
        return y + jnp.where(mine[:, None], rows_b, 0)

    glu = glu or (lambda g, u: jax.nn.silu(g) * u)
    bg, bu, bd = biases or (None, None, None)
    ys = matmul(glu(matmul(xs, gate, bg), matmul(xs, up, bu)), down, bd)[: n * k]
    ys = jnp.take(ys, jnp.argsort(order), axis=0).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", ys, weights.astype(ys.dtype))


def gmm_experts(
    x, ids, weights, gate, up, down, glu=None, biases=None, interpret: bool | None = None
) -> jax.Array:
    """`moe.grouped_experts` through the TPU grouped-matmul kernel: x [N, D], ids /
    weights [N, k], gate / up [E, D, F], down [E, F, D] -> [N, D]. Per device inside
    `jax.shard_map` when a mesh of several devices is set around the trace (module
    docstring). glu, biases: as `moe.grouped_experts`'. interpret None: interpret mode
    unless the backend is TPU."""
    from jaxrl_llm.models import partitioning

    if interpret is None:
        interpret = target.backend() != "tpu"
    num_experts = gate.shape[0]
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return gmm_local(x, ids, weights, gate, up, down, num_experts, None, interpret, glu, biases)
    rows = partitioning.logical_to_spec(("batch", None), x.shape, mesh)[0]
    rows = () if rows is None else (rows,) if isinstance(rows, str) else tuple(rows)
    ep = int(mesh.shape.get("expert", 1))
    split_experts = ep > 1 and num_experts % ep == 0 and "expert" in rows
    row_spec = P(rows or None, None)
    w_spec = P("expert" if split_experts else None, None, None)
    local_experts = num_experts // ep if split_experts else num_experts

    b_spec = P("expert" if split_experts else None, None)

    def local(x, ids, weights, gate, up, down, *biases):
        biases = biases or None
        if not split_experts:
            return gmm_local(
                x, ids, weights, gate, up, down, num_experts, None, interpret, glu, biases
            )
        gathered = [jax.lax.all_gather(a, "expert", tiled=True) for a in (x, ids, weights)]
        offset = jax.lax.axis_index("expert") * local_experts
        y = gmm_local(*gathered, gate, up, down, num_experts, offset, interpret, glu, biases)
        return jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)

    biases = tuple(biases or ())
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(row_spec, row_spec, row_spec, w_spec, w_spec, w_spec) + (b_spec,) * len(biases),
        out_specs=row_spec,
        check_vma=False,
    )(x, ids, weights, gate, up, down, *biases)
