"""The gated delta rule's chunked form as one Pallas TPU kernel (`model.linear_impl`).

`gated_deltanet.chunked_delta_rule` in XLA materialises, per chunk of C tokens, the
[C, C] decay, solve and score matrices of every chunk of every head in HBM before a scan
carries the state over the chunks: B H T C floats each (at T = 16k, 32 value heads and
C = 64, 134 MB per row and layer). The kernel runs one (row, value head) per grid
column and its chunks in order along the grid's second axis, the [Dk, Dv] state in VMEM
scratch; a chunk's matrices live in VMEM only, and q, k, v and the output are read and
written in the model's [B, T, H * D] layout (TPU blocks: C a multiple of 8 and the head
sizes multiples of 128, as Qwen3.5's 64 and 128). Per chunk, with G the cumulative sum of
g (given, from XLA) and D_ij = exp(G_i - G_j) for j <= i (0 above the diagonal):

    N = strictly_lower(beta k k^T * D)
    (I + N)^-1 = (I - N)(I + N^2)(I + N^4) ... (N is nilpotent: N^C = 0)
    U = (I + N)^-1 (beta v),  W = (I + N)^-1 (beta k exp(G))
    v' = U - W S,  o = (q exp(G)) S + ((q k^T) * D) v'
    S <- exp(G_C) S + (k exp(G_C - G))^T v'

the same arithmetic as the XLA form but for the inverse: the triangular solve, which
Mosaic does not have, is ceil(log2 C) products of [C, C] matrices on the MXU. The
backward is the XLA form's (`with_backward`, a `jax.custom_vjp`: the forward recomputed
in XLA and differentiated), so the kernel serves the sampler's prefill and the
reference / old log-prob forwards, and the update's forward.

Off TPU the kernel runs in Pallas' TPU interpret mode (the tests, on CPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxrl_llm.parallel import target

_HI = jax.lax.Precision.HIGHEST


def _dot(a, b, transpose_a=False, transpose_b=False):
    dims = (((0 if transpose_a else 1,), (1 if transpose_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=_HI, preferred_element_type=jnp.float32)


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref, o_ref, s_ref, state):
    """One chunk of one (row, head): q, k [C, Dk], v [C, Dv], G and beta as rows [1, C];
    `state` [Dk, Dv] carried in VMEM across the chunks. A per-token factor scales the
    rows of a [C, D] matrix as diag(x) @ M on the MXU (one product per entry), which
    keeps G and beta rows: as [C, 1] columns each would take a lane-padded [C, 128]
    block from HBM."""
    c = pl.program_id(1)

    @pl.when(c == 0)
    def _():
        state[...] = s0_ref[...]

    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    G, beta = g_ref[...], b_ref[...]  # [1, C]
    C = q.shape[0]
    i = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    eye = (i == j).astype(jnp.float32)

    def diag(x):  # [1, C] -> diag(x) [C, C]
        return eye * x

    G_i = _dot(diag(G), jnp.ones((C, C), jnp.float32))  # [i, j] -> G_i
    decay = jnp.where(j <= i, jnp.exp(jnp.where(j <= i, G_i - G, 0.0)), 0.0)
    kb = _dot(diag(beta), k)
    n = jnp.where(j < i, _dot(kb, k, transpose_b=True) * decay, 0.0)
    inv = eye - n
    power = _dot(n, n)
    for _ in range(max(0, math.ceil(math.log2(C)) - 1)):
        inv = _dot(inv, eye + power)
        power = _dot(power, power)
    u = _dot(inv, _dot(diag(beta), v))
    w = _dot(inv, _dot(diag(jnp.exp(G)), kb))
    S = state[...]
    v_new = u - _dot(w, S)
    scores = _dot(q, k, transpose_b=True) * decay
    o_ref[...] = _dot(_dot(diag(jnp.exp(G)), q), S) + _dot(scores, v_new)
    last = G[:, C - 1 :]  # [1, 1]: G at the chunk's last token
    kd = _dot(diag(jnp.exp(last - G)), k)
    state[...] = S * jnp.exp(last) + _dot(kd, v_new, transpose_a=True)

    @pl.when(c == pl.num_programs(1) - 1)
    def _():
        s_ref[...] = state[...]


def _launch(q, k, v, G, beta, state, H: int, C: int):
    """q, k [B, T, H * Dk], v [B, T, H * Dv] (T a multiple of C: the model's own layout,
    each (row, head)'s chunk read in place), G, beta [B * H, n, C] (G the per-chunk
    cumulative sum of g), state [B * H, Dk, Dv], all float32 -> (o [B, T, H * Dv], the
    final state)."""
    B, T, _ = k.shape
    R, n, _ = G.shape
    Dk, Dv = state.shape[1:]

    def tokens(width):  # (row, head) r's chunk c: rows c*C.., columns of head r % H
        # lax.div / rem: r >= 0, and floor division's sign fix-up needs the chip's info
        return pl.BlockSpec((None, C, width), lambda r, c: (lax.div(r, H), c, lax.rem(r, H)))

    def per_chunk(*shape):
        return pl.BlockSpec((None, None, *shape), lambda r, c: (r, c, 0, 0))

    whole = pl.BlockSpec((None, Dk, Dv), lambda r, c: (r, 0, 0))
    return pl.pallas_call(
        _kernel,
        grid=(R, n),
        in_specs=[
            tokens(Dk),
            tokens(Dk),
            tokens(Dv),
            per_chunk(1, C),
            per_chunk(1, C),
            whole,
        ],
        out_specs=[tokens(Dv), whole],
        out_shape=[
            jax.ShapeDtypeStruct((B, T, H * Dv), jnp.float32),
            jax.ShapeDtypeStruct((R, Dk, Dv), jnp.float32),
        ],
        scratch_shapes=[pltpu.VMEM((Dk, Dv), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=False if target.backend() == "tpu" else pltpu.InterpretParams(),
    )(q, k, v, G[..., None, :], beta[..., None, :], state)


def forward(q, k, v, g, beta, state, chunk: int):
    """`gated_deltanet.chunked_delta_rule`'s contract (q, k [B,T,H,Dk], v [B,T,H,Dv],
    g, beta [B,T,H], state [B,H,Dk,Dv], float32 -> (o [B,T,H,Dv], final state)), its
    forward in the kernel. q, k, v and o stay in their [B, T, H * D] layout (a reshape;
    padded to whole chunks only when T is not a multiple of the chunk); only the gates,
    one number per token and head, are laid out per (row, head)."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    C = min(chunk, T)
    pad = -T % C
    n = (T + pad) // C

    def flat(x):  # [B,T,H,D] -> [B, n*C, H*D]
        x = x.reshape(B, T, -1)
        return jnp.pad(x, [(0, 0), (0, pad), (0, 0)]) if pad else x

    def per_head(x):  # [B,T,H] -> [B*H, n, C]
        x = jnp.pad(x, [(0, 0), (0, pad), (0, 0)]) if pad else x
        return jnp.moveaxis(x, 2, 1).reshape(B * H, n, C)

    G = jnp.cumsum(per_head(g), axis=-1)
    o, state = _launch(
        flat(q), flat(k), flat(v), G, per_head(beta), state.reshape(B * H, Dk, Dv), H, C
    )
    return o[:, :T].reshape(B, T, H, Dv), state.reshape(B, H, Dk, Dv)


def with_backward(reference):
    """`forward` (no autodiff rule of its own) with `reference`'s backward (a function
    of the same contract, recomputed and differentiated in `jax.custom_vjp`'s backward):
    `gated_deltanet` passes its XLA form."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
    def rule(q, k, v, g, beta, state, chunk: int):
        return forward(q, k, v, g, beta, state, chunk)

    def fwd(q, k, v, g, beta, state, chunk):
        return forward(q, k, v, g, beta, state, chunk), (q, k, v, g, beta, state)

    def bwd(chunk, saved, grads):
        _, vjp = jax.vjp(lambda *a: reference(*a, chunk), *saved)
        return vjp(grads)

    rule.defvjp(fwd, bwd)
    return rule
