"""Sequence packing: the rows of a micro-batch laid end to end in fewer sequences.

A rollout row is a left-padded prompt [P] and a right-padded completion [T]; padded, a
micro-batch of n rows runs n sequences of W = P + T tokens, padding included. Packed, each
row's span (its first real prompt token to its last attended completion token) is placed
in one of S < n sequences of the same width W by greedy first-fit over the rows in
decreasing length (first-fit decreasing), each row a segment of its own:

    plan = plan_packing(prompt_mask, mask, num_seqs=S)       # on device, static shapes
    ids, attend, positions, segments = pack(plan, concat_ids, concat_mask)   # [S, W] each
    hidden = models.forward(cfg, params, ids, attend, positions, segments)   # [S, W, D]
    rows = unpack_completion(plan, hidden, P, T)             # [n, T, D], the padded layout

Segment ids (row index + 1; 0 = packed padding) keep a row's tokens from attending to
another row's, and the positions are the row's own (real tokens before it in its row), so
every packed token computes what it computes in its padded row. The hidden states are
gathered back to the [n, T] row layout before the log-probs, so advantages, the loss and
its per-row aggregation read exactly the arrays of the padded path.

Static shapes: S and W depend only on the micro-batch's shape and the packing capacity
(`packed_seqs`), never on the lengths, so one program serves every step. A micro-batch
whose rows first-fit does not place in S sequences is reported by `plan.fits`; the caller
runs the padded path for it (`rl.batch.packed_sequence_logprobs`, a `lax.cond`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class PackPlan:
    """Where each of n rows goes: sequence `seq` [n], column `offset` [n] of its span's
    first token; `start` [n], `end` [n] the span [start, end) in the row's own [P + T]
    layout; `fits`: every row was placed in the `num_seqs` sequences."""

    seq: jax.Array
    offset: jax.Array
    start: jax.Array
    end: jax.Array
    fits: jax.Array
    num_seqs: int = struct.field(pytree_node=False, default=1)


def packed_seqs(rows: int, capacity: float) -> int:
    """The packed sequences of a micro-batch of `rows` rows: ceil(rows * capacity), the
    fraction of the padded token slots the packed micro-batch has; >= rows: no packing."""
    if not 0.0 < capacity <= 1.0:
        raise ValueError(f"packing capacity={capacity}: must be in (0, 1]")
    return max(1, math.ceil(rows * capacity))


def row_spans(prompt_mask, mask) -> tuple[jax.Array, jax.Array]:
    """(start, end) [n] of each row's span in the concatenated [n, P + T] layout: from its
    first real prompt token (at the latest the prompt's last column, whose hidden state
    predicts the first completion token) to one past its last attended token."""
    m = jnp.concatenate([prompt_mask, mask], axis=1).astype(bool)
    width, p = m.shape[1], prompt_mask.shape[1]
    first = jnp.argmax(m, axis=1)
    last = width - 1 - jnp.argmax(m[:, ::-1], axis=1)
    real = jnp.any(m, axis=1)
    start = jnp.minimum(jnp.where(real, first, p - 1), p - 1)
    end = jnp.maximum(jnp.where(real, last + 1, p), start + 1)
    return start.astype(jnp.int32), end.astype(jnp.int32)


def plan_packing(prompt_mask, mask, num_seqs: int) -> PackPlan:
    """First-fit decreasing of the rows' spans into `num_seqs` sequences of width P + T.

    prompt_mask [n, P], mask [n, T] -> PackPlan. A `lax.scan` over the n rows (longest
    first) puts each in the first sequence with room left; a row that fits nowhere is
    marked (plan.fits False), its place left undefined."""
    start, end = row_spans(prompt_mask, mask)
    width = prompt_mask.shape[1] + mask.shape[1]
    lengths = end - start
    order = jnp.argsort(-lengths, stable=True)

    def place(fill, i):
        room = fill + lengths[i] <= width
        s = jnp.argmax(room).astype(jnp.int32)
        ok = room[s]
        return jnp.where(ok, fill.at[s].add(lengths[i]), fill), (s, fill[s], ok)

    _, (seq, offset, ok) = jax.lax.scan(place, jnp.zeros(num_seqs, jnp.int32), order)
    n = lengths.shape[0]
    unsort = lambda x: jnp.zeros(n, jnp.int32).at[order].set(x)  # noqa: E731
    return PackPlan(
        seq=unsort(seq),
        offset=unsort(offset),
        start=start,
        end=end,
        fits=jnp.all(ok),
        num_seqs=num_seqs,
    )


def _destinations(plan: PackPlan, width: int) -> jax.Array:
    """[n, W] flat index into the packed [S * W] of each row column; S * W (dropped by the
    scatter) outside the row's span."""
    col = jnp.arange(width, dtype=jnp.int32)[None, :]
    inside = (col >= plan.start[:, None]) & (col < plan.end[:, None])
    dest = plan.seq[:, None] * width + plan.offset[:, None] + col - plan.start[:, None]
    return jnp.where(inside, dest, plan.num_seqs * width)


def pack(plan: PackPlan, ids, attend):
    """Row layout -> packed layout. ids, attend [n, W] (the concatenated prompt and
    completion, and its attention mask) -> (ids, attend, positions, segment ids), each
    [S, W]. A packed token keeps its row's position id (real tokens before it in its row,
    as `models.forward` numbers a padded row); packed padding is segment 0, not attended."""
    n, width = ids.shape
    s = plan.num_seqs
    attend = attend.astype(bool)
    positions = jnp.maximum(jnp.cumsum(attend, axis=1, dtype=jnp.int32) - 1, 0)
    segments = jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.int32)[:, None], (n, width))
    dest = _destinations(plan, width).reshape(-1)

    def scatter(x):
        flat = jnp.zeros((s * width,), x.dtype).at[dest].set(x.reshape(-1), mode="drop")
        return flat.reshape(s, width)

    return scatter(ids), scatter(attend), scatter(positions), scatter(segments)


def completion_index(plan: PackPlan, prompt_len: int, completion_len: int) -> jax.Array:
    """[n, T] flat index into the packed [S * W] of the position whose state predicts
    row i's completion token t (its column P - 1 + t, as `rl.batch.completion_hidden`),
    the token itself being the next packed one. Steps past the row's span point at a
    clamped neighbour: their log-probs are masked out."""
    width = prompt_len + completion_len
    col = prompt_len - 1 + jnp.arange(completion_len, dtype=jnp.int32)[None, :]
    src = plan.seq[:, None] * width + plan.offset[:, None] + col - plan.start[:, None]
    return jnp.clip(src, 0, plan.num_seqs * width - 1)


def unpack_completion(plan: PackPlan, packed, prompt_len: int, completion_len: int):
    """Packed per-position values [S, W, ...] (hidden states, log-probs) -> the row
    layout's completion steps [n, T, ...] (`completion_index`)."""
    s, width = packed.shape[:2]
    src = completion_index(plan, prompt_len, completion_len)
    return jnp.take(packed.reshape(s * width, *packed.shape[2:]), src, axis=0)


PACKING_MODES = ("auto", "on", "off")
DEFAULT_CAPACITY = 0.625


def resolve_packing(mode, capacity: float, batch_shards: int, moe: bool = False) -> float:
    """The packed capacity a program uses (0.0: padded rows). mode: 'on', 'off' or 'auto'
    (also True / False); 'auto' packs when the rows are on one device (batch_shards ==
    1): packing gathers tokens across the micro-batch's rows, which on a batch sharded
    over devices would move them between devices. moe: a mixture-of-experts model runs
    padded whatever the mode (its recorded and own routes are laid out by row; the
    config check refuses 'on' for one)."""
    if moe:
        resolve_packing(mode, capacity, batch_shards)  # a bad mode or capacity still fails
        return 0.0
    if mode is True or mode == "on":
        packed_seqs(1, capacity)  # checks the capacity
        return float(capacity)
    if mode is False or mode == "off":
        return 0.0
    if mode == "auto":
        return resolve_packing("on", capacity, 1) if batch_shards == 1 else 0.0
    raise ValueError(f"packing={mode!r}: one of {PACKING_MODES}")
