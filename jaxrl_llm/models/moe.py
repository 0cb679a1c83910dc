"""Mixture-of-experts MLP (Qwen3-MoE, GLM-4.5, GPT-OSS, Qwen3.5-MoE, Gemma 4): a router picks k
of E SwiGLU (Gemma: GeGLU) experts per token.

For a token h [D] with router weight W_r [D, E], `cfg.router` = "softmax" (Qwen3-MoE,
`transformers` Qwen3MoeSparseMoeBlock):

    p = softmax(h W_r)                     (float32, over the E experts)
    S = top_k(p)                           (the k selected experts)
    w_e = p_e  (e in S),   w_e = p_e / sum_{j in S} p_j  when norm_topk_prob
    y = sum_{e in S} w_e * down_e(silu(gate_e(h)) * up_e(h))

"sigmoid" (DeepSeek-V3's `noaux_tc`, as GLM-4.5 and Kimi K2 route; `transformers`
Glm4MoeTopkRouter), with the per-expert selection bias b [E] and the experts split into
`n_group` equal groups:

    p = sigmoid(h W_r)                     (float32: h and W_r cast first)
    c = p + b                              (the bias moves the choice, never the weights)
    g_j = sum of the 2 largest c_e in group j;  G = the topk_group groups of largest g_j
    S = top_k(c restricted to the experts of G)
    w_e = p_e, / (sum_{j in S} p_j + 1e-20) when norm_topk_prob, times routed_scaling_factor
    y = sum_{e in S} w_e * expert_e(h) + shared(h)

"topk_softmax" (GPT-OSS, `transformers` GptOssTopKRouter), with the router's bias b [E]
added to the logits and biases on each expert's projections:

    l = h W_r + b;   S = top_k(l);   w_e = softmax_{j in S}(l_j)_e
    y = sum_{e in S} w_e * (down_e act(gate_e(h) + b^g_e, up_e(h) + b^u_e) + b^d_e)
    act(g, u) = (clip(u, -limit, limit) + 1) * g' sigmoid(alpha g'),  g' = min(g, limit)

(`swiglu_limit`, `swiglu_alpha`; the plain silu(g) * u when the limit is 0).

"gemma4" (Gemma 4's MoE block, `transformers` Gemma4TextRouter / Gemma4TextExperts /
Gemma4TextDecoderLayer), reading the layer's residual stream x [D] (before the MLP's norm)
with the router's input scale s [D] and a scale c [E] per expert:

    p = softmax((RMSNorm(x) * s / sqrt(D)) W_r)       (the norm without a weight; float32)
    S = top_k(p);   w_e = c_e p_e / sum_{j in S} p_j
    y = n_1(dense(n_0(x))) + n_3(sum_{e in S} w_e * down_e(gelu(gate_e(h)) * up_e(h)))

with h = n_2(x) the experts' input, dense the layer's GeGLU MLP (held as the shared
expert, width `intermediate_size`) and n_0 .. n_3 the layer's four MLP norms
(`pre_feedforward_layernorm`, `post_feedforward_layernorm_1`,
`pre_feedforward_layernorm_2`, `post_feedforward_layernorm_2`); the layer then norms y
once more (`post_feedforward_layernorm`) and adds it to x. Replay keeps c_e and the
renormalisation over the replayed experts.

And where shared is a dense SwiGLU of width n_shared_experts * moe_intermediate_size that
every token goes through (`n_shared_experts` = 0: none). The bias is not trained here: it
only picks experts, so its gradient is zero (DeepSeek-V3 adjusts it by a load rule in
pre-training, not by gradient); the optimizer's weight decay skips it like every bias.

Dropless: every token reaches all k of its experts (no capacity factor, no token dropped
when an expert is popular). The experts run as one grouped matmul (`jax.lax.ragged_dot`)
over the N*k (token, expert) pairs sorted by expert, so each expert multiplies exactly the
rows routed to it; `dense_experts` is the same function with every expert applied to every
token (E/k times the FLOPs), the reference the grouped path is tested against and the
baseline of `benchmarks/moe.py`.

Routing replay (R3): `routes` [N, k] gives the experts to use instead of the router's own
top-k (the ones the sampler chose for that token). The gating weights are still read from
the current router's scores at those experts by the router's own formula (softmax or
sigmoid, renormalised and scaled as above), so the router gets its gradient through them
exactly as without replay; only the discrete choice (top-k, bias, groups) is fixed. The
router's own top-k is always returned too, for the agreement metric and for the sampler to
record.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.models import moe_kernels
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layer_math import gemma_rms_norm, norm
from jaxrl_llm.parallel import target

ROUTE_DTYPE = jnp.int16  # recorded expert ids: E <= 32767 (the largest models have 256)


def router_probs(h: jax.Array, router: jax.Array) -> jax.Array:
    """h [N, D], router [D, E] -> softmax(h W_r) [N, E] float32. The logits are computed in
    h's dtype (as HF's F.linear does), the softmax in float32."""
    logits = jnp.matmul(h, router.astype(h.dtype))
    return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)


def router_scores(
    cfg: ModelConfig, h: jax.Array, router: jax.Array, bias=None, scale=None
) -> jax.Array:
    """The router's scores [N, E] float32: `router_probs` (softmax), for the sigmoid
    router sigmoid(h W_r) with h and W_r in float32 (GLM-4.5 keeps its router in float32),
    for topk_softmax the logits h W_r + bias (in h's dtype, as HF's F.linear), for gemma4
    `router_probs` of RMSNorm(h) * scale [D] / sqrt(D)."""
    if cfg.router == "gemma4":  # as HF: each product rounded to h's dtype, 1/sqrt(D) not
        x = gemma_rms_norm(h, None, cfg.rms_norm_eps) * scale.astype(h.dtype)
        x = (x.astype(jnp.float32) * h.shape[-1] ** -0.5).astype(h.dtype)
        return router_probs(x, router)
    if cfg.router == "softmax":
        return router_probs(h, router)
    if cfg.router == "topk_softmax":
        logits = jnp.matmul(h, router.astype(h.dtype)) + bias.astype(h.dtype)
        return logits.astype(jnp.float32)
    logits = jnp.matmul(h.astype(jnp.float32), router.astype(jnp.float32))
    return jax.nn.sigmoid(logits)


def own_choice(cfg: ModelConfig, scores: jax.Array, bias: jax.Array | None = None):
    """The router's own top-k [N, k] int32 from its scores [N, E]. Sigmoid router: top-k
    of scores + bias over the experts of the `topk_group` groups whose two best biased
    scores sum highest (all experts when n_group = 1)."""
    k = cfg.num_experts_per_tok
    if cfg.router != "sigmoid":  # softmax, topk_softmax (whose bias is in the logits)
        return jax.lax.top_k(scores, k)[1]
    choice = scores + bias.astype(jnp.float32)
    if cfg.n_group > 1:
        n, E, G = choice.shape[0], cfg.num_experts, cfg.n_group
        grouped = choice.reshape(n, G, E // G)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, G]
        best = jax.lax.top_k(group_scores, cfg.topk_group)[1]
        keep = jnp.any(best[:, :, None] == jnp.arange(G), axis=1)  # [N, G]
        choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(n, E)
    return jax.lax.top_k(choice, k)[1]


def gate_weights(
    cfg: ModelConfig, scores: jax.Array, ids: jax.Array, expert_scale=None
) -> jax.Array:
    """The weights [N, k] float32 of the experts ids [N, k] from the scores [N, E]: the
    scores there, renormalised over the k when `norm_topk_prob` (the sigmoid router adds
    1e-20 to the sum, as HF does), times `routed_scaling_factor`. topk_softmax: the
    softmax over the logits at ids. gemma4: renormalised, times expert_scale [E] at ids."""
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.router == "topk_softmax":
        return jax.nn.softmax(weights, axis=-1)
    if cfg.norm_topk_prob or cfg.router == "gemma4":
        total = jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights / (total + 1e-20 if cfg.router == "sigmoid" else total)
    if cfg.router == "gemma4":
        return weights * jnp.take(expert_scale, ids, axis=0).astype(weights.dtype)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights


def select(
    cfg: ModelConfig,
    probs: jax.Array,
    routes: jax.Array | None = None,
    bias=None,
    expert_scale=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """scores [N, E] -> (experts used [N, k] int32, their weights [N, k] float32, the
    router's own top-k [N, k] int32). routes [N, k]: experts to use instead of the own top-k
    (replay), -1 in a row: that token keeps its own; the weights are then the current
    scores at the experts used (`gate_weights`). bias [E]: the sigmoid router's;
    expert_scale [E]: Gemma 4's scale per expert."""
    own = own_choice(cfg, probs, bias)
    ids = own
    if routes is not None:  # a token without a recorded route (-1) keeps its own top-k
        recorded = jnp.all(routes >= 0, axis=-1, keepdims=True)
        ids = jnp.where(recorded, routes.astype(jnp.int32), own)
    return ids, gate_weights(cfg, probs, ids, expert_scale), own


def silu_glu(g: jax.Array, u: jax.Array) -> jax.Array:
    """SwiGLU's gating: silu(gate x) * (up x)."""
    return jax.nn.silu(g) * u


def gelu_glu(g: jax.Array, u: jax.Array) -> jax.Array:
    """GeGLU's gating (Gemma): gelu(gate x) * (up x), GELU's tanh approximation."""
    return jax.nn.gelu(g, approximate=True) * u


def clamped_glu(limit: float, alpha: float):
    """GPT-OSS's gating (`GptOssExperts._apply_gate`): the gate clipped above at limit,
    the up projection to [-limit, limit], (u + 1) * g * sigmoid(alpha g)."""

    def glu(g, u):
        g = jnp.minimum(g, jnp.asarray(limit, g.dtype))
        u = jnp.clip(u, -limit, limit)
        return (u + 1) * (g * jax.nn.sigmoid(g * jnp.asarray(alpha, g.dtype)))

    return glu


def _swiglu(x, gate, up, down, matmul, glu=silu_glu, biases=None):
    """down(glu(gate x, up x)); biases (gate, up, down) [E, F] / [E, D] go to `matmul`'s
    third argument (each path adds a row's expert's bias)."""
    bg, bu, bd = biases or (None, None, None)
    if bg is None:
        return matmul(glu(matmul(x, gate), matmul(x, up)), down)
    return matmul(glu(matmul(x, gate, bg), matmul(x, up, bu)), down, bd)


def grouped_experts(x, ids, weights, gate, up, down, glu=silu_glu, biases=None) -> jax.Array:
    """Dropless grouped-matmul experts: x [N, D], ids/weights [N, k], gate/up [E, D, F],
    down [E, F, D] -> [N, D] = sum_j weights[n, j] * expert_{ids[n, j]}(x[n]).

    The N*k (token, expert) pairs are sorted by expert (stable), each expert's contiguous
    rows go through its own weights in one `ragged_dot`, and the outputs are gathered
    back to token order and summed over the k choices with their weights. glu: the
    gating (`silu_glu`, `clamped_glu`); biases: (gate, up, down) per expert, or None."""
    n, k = ids.shape
    num_experts = gate.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pair index, grouped by expert
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    xs = jnp.take(x, order // k, axis=0)  # [N*k, D]
    row_expert = flat[order]

    def matmul(a, w, b=None):
        y = jax.lax.ragged_dot(a, w.astype(a.dtype), sizes)
        return y if b is None else y + jnp.take(b, row_expert, axis=0).astype(y.dtype)

    ys = _swiglu(xs, gate, up, down, matmul, glu, biases)
    inverse = jnp.argsort(order)
    ys = jnp.take(ys, inverse, axis=0).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", ys, weights.astype(ys.dtype))


BLOCK_ROWS = 128  # rows per block of `blocked_experts`


def blocked_experts(
    x, ids, weights, gate, up, down, glu=silu_glu, biases=None, block: int = BLOCK_ROWS
) -> jax.Array:
    """`grouped_experts` as batched matmuls over blocks of rows, for backends without a
    grouped-matmul kernel (XLA:CPU computes `ragged_dot` densely over all groups).

    The (token, expert) pairs sorted by expert are laid out with each expert's rows padded
    to a multiple of `block`, so every block belongs to one expert: at most N*k + E*(block-1)
    rows, rounded up to whole blocks (static). Each block multiplies its expert's weights
    (gathered per block), so the FLOPs are those of the routed rows plus the padding."""
    n, k = ids.shape
    num_experts = gate.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts)
    padded = (sizes + block - 1) // block * block
    padded_end = jnp.cumsum(padded)
    sorted_experts = flat[order]
    rank = jnp.arange(n * k) - (jnp.cumsum(sizes) - sizes)[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank  # row of each sorted pair
    num_blocks = -(-(n * k + num_experts * (block - 1)) // block)
    rows = jnp.zeros((num_blocks * block, x.shape[1]), x.dtype)
    rows = rows.at[dest].set(jnp.take(x, order // k, axis=0))
    starts = jnp.arange(num_blocks) * block
    owner = jnp.minimum(jnp.searchsorted(padded_end, starts, side="right"), num_experts - 1)
    xb = rows.reshape(num_blocks, block, -1)

    def matmul(a, w, b=None):  # a [B, block, in], w [E, in, out] -> [B, block, out]
        y = jnp.einsum("bri,bio->bro", a, jnp.take(w, owner, axis=0).astype(a.dtype))
        return y if b is None else y + jnp.take(b, owner, axis=0)[:, None].astype(y.dtype)

    yb = _swiglu(xb, gate, up, down, matmul, glu, biases).reshape(num_blocks * block, -1)
    ys = jnp.take(yb, dest, axis=0)  # sorted order
    ys = jnp.take(ys, jnp.argsort(order), axis=0).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", ys, weights.astype(ys.dtype))


def dense_experts(x, ids, weights, gate, up, down, glu=silu_glu, biases=None) -> jax.Array:
    """`grouped_experts` computed densely: every expert on every token [N, E, D], then the
    weighted sum over each token's k selected experts (zero weight elsewhere)."""
    num_experts = gate.shape[0]

    def matmul(a, w, b=None):  # a [N, D] or [E, N, F]
        spec = "nd,edf->enf" if a.ndim == 2 else "enf,efd->end"
        y = jnp.einsum(spec, a, w.astype(a.dtype))
        return y if b is None else y + b[:, None].astype(y.dtype)

    ys = _swiglu(x, gate, up, down, matmul, glu, biases)  # [E, N, D]
    onehot = jax.nn.one_hot(ids, num_experts, dtype=weights.dtype)  # [N, k, E]
    combine = jnp.einsum("nke,nk->ne", onehot, weights)
    return jnp.einsum("end,ne->nd", ys, combine.astype(ys.dtype))


EXPERT_IMPLS = {"ragged": grouped_experts, "blocked": blocked_experts, "dense": dense_experts}


def moe_mlp(cfg: ModelConfig, h: jax.Array, weights: dict, routes=None, residual=None):
    """The MoE block of one layer: h [B, T, D] -> (y [B, T, D], own top-k [B, T, k] int32).

    weights: {"router" [D, E], "gate"/"up" [E, D, F], "down" [E, F, D]} of this layer,
    and for the sigmoid router "router_bias" [E], with shared experts "shared_gate" /
    "shared_up" [D, Fs], "shared_down" [Fs, D], and Qwen3.5-MoE's "shared_expert_gate"
    [D, 1]; Gemma 4's "router_norm" [D], "expert_scale" [E] and norms "dense_post_norm",
    "expert_norm", "expert_post_norm" [D].
    routes [B, T, k]: replayed experts (None: the router's own top-k). residual [B, T, D]:
    Gemma 4's residual stream before the MLP's norm (its router's and experts' input; h,
    the normed one, is its dense MLP's)."""
    B, T, D = h.shape
    x = h.reshape(B * T, D)
    flat_routes = None if routes is None else routes.reshape(B * T, -1)
    if cfg.router == "gemma4":
        y, own = _gemma4_block(cfg, x, residual.reshape(B * T, D), weights, flat_routes)
    else:
        y, own = routed_experts(cfg, x, x, weights, flat_routes)
    if cfg.n_shared_experts:
        shared = (weights["shared_gate"], weights["shared_up"], weights["shared_down"])
        ys = _swiglu(x, *shared, _plain_matmul)
        if cfg.shared_expert_gate:  # Qwen3.5-MoE: sigmoid(x w_g) [N, 1] scales it
            ys = ys * jax.nn.sigmoid(jnp.matmul(x, weights["shared_expert_gate"].astype(x.dtype)))
        y = y + ys
    k = cfg.num_experts_per_tok
    return y.reshape(B, T, D), own.reshape(B, T, k)


def _plain_matmul(a, w):
    return jnp.matmul(a, w.astype(a.dtype))


def routed_experts(cfg: ModelConfig, x, router_input, weights: dict, routes=None):
    """The routed experts on x [N, D], chosen from router_input [N, D] (x itself but in
    Gemma 4): (y [N, D], the router's own top-k [N, k] int32). routes [N, k] or None."""
    probs = router_scores(
        cfg, router_input, weights["router"], weights.get("router_bias"), weights.get("router_norm")
    )
    ids, w, own = select(
        cfg, probs, routes, weights.get("router_bias"), weights.get("expert_scale")
    )
    mesh = jax.sharding.get_abstract_mesh()
    impl = moe_kernels.resolve(
        cfg.moe_impl, target.backend(), target.device_count(), not mesh.empty
    )  # auto: gmm on TPU, ragged on GPU, blocked on CPU (models/moe_kernels.py)
    experts = moe_kernels.gmm_experts if impl == "gmm" else EXPERT_IMPLS[impl]
    glu = clamped_glu(cfg.swiglu_limit, cfg.swiglu_alpha) if cfg.swiglu_limit else silu_glu
    glu = gelu_glu if cfg.gemma else glu
    biases = None
    if cfg.expert_bias:
        biases = (weights["gate_bias"], weights["up_bias"], weights["down_bias"])
    return experts(x, ids, w, weights["gate"], weights["up"], weights["down"], glu, biases), own


def _gemma4_block(cfg: ModelConfig, h, x, weights: dict, routes):
    """Gemma 4's two MLP branches (module docstring): the dense GeGLU on h [N, D] (x
    normed by the layer's `pre_feedforward_layernorm`), the experts on x [N, D] normed
    by "expert_norm" and routed from x; each branch normed after, then summed."""
    dense = (weights["shared_gate"], weights["shared_up"], weights["shared_down"])
    y1 = norm(cfg, _swiglu(h, *dense, _plain_matmul, gelu_glu), weights["dense_post_norm"])
    xe = norm(cfg, x, weights["expert_norm"])
    y2, own = routed_experts(cfg, xe, x, weights, routes)
    return y1 + norm(cfg, y2, weights["expert_post_norm"]), own


def router_agreement(own: jax.Array, recorded: jax.Array, mask: jax.Array) -> jax.Array:
    """Fraction of (token, layer) selections where the router's own top-k equals the
    recorded one as a set: own, recorded [N, T, L, k], mask [N, T] (tokens counted; those
    without a recorded route are skipped). -> [] float32."""
    same = jnp.all(jnp.sort(own, axis=-1) == jnp.sort(recorded.astype(own.dtype), axis=-1), -1)
    counted = mask[:, :, None] & jnp.all(recorded >= 0, axis=-1)
    total = jnp.maximum(jnp.sum(counted), 1)
    return jnp.sum(same & counted) / total


def expert_load(own: jax.Array, mask: jax.Array, num_experts: int) -> jax.Array:
    """Share of the k selections of the masked tokens that went to each expert, per layer:
    own [N, T, L, k], mask [N, T] -> [L, E] float32 (each row sums to 1; uniform is 1/E).
    A negative id (a dense-MLP layer, a token not routed) counts nowhere: a layer without
    any selection has a row of zeros."""
    onehot = jax.nn.one_hot(own, num_experts, dtype=jnp.float32)  # [N, T, L, k, E]
    counts = jnp.einsum("ntlke,nt->le", onehot, mask.astype(jnp.float32))
    return counts / jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1.0)
