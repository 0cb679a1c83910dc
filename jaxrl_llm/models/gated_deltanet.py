"""Gated DeltaNet, the linear-attention layer of Qwen3.5 (Yang, Kautz, Hatamizadeh 2024,
"Gated Delta Networks: Improving Mamba2 with Delta Rule"; transformers'
`Qwen3_5GatedDeltaNet`).

For a normed input x_t [D] the layer projects qkv, z, a, b, runs qkv through a causal
depthwise convolution of K taps and SiLU, and splits it into q, k (Hk heads of Dk) and v
(Hv heads of Dv; each key head serves Hv / Hk consecutive value heads). Per value head,
with a state S [Dk, Dv]:

    q_t, k_t = l2norm(q_t) / sqrt(Dk), l2norm(k_t)          (float32)
    g_t = -exp(A_log) softplus(a_t + dt_bias)   (<= 0),     beta_t = sigmoid(b_t)
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - (exp(g_t) S_{t-1})^T k_t))^T
    o_t = S_t^T q_t
    y_t = out(RMSNorm(o_t) * w_norm * silu(z_t))

Two computations of the same recurrence:
- `chunked_delta_rule` (training, reference, prefill): chunks of C tokens; within a chunk
  the C delta-rule updates are one unit-lower-triangular solve (the WY / UT transform),
  between chunks a `lax.scan` carries S. Memory O(T C + (T / C) Dk Dv) per head, linear
  in T; autodiff's backward stores the same per-chunk states, so it needs no custom VJP.
- `recurrent_delta_rule` (decode): the token-by-token update above.
Both run in float32; their difference is rounding only (measured in docs/models.md).
`model.linear_impl` runs the chunked form as one Pallas TPU kernel instead
(`deltanet_kernel`, `kernel_delta_rule`; `use_kernel`: on one TPU chip by default).

Padding and holes: a masked token (attention_mask 0) does not touch the state. Its
g and beta are set to 0 (the update is then the identity), and the convolution runs over
each row's real tokens only (they are moved to the front of the row, convolved after the
carried K - 1 inputs, and moved back), so a row's outputs do not depend on where its
padding sits. For left padding this is transformers' computation (it zeroes padded
inputs, which leaves a zero state and a zero convolution window).

State per row and layer (`LinearState`): the last K - 1 real convolution inputs
[K - 1, C] and S [Hv, Dk, Dv] float32.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxrl_llm.models import deltanet_kernel
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layer_math import dense
from jaxrl_llm.parallel import target

_HI = jax.lax.Precision.HIGHEST
# Block parameter -> (shape after `layers`, logical axes); stacked over the DeltaNet layers.
# HF names: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, dt_bias, A_log, norm,
# out_proj.
LINEAR_WEIGHTS = (
    "lin_qkv",
    "lin_z",
    "lin_b",
    "lin_a",
    "lin_conv",
    "lin_dt_bias",
    "lin_a_log",
    "lin_norm",
    "lin_out",
)


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """{name: (shape, logical axes)} of one DeltaNet layer's parameters."""
    D, C, K = cfg.hidden_size, cfg.linear_conv_dim, cfg.linear_conv_kernel
    Hv, Dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    return {
        "lin_qkv": ((D, C), ("embed", "mlp")),
        "lin_z": ((D, Hv, Dv), ("embed", "q_heads", "head_dim")),
        "lin_b": ((D, Hv), ("embed", None)),
        "lin_a": ((D, Hv), ("embed", None)),
        "lin_conv": ((K, C), (None, "mlp")),
        "lin_dt_bias": ((Hv,), (None,)),
        "lin_a_log": ((Hv,), (None,)),
        "lin_norm": ((Dv,), ("head_dim",)),
        "lin_out": ((Hv, Dv, D), ("q_heads", "head_dim", "embed")),
    }


@flax.struct.dataclass
class LinearState:
    """The recurrent state of the DeltaNet layers: conv [..., B, K - 1, C] (the last real
    convolution inputs, model dtype) and ssm [..., B, Hv, Dk, Dv] (S, float32)."""

    conv: jax.Array
    ssm: jax.Array


def zero_state(cfg: ModelConfig, batch: int, dtype, layers: tuple[int, ...] = ()) -> LinearState:
    """A zero state for `batch` rows, with leading `layers` dims."""
    K, C = cfg.linear_conv_kernel, cfg.linear_conv_dim
    Hv, Dk, Dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return LinearState(
        conv=jnp.zeros((*layers, batch, K - 1, C), dtype),
        ssm=jnp.zeros((*layers, batch, Hv, Dk, Dv), jnp.promote_types(dtype, jnp.float32)),
    )


def state_bytes(cfg: ModelConfig, dtype) -> int:
    """Bytes of one row's state over every DeltaNet layer (`zero_state`'s arrays in a
    model of `dtype`): what a sampler holds per sequence besides its full-attention
    layers' keys/values, however long the sequence is."""
    one = jax.eval_shape(lambda: zero_state(cfg, 1, dtype, (sum(cfg.linear_layers),)))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(one))


def causal_conv(x, w, mask, state):
    """Depthwise causal convolution and SiLU over each row's real tokens.

    x [B,T,C], w [K,C], mask [B,T] bool, state [B,K-1,C] (the K - 1 real inputs before
    x) -> (y [B,T,C], the new state [B,K-1,C]). y_t = silu(sum_j w_j u_{t-K+1+j}) where u
    is the row's real inputs (state first); masked tokens' outputs are meaningless."""
    T, K = x.shape[1], w.shape[0]
    order = jnp.argsort(~mask, axis=1, stable=True)  # real tokens first, in order
    full = jnp.concatenate(
        [state.astype(x.dtype), jnp.take_along_axis(x, order[..., None], axis=1)], axis=1
    )
    y = sum(full[:, j : j + T] * w[j].astype(x.dtype) for j in range(K))
    y = jnp.take_along_axis(jax.nn.silu(y), jnp.argsort(order, axis=1)[..., None], axis=1)
    last = mask.sum(1, dtype=jnp.int32)[:, None] + jnp.arange(K - 1, dtype=jnp.int32)
    return y, jnp.take_along_axis(full, last[..., None], axis=1)


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def chunked_delta_rule(q, k, v, g, beta, state, chunk: int):
    """The gated delta rule over T tokens, C = `chunk` at a time.

    q, k [B,T,H,Dk] (normalised, q scaled), v [B,T,H,Dv], g, beta [B,T,H], state
    [B,H,Dk,Dv], all float32 -> (o [B,T,H,Dv], final state). Within a chunk, with
    G the cumulative sum of g and L_ij = beta_i k_i.k_j exp(G_i - G_j) (j < i):
    U = (I + L)^-1 (beta v), W = (I + L)^-1 (beta k exp(G)); per chunk from S:
    v' = U - W S, o = (q exp(G)) S + tril(q k^T exp(G_i - G_j)) v',
    S <- exp(G_C) S + (k exp(G_C - G))^T v'. transformers' torch_chunk_gated_delta_rule."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    C = min(chunk, T)
    pad = -T % C
    n = (T + pad) // C

    def split(x):  # [B,T,H,...] -> [B,H,n,C,...], zero-padded to n * C tokens
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x, 2, 1)
        return x.reshape(B, H, n, C, *x.shape[3:])

    q, k, v, g, beta = map(split, (q, k, v, g, beta))
    G = jnp.cumsum(g, axis=-1)  # [B,H,n,C]
    lower = jnp.tril(jnp.ones((C, C), bool))
    diff = jnp.where(lower, G[..., :, None] - G[..., None, :], -jnp.inf)
    decay = jnp.exp(diff)  # [B,H,n,C,C], 0 above the diagonal
    kb = k * beta[..., None]
    L = jnp.einsum("...id,...jd->...ij", kb, k, precision=_HI) * decay
    L = jnp.where(jnp.tril(lower, -1), L, 0.0) + jnp.eye(C, dtype=L.dtype)
    rhs = jnp.concatenate([v * beta[..., None], kb * jnp.exp(G)[..., None]], axis=-1)
    UW = jax.lax.linalg.triangular_solve(L, rhs, left_side=True, lower=True, unit_diagonal=True)
    U, W = UW[..., :Dv], UW[..., Dv:]
    attn = jnp.einsum("...id,...jd->...ij", q, k, precision=_HI) * decay
    qd = q * jnp.exp(G)[..., None]
    kd = k * jnp.exp(G[..., -1:] - G)[..., None]
    chunk_decay = jnp.exp(G[..., -1])[..., None, None]  # [B,H,n,1,1]

    def step(S, xs):
        U, W, attn, qd, kd, cd = xs  # one chunk: [B,H,C,...]
        v_new = U - jnp.einsum("bhck,bhkv->bhcv", W, S, precision=_HI)
        o = jnp.einsum("bhck,bhkv->bhcv", qd, S, precision=_HI)
        o = o + jnp.einsum("bhij,bhjv->bhiv", attn, v_new, precision=_HI)
        S = S * cd + jnp.einsum("bhck,bhcv->bhkv", kd, v_new, precision=_HI)
        return S, o

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (U, W, attn, qd, kd, chunk_decay))
    state, o = jax.lax.scan(step, state, xs)  # o [n,B,H,C,Dv]
    o = jnp.moveaxis(o, 0, 2).reshape(B, H, n * C, Dv)[:, :, :T]
    return jnp.moveaxis(o, 1, 2), state


def recurrent_delta_rule(q, k, v, g, beta, state):
    """The gated delta rule token by token (decode); arguments as `chunked_delta_rule`.
    transformers' torch_recurrent_gated_delta_rule."""

    def step(S, xs):
        q, k, v, g, beta = xs  # [B,H,...]
        S = S * jnp.exp(g)[..., None, None]
        mem = jnp.einsum("bhkv,bhk->bhv", S, k, precision=_HI)
        S = S + k[..., :, None] * ((v - mem) * beta[..., None])[..., None, :]
        return S, jnp.einsum("bhkv,bhk->bhv", S, q, precision=_HI)

    state, o = jax.lax.scan(step, state, tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta)))
    return jnp.moveaxis(o, 0, 1), state


# the chunked form in the Pallas kernel, differentiated as the XLA form
kernel_delta_rule = deltanet_kernel.with_backward(chunked_delta_rule)


def use_kernel(cfg: ModelConfig) -> bool:
    """`model.linear_impl`: the Pallas kernel for "pallas", and for "auto" when the
    program is compiled for one TPU chip (the kernel is one custom call, which XLA's
    partitioner does not split over a mesh) and its blocks fit Mosaic's tiling (head
    sizes multiples of 128, the chunk a multiple of 8)."""
    if cfg.linear_impl == "auto":
        tiled = cfg.linear_key_head_dim % 128 == cfg.linear_value_head_dim % 128 == 0
        one_chip = target.backend() == "tpu" and target.device_count() == 1
        return one_chip and tiled and cfg.linear_chunk % 8 == 0
    return cfg.linear_impl == "pallas"


def gated_deltanet(cfg: ModelConfig, w: dict, x, mask, state: LinearState | None, step=False):
    """One DeltaNet layer: normed x [B,T,D], mask [B,T] (real tokens), w its weights
    (`LINEAR_WEIGHTS`), state a `LinearState` of [B, ...] (None: zeros) -> (y [B,T,D],
    the new state). step: run the recurrence token by token (decode) instead of chunked."""
    B, T, _ = x.shape
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    f32 = jnp.promote_types(x.dtype, jnp.float32)  # the recurrence's dtype (float64 stays)
    if state is None:
        state = zero_state(cfg, B, x.dtype)
    qkv, conv = causal_conv(dense(x, w["lin_qkv"]), w["lin_conv"], mask, state.conv)
    q, k, v = jnp.split(qkv.astype(f32), [Hk * Dk, 2 * Hk * Dk], axis=-1)
    rep = Hv // Hk  # key head h serves value heads h * rep .. h * rep + rep - 1
    q = jnp.repeat(_l2norm(q.reshape(B, T, Hk, Dk)), rep, axis=2) * Dk**-0.5
    k = jnp.repeat(_l2norm(k.reshape(B, T, Hk, Dk)), rep, axis=2)
    v = v.reshape(B, T, Hv, Dv)
    beta = jax.nn.sigmoid(dense(x, w["lin_b"])).astype(f32)
    a = dense(x, w["lin_a"]).astype(f32) + w["lin_dt_bias"].astype(f32)
    g = -jnp.exp(w["lin_a_log"].astype(f32)) * jax.nn.softplus(a)
    beta, g = jnp.where(mask[..., None], beta, 0.0), jnp.where(mask[..., None], g, 0.0)
    if step:
        o, ssm = recurrent_delta_rule(q, k, v, g, beta, state.ssm)
    else:
        chunked = kernel_delta_rule if use_kernel(cfg) else chunked_delta_rule
        o, ssm = chunked(q, k, v, g, beta, state.ssm, cfg.linear_chunk)
    o = o.astype(x.dtype).astype(f32)  # HF rounds to the model dtype first
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    z = dense(x, w["lin_z"]).astype(f32)
    o = (w["lin_norm"] * o.astype(x.dtype)).astype(f32) * jax.nn.silu(z)
    y = dense(o.astype(x.dtype), w["lin_out"], 2)
    return y, LinearState(conv=conv, ssm=ssm)
