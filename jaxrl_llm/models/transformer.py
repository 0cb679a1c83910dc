"""Decoder-only transformer (Llama 3 / Mistral / Qwen2 / Qwen3) in Flax NNX.

The modules only declare parameters (with logical axis names) and the math of one layer.
Everything outside uses the functional form: `params` is a plain nested dict of arrays
(`{'embed', 'layers': {...}, 'final_norm', 'lm_head'?}`), and `forward` / `extend`
merge it into the module inside the traced function, so the sampler, the reference model
and the update step all read the same arrays without copies.

Layer parameters are stacked on a leading `layers` axis and the layers are run by one
`jax.lax.scan`, so compile time does not grow with depth; `cfg.remat` selects the
activation checkpointing policy of the scanned layer. `cfg.scan_layers=False` unrolls that
scan in the teacher-forced forward: the backward then reads each layer's residuals where
they were computed instead of from [L, ...] stacks that the scan zero-fills and copies
into (the update step ran 5% faster on CPU). With a KV cache it also unrolls prefill and
decode over a cache of one array per layer (`init_cache`), each layer's parameters
optionally sliced once by the caller (`layer_params`): a scanned decode step copies its
layer's cache slice and weights out of the [L, ...] arrays on every token.

Three paths share the layer code:
- `forward`: a full sequence, with a padding mask (left or right), position ids and
  optional segment ids for packed sequences.
- `forward_after_prefix`: a sequence after a prefix whose per-layer keys/values an
  earlier call returned (a GRPO group's shared prompt); trains like `forward`.
- `extend`: T new tokens appended to a preallocated KV cache (`KVCache`). Prefill is
  `extend` of the prompt into an empty cache; decoding is `extend` of one token per row.

Position ids default to the number of real tokens before each token, so a left-padded
row gets the same positions as its unpadded self (as in HF `generate`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxrl_llm.models.config import ModelConfig

Params = dict


# ------------------------------------------------------------------------------ modules
def _normal(rngs: nnx.Rngs, shape, axes, std: float, dtype) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape)).astype(dtype), axes=axes)


def _const(value: float, shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.full(shape, value, dtype), axes=axes)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """HF LlamaRMSNorm: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale * y.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dense(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
    """Contracts the last `contract` axes of x with the first ones of w, as one 2-D matmul.

    x [..., K1..Kc], w [K1..Kc, N1..] -> [..., N1..]. The same math as the einsum, with
    the backward written out as the two matmuls it is (dx = g W^T, dW = x^T g over the
    flattened tokens). Left to autodiff of a batched einsum, XLA:CPU transposes the wide
    [tokens, F] cotangent of every MLP matmul in a strided loop before the weight-gradient
    matmul, which made the layer backward ~1.5x slower than its matmuls (see
    benchmarks/RESULTS.md, "GRPO step"); other backends are unaffected either way.
    """
    return _dense_2d(x, w, contract)[0]


def _dense_2d(x, w, contract):
    k = int(np.prod(w.shape[:contract]))
    x2, w2 = x.reshape(-1, k), w.reshape(k, -1)
    y = (x2 @ w2).reshape(*x.shape[: x.ndim - contract], *w.shape[contract:])
    return y, x2, w2


def _dense_fwd(x, w, contract):
    y, x2, w2 = _dense_2d(x, w, contract)
    return y, (x2, w2, x.shape, w.shape)


def _dense_bwd(contract, res, g):
    x2, w2, x_shape, w_shape = res
    g2 = g.reshape(x2.shape[0], w2.shape[1])
    dx = jnp.einsum("mn,kn->mk", g2, w2).reshape(x_shape)
    dw = jnp.einsum("mk,mn->kn", x2, g2).reshape(w_shape)
    return dx, dw


dense.defvjp(_dense_fwd, _dense_bwd)


class Block(nnx.Module):
    """All decoder layers' parameters, stacked on a leading `layers` axis.

    `__call__` computes ONE layer and must be given one layer's slice of the parameters
    (the scan in `Transformer` does that by merging a sliced state).
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        normal = functools.partial(_normal, rngs, std=cfg.initializer_range, dtype=dtype)
        self.attn_norm = _const(1.0, (L, D), ("layers", "norm"), dtype)
        self.q = normal((L, D, N, H), ("layers", "embed", "q_heads", "head_dim"))
        self.k = normal((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"))
        self.v = normal((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"))
        self.o = normal((L, N, H, D), ("layers", "q_heads", "head_dim", "embed"))
        if cfg.qkv_bias:
            self.q_bias = _const(0.0, (L, N, H), ("layers", "q_heads", "head_dim"), dtype)
            self.k_bias = _const(0.0, (L, K, H), ("layers", "kv_heads", "head_dim"), dtype)
            self.v_bias = _const(0.0, (L, K, H), ("layers", "kv_heads", "head_dim"), dtype)
        if cfg.o_bias:
            self.o_bias = _const(0.0, (L, D), ("layers", "norm"), dtype)
        if cfg.qk_norm:
            self.q_norm = _const(1.0, (L, H), ("layers", "head_dim"), dtype)
            self.k_norm = _const(1.0, (L, H), ("layers", "head_dim"), dtype)
        self.mlp_norm = _const(1.0, (L, D), ("layers", "norm"), dtype)
        self.gate = normal((L, D, F), ("layers", "embed", "mlp"))
        self.up = normal((L, D, F), ("layers", "embed", "mlp"))
        self.down = normal((L, F, D), ("layers", "mlp", "embed"))
        self.cfg = cfg

    def __call__(self, x, positions, mask, kv=None, index=None, layer=None, prefix=None):
        """One layer. x [B,T,D], positions [B,T], mask [B,T,S] bool.

        prefix: (k, v) [B,P,K,H] of P earlier tokens that x attends to before itself
        (S = P + T, no cache); the layer then returns its own (k, v) [B,T,K,H].

        kv: the whole cache (k, v) ([L,B,K,H,S], [L,B,K,S,H]), carried through the layer
        scan so that it is updated in place: this layer's new keys/values are written at
        slots index..index+T of [layer] and attention runs over the layer's S slots. With
        layer=None, kv is this layer's own cache arrays (unrolled layers). Without kv,
        S = T. Returns (x [B,T,D], the updated (k, v) or None).
        """
        cfg = self.cfg
        h = rms_norm(x, self.attn_norm[...], cfg.rms_norm_eps)
        q, k, v = dense(h, self.q[...]), dense(h, self.k[...]), dense(h, self.v[...])
        if cfg.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if cfg.qk_norm:
            q = rms_norm(q, self.q_norm[...], cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm[...], cfg.rms_norm_eps)
        inv_freq = rope_frequencies(cfg)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        if prefix is not None:
            # Keys/values of earlier tokens ([B, P, K, H] each, e.g. a shared prompt's) come
            # first; this layer's own (after RoPE) are returned for a later suffix.
            own = (k, v)
            k = jnp.concatenate([prefix[0].astype(k.dtype), k], axis=1)
            v = jnp.concatenate([prefix[1].astype(v.dtype), v], axis=1)
            a = attention(q, k, v, mask)
            kv = own
        elif kv is None:
            a = attention(q, k, v, mask)
        else:
            # k [B,T,K,H] -> [B,K,H,T] at slots index.., v -> [B,K,T,H] (see KVCache): at
            # [layer] of an [L, ...] cache (scanned layers), or into this layer's own arrays.
            lead = () if layer is None else (layer,)

            def write(c, new, start):
                new = new if layer is None else new[None]
                return jax.lax.dynamic_update_slice(c, new.astype(c.dtype), lead + start)

            kv = (
                write(kv[0], k.transpose(0, 2, 3, 1), (0, 0, 0, index)),
                write(kv[1], v.transpose(0, 2, 1, 3), (0, 0, index, 0)),
            )
            if layer is None:
                k, v = kv
            else:
                k, v = (jax.lax.dynamic_index_in_dim(c, layer, keepdims=False) for c in kv)
            a = cached_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask)
        x = x + dense(a, self.o[...], 2)
        if cfg.o_bias:
            x = x + self.o_bias[...]
        h = rms_norm(x, self.mlp_norm[...], cfg.rms_norm_eps)
        gate, up = dense(h, self.gate[...]), dense(h, self.up[...])
        x = x + dense(jax.nn.silu(gate) * up, self.down[...])
        return x, kv


class Transformer(nnx.Module):
    """Embedding, scanned layers, final norm and (untied) output projection."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        V, D = cfg.vocab_size, cfg.hidden_size
        self.embed = _normal(rngs, (V, D), ("vocab", "embed"), cfg.initializer_range, dtype)
        self.layers = Block(cfg, rngs, dtype)
        self.final_norm = _const(1.0, (D,), ("norm",), dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _normal(rngs, (D, V), ("embed", "vocab"), cfg.initializer_range, dtype)
        self.cfg = cfg

    def __call__(self, tokens, positions, mask, cache=None, index=None, layers=None):
        """tokens [B,T] -> final-normed hidden states [B,T,D] (and the new cache k, v).

        layers: with a per-layer cache, each layer's parameters already sliced out of the
        stacked ones (`layer_params`), e.g. once before a decode loop instead of per step.
        """
        cfg = self.cfg
        x = jnp.take(self.embed[...], tokens, axis=0)
        graphdef, stacked = nnx.split(self.layers)

        def layer(carry, xs):
            x, kv = carry
            layer_state, i = xs
            return nnx.merge(graphdef, layer_state)(x, positions, mask, kv, index, i), None

        if cache is not None and isinstance(cache[0], tuple):  # one cache array per layer
            kv = []
            for i in range(cfg.num_layers):
                state = jax.tree.map(lambda a, i=i: a[i], stacked) if layers is None else layers[i]
                block = nnx.merge(graphdef, state)
                x, layer_kv = block(x, positions, mask, (cache[0][i], cache[1][i]), index)
                kv.append(layer_kv)
            kv = tuple(tuple(c) for c in zip(*kv, strict=True))
            return rms_norm(x, self.final_norm[...], cfg.rms_norm_eps), kv
        layer = _remat(layer, cfg.remat)
        unroll = cfg.num_layers if cache is None and not cfg.scan_layers else 1
        xs = (stacked, jnp.arange(cfg.num_layers))
        (x, kv), _ = jax.lax.scan(layer, (x, cache), xs, unroll=unroll)
        return rms_norm(x, self.final_norm[...], cfg.rms_norm_eps), kv

    def with_prefix(self, tokens, positions, mask, prefix):
        """tokens [B,T] after a prefix of P tokens whose per-layer keys/values are given ->
        (final-normed hidden [B,T,D], this sequence's keys/values ([L,B,T,K,H] each)).

        prefix: (k, v) [L,B,P,K,H] each (P may be 0), as this method returned them for the
        earlier tokens; mask [B,T,P+T]. Scanned (or unrolled) like the full forward, with
        its remat policy and its attention backward, so it trains as fast.
        """
        cfg = self.cfg
        x = jnp.take(self.embed[...], tokens, axis=0)
        graphdef, stacked = nnx.split(self.layers)

        def layer(x, xs):
            layer_state, pk, pv = xs
            return nnx.merge(graphdef, layer_state)(x, positions, mask, prefix=(pk, pv))

        layer = _remat(layer, cfg.remat)
        unroll = 1 if cfg.scan_layers else cfg.num_layers
        x, kv = jax.lax.scan(layer, x, (stacked, *prefix), unroll=unroll)
        return rms_norm(x, self.final_norm[...], cfg.rms_norm_eps), kv


def _remat(fn, policy: str):
    if policy == "none":
        return fn
    policies = {
        "full": None,
        "dots": jax.checkpoint_policies.checkpoint_dots,
        "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    }
    return jax.checkpoint(fn, policy=policies[policy], prevent_cse=False)


# ------------------------------------------------------------------------ rope, attention
@functools.lru_cache(maxsize=64)
def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim / 2], float32, with `linear` / `llama3` scaling."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = dict(cfg.rope_scaling or ())
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding, HF `rotate_half` layout. x [B,T,N,H], positions [B,T]."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B,T,H/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)


def attention(q, k, v, mask) -> jax.Array:
    """GQA attention. q [B,T,N,H], k/v [B,S,K,H], mask [B,T,S] bool -> [B,T,N,H].

    Scores and softmax in float32. The G = N / K query heads that share a key/value head
    are stacked as G * T rows of one matmul per (batch, kv head). The backward is written
    out (`_attention_bwd`, the flash-attention formulas): only q, k, v, the output and the
    row logsumexp are kept, and the probabilities are recomputed. Autodiff kept every
    layer's [B, N, T, S] probabilities and reshuffled them between layouts, which made
    attention ~10x its FLOPs in a forward + backward on CPU (27% of a 100M model's step at
    512 tokens).
    """
    return _attention_vjp(q, k, v, mask)


def cached_attention(q, kt, v, mask) -> jax.Array:
    """`attention` (forward only) over one layer of the KV cache, in the cache's layout:
    kt [B,K,H,S] (keys transposed), v [B,K,S,H]. Both matmuls then read the cache slice
    as it is, each with its contraction on the operand's leading axis."""
    B, T, N, H = q.shape
    qr, mr = _q_rows(q, kt.shape[1]), _mask_rows(mask, N // kt.shape[1])
    return _unrows(_attention_rows(qr, kt, v, mr, "bkhs")[0], B, T, N, H)


def _q_rows(q, K):
    """q [B,T,N,H] -> [B,K,G*T,H] (row = g * T + t)."""
    B, T, N, H = q.shape
    G = N // K
    return q.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)


def _mask_rows(mask, G):
    """mask [B,T,S] -> [B,1,G*T,S]."""
    B, T, S = mask.shape
    return jnp.broadcast_to(mask[:, None, None], (B, 1, G, T, S)).reshape(B, 1, G * T, S)


def _rows(q, k, v, mask):
    """q -> [B,K,G*T,H]; k, v [B,S,K,H] -> [B,K,S,H]; mask -> [B,1,G*T,S]."""
    K = k.shape[2]
    kr, vr = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    return _q_rows(q, K), kr, vr, _mask_rows(mask, q.shape[2] // K)


def _unrows(o, B, T, N, H):
    K = o.shape[1]
    return o.reshape(B, K, N // K, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


def _scores(qr, kr, mr, scale, k_layout="bksh"):
    s = jnp.einsum(f"bkrh,{k_layout}->bkrs", qr, kr, preferred_element_type=jnp.float32)
    return jnp.where(mr, s * scale, -0.7 * jnp.finfo(jnp.float32).max)


def _attention_rows(qr, kr, vr, mr, k_layout="bksh"):
    """Row-layout attention -> (o [B,K,R,H], row logsumexp [B,K,R,1])."""
    s = _scores(qr, kr, mr, qr.shape[-1] ** -0.5, k_layout)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    o = jnp.einsum("bkrs,bksh->bkrh", (e / total).astype(vr.dtype), vr)
    return o, m + jnp.log(total)


def _attention(q, k, v, mask):
    B, T, N, H = q.shape
    qr, kr, vr, mr = _rows(q, k, v, mask)
    o, lse = _attention_rows(qr, kr, vr, mr)
    return _unrows(o, B, T, N, H), (qr, kr, vr, mr, o, lse)


@jax.custom_vjp
def _attention_vjp(q, k, v, mask):
    return _attention(q, k, v, mask)[0]


def _attention_fwd(q, k, v, mask):
    out, res = _attention(q, k, v, mask)
    return out, (*res, q.shape, k.shape)


def _attention_bwd(res, g):
    qr, kr, vr, mr, o, lse, q_shape, k_shape = res
    B, T, N, H = q_shape
    K = k_shape[2]
    gr = g.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4).reshape(o.shape)
    p = jnp.exp(_scores(qr, kr, mr, H**-0.5) - lse)  # [B,K,R,S] float32
    dv = jnp.einsum("bkrs,bkrh->bksh", p.astype(gr.dtype), gr)
    dp = jnp.einsum("bkrh,bksh->bkrs", gr, vr, preferred_element_type=jnp.float32)
    delta = jnp.sum(gr.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
    ds = (p * (dp - delta) * H**-0.5).astype(qr.dtype)
    dq = _unrows(jnp.einsum("bkrs,bksh->bkrh", ds, kr), B, T, N, H)
    dk = jnp.einsum("bkrs,bkrh->bksh", ds, qr).transpose(0, 2, 1, 3)
    return dq, dk, dv.transpose(0, 2, 1, 3), None


_attention_vjp.defvjp(_attention_fwd, _attention_bwd)


# --------------------------------------------------------------------------- kv cache
@struct.dataclass
class KVCache:
    """Preallocated keys/values of every layer, written in place by `extend`.

    All rows advance together: `index` is the next slot for every row; a row's padding
    slots stay `valid=False` and are never attended to.

    Layout: per (row, kv head), keys are stored transposed ([H, S]) and values as [S, H],
    so a decode step's score matmul ([G, H] x [H, S]) and value matmul ([G, S] x [S, H])
    read the layer's slice as stored. Keys stored [S, H] (the score matmul contracting
    both operands' minor axis) were ~5x slower per score matmul on XLA:CPU, and a
    [B, S, K, H] layout cost a transposing copy of every layer's slice per token.
    """

    k: jax.Array | tuple  # [L, B, K, H, S]: transposed, as the score matmul reads it
    v: jax.Array | tuple  # [L, B, K, S, H]
    valid: jax.Array  # [B, S] bool: the slot holds a real token
    pos: jax.Array  # [B] int32: position id of each row's next token
    index: jax.Array  # [] int32: next slot to write

    @property
    def max_len(self) -> int:
        return jax.tree.leaves(self.v)[0].shape[-2]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache. With `cfg.scan_layers=False` k and v are tuples of L per-layer arrays
    ([B, K, H, S] / [B, K, S, H]) and `extend` runs the layers unrolled: each layer's matmuls
    then read its cache buffer in place instead of a copy of its slice of an [L, ...] array.
    """
    L, K, H = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    k, v = jnp.zeros((L, batch, K, H, max_len), dtype), jnp.zeros((L, batch, K, max_len, H), dtype)
    if not cfg.scan_layers:
        k, v = tuple(k), tuple(v)
    return KVCache(
        k=k,
        v=v,
        valid=jnp.zeros((batch, max_len), bool),
        pos=jnp.zeros((batch,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )


def cache_rows(cache: KVCache, rows: jax.Array) -> KVCache:
    """The cache of rows `rows` [B'] (indices into its B rows; repeats allowed), e.g. one
    prefilled prompt's cache for each of its G samples."""

    def take(x, axis):
        return jnp.take(x, rows, axis=axis)

    return cache.replace(
        k=jax.tree.map(lambda c: take(c, c.ndim - 4), cache.k),  # the batch axis
        v=jax.tree.map(lambda c: take(c, c.ndim - 4), cache.v),
        valid=take(cache.valid, 0),
        pos=take(cache.pos, 0),
    )


def grow_cache(cache: KVCache, max_len: int) -> KVCache:
    """The cache with room for `max_len` slots: empty (invalid) slots appended.

    Attention reads every slot of the cache it is given, filled or not; a decode loop in
    segments (`sampling`) starts with a short cache and grows it between segments, so each
    token reads only about as many slots as are filled. One copy of the cache per call."""
    pad = max_len - cache.max_len
    if pad < 0:
        raise ValueError(f"grow_cache: max_len {max_len} < the cache's {cache.max_len} slots")
    if pad == 0:
        return cache

    def grow(c, axis):  # axis from the end: the slot axis of k [.., H, S] / v [.., S, H]
        widths = [(0, 0)] * c.ndim
        widths[c.ndim - axis] = (0, pad)
        return jnp.pad(c, widths)

    return cache.replace(
        k=jax.tree.map(lambda c: grow(c, 1), cache.k),
        v=jax.tree.map(lambda c: grow(c, 2), cache.v),
        valid=grow(cache.valid, 1),
    )


# ------------------------------------------------------------------------ functional API
@functools.lru_cache(maxsize=32)
def abstract_model(cfg: ModelConfig, dtype=jnp.float32):
    """(graphdef, abstract state) of the model; no arrays are allocated."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0), dtype)))


def _model(cfg: ModelConfig, params: Params) -> Transformer:
    return nnx.merge(abstract_model(cfg)[0], params)


def layer_params(params: Params) -> tuple:
    """Each layer's parameters, sliced out of the stacked [L, ...] ones (for `decode_step`)."""
    n = jax.tree.leaves(params["layers"])[0].shape[0]
    return tuple(jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(n))


def default_positions(attention_mask: jax.Array, segment_ids: jax.Array | None = None):
    """Position ids [B,T]: real tokens before this one (within its segment, if given)."""
    mask = attention_mask.astype(jnp.int32)
    if segment_ids is None:
        return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
    new_segment = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1
    )
    running = jnp.cumsum(mask, axis=-1)
    start = jax.lax.cummax(jnp.where(new_segment, running - mask, 0), axis=1)
    return jnp.maximum(running - start - 1, 0)


def forward(
    cfg: ModelConfig, params: Params, tokens, attention_mask=None, positions=None, segment_ids=None
) -> jax.Array:
    """Full-sequence forward: tokens [B,T] -> final-normed hidden states [B,T,D]."""
    B, T = tokens.shape
    if attention_mask is None:
        attention_mask = jnp.ones((B, T), bool)
    attention_mask = attention_mask.astype(bool)
    if positions is None:
        positions = default_positions(attention_mask, segment_ids)
    causal = jnp.tril(jnp.ones((T, T), bool))
    mask = causal[None] & attention_mask[:, None, :]
    if segment_ids is not None:
        mask &= segment_ids[:, :, None] == segment_ids[:, None, :]
    mask |= jnp.eye(T, dtype=bool)[None]  # a padding query attends to itself: no empty rows
    hidden, _ = _model(cfg, params)(tokens, positions, mask)
    return hidden


def forward_after_prefix(
    cfg: ModelConfig, params: Params, tokens, attention_mask, prefix=None, prefix_mask=None
):
    """`forward` of tokens that follow a prefix already run: (hidden [B,T,D], keys/values).

    tokens, attention_mask [B,T]; prefix: the (k, v) [L,B,P,K,H] this function returned
    for the prefix (None: no prefix), prefix_mask [B,P] its real tokens. The tokens'
    positions continue after the prefix's real tokens and they attend to all of them, so
    hidden equals `forward` of the concatenation [prefix, tokens] at the tokens'
    positions. Returns the keys/values of `tokens` ([L,B,T,K,H] each) for a later suffix.
    Differentiable w.r.t. params and prefix; e.g. a prompt run once for the G samples of
    its GRPO group (`rl.batch.prefix_logprobs`).
    """
    B, T = tokens.shape
    attention_mask = attention_mask.astype(bool)
    if prefix is None:
        L, K, H = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        dtype = params["embed"].dtype
        prefix = (jnp.zeros((L, B, 0, K, H), dtype), jnp.zeros((L, B, 0, K, H), dtype))
        prefix_mask = jnp.zeros((B, 0), bool)
    prefix_mask = prefix_mask.astype(bool)
    before = prefix_mask.sum(-1, dtype=jnp.int32)[:, None]
    positions = jnp.maximum(before + jnp.cumsum(attention_mask, -1, dtype=jnp.int32) - 1, 0)
    causal = jnp.tril(jnp.ones((T, T), bool))
    own = (causal[None] & attention_mask[:, None, :]) | jnp.eye(T, dtype=bool)[None]
    earlier = jnp.broadcast_to(prefix_mask[:, None, :], (B, T, prefix_mask.shape[1]))
    mask = jnp.concatenate([earlier, own], axis=-1)
    return _model(cfg, params).with_prefix(tokens, positions, mask, prefix)


def unembed_matrix(cfg: ModelConfig, params: Params) -> jax.Array:
    """The output projection W [D, V] (the transposed embedding when tied)."""
    return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def project(cfg: ModelConfig, params: Params, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V]."""
    w = unembed_matrix(cfg, params)
    return jnp.einsum("...d,dv->...v", hidden, w, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnums=0)
def logits(
    cfg: ModelConfig,
    params: Params,
    input_ids,
    attention_mask=None,
    positions=None,
    segment_ids=None,
) -> jax.Array:
    """Float32 logits [B,T,V] for a (left- or right-) padded batch. Jitted."""
    hidden = forward(cfg, params, input_ids, attention_mask, positions, segment_ids)
    return project(cfg, params, hidden)


def extend(cfg: ModelConfig, params: Params, tokens, attention_mask, cache: KVCache, layers=None):
    """Appends tokens [B,T] (attention_mask [B,T]) to the cache.

    Returns (hidden [B,T,D], new cache). Slots index..index+T-1 are written; a token
    attends to the cache's valid slots up to and including its own. layers: optional
    `layer_params(params)` for a per-layer cache (`init_cache`).
    """
    B, T = tokens.shape
    attention_mask = attention_mask.astype(bool)
    S = cache.max_len
    new = jax.lax.dynamic_update_slice(jnp.zeros((B, S), bool), attention_mask, (0, cache.index))
    valid = cache.valid | new
    positions = cache.pos[:, None] + default_positions(attention_mask)
    slots = jnp.arange(S)
    query_slot = cache.index + jnp.arange(T)
    mask = valid[:, None, :] & (slots[None, None, :] <= query_slot[None, :, None])
    mask |= slots[None, None, :] == query_slot[None, :, None]
    hidden, (k, v) = _model(cfg, params)(
        tokens, positions, mask, (cache.k, cache.v), cache.index, layers
    )
    new_cache = KVCache(
        k=k,
        v=v,
        valid=valid,
        pos=cache.pos + attention_mask.sum(-1, dtype=jnp.int32),
        index=cache.index + T,
    )
    return hidden, new_cache


def prefill(cfg: ModelConfig, params: Params, tokens, attention_mask, cache: KVCache):
    """Prompt [B,T] into an empty cache -> (logits of each row's last real token [B,V], cache)."""
    hidden, cache = extend(cfg, params, tokens, attention_mask, cache)
    T = tokens.shape[1]
    # Last real token: the highest index with mask=1 (works for left and right padding).
    last = T - 1 - jnp.argmax(attention_mask[:, ::-1].astype(bool), axis=-1)
    last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    return project(cfg, params, last_hidden), cache


def decode_step(cfg: ModelConfig, params: Params, tokens, cache: KVCache, layers=None):
    """One new token per row, tokens [B] -> (logits [B,V], cache). layers: see `extend`."""
    hidden, cache = extend(
        cfg, params, tokens[:, None], jnp.ones_like(tokens[:, None], bool), cache, layers
    )
    return project(cfg, params, hidden[:, 0]), cache
