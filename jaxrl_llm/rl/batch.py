"""The rollout batch the update step consumes, and teacher-forced log-probs of it.

    batch = RolloutBatch.from_sample(out, rewards, ref_logprobs)   # out: sampling.SampleOutput
    ref_fn = make_logprob_fn(model_cfg, spec)                      # jitted, no gradient
    ref_logprobs = ref_fn(ref_params, out)                         # [N, T]

A batch row is a left-padded prompt [P] followed by a right-padded completion [T]. The
model reads their concatenation; the hidden state at sequence position P - 1 + t predicts
completion token t (`completion_hidden`), so log pi(o_t | q, o_<t) and the critic's
V(s_t) use the same shift. Log-probs are taken at the sampling temperature, in chunks
over T (`rl.token_logprobs`), so [N, T, V] logits never exist at once.

Row slices and shared prompts (`split_rows`, `map_rows`, `shared_prompt_logprobs`) are
`rl.prefix`'s.

Routing replay (mixture-of-experts models): `routes` [N, P + T, L, k], the experts the
sampler routed each token of concat(prompt, completion) to (`sampling.SampleOutput`),
given to a forward makes its MoE layers use them instead of their own top-k
(`models.moe`); None routes each token by the current router.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import models
from jaxrl_llm.parallel import target
from jaxrl_llm.parallel.mesh import BATCH_AXES, batch_size_multiple
from jaxrl_llm.rl.logprobs import token_logprobs
from jaxrl_llm.rl.packing import (
    DEFAULT_CAPACITY,
    pack,
    packed_seqs,
    plan_packing,
    resolve_packing,
    unpack_completion,
)
from jaxrl_llm.rl.prefix import check_groups, map_rows, shared_prompt_logprobs


@struct.dataclass
class RolloutBatch:
    """One rollout batch: B groups of G rows, prompt-major (rows b * G ... b * G + G - 1
    are the G samples of prompt b, as the sampler produces them)."""

    prompt_tokens: jax.Array  # [N, P] int32, left-padded
    prompt_mask: jax.Array  # [N, P] bool
    tokens: jax.Array  # [N, T] int32 completions, right-padded
    mask: jax.Array  # [N, T] bool: attended completion tokens
    loss_mask: jax.Array  # [N, T] bool: trained tokens (sampled ones; a subset of mask)
    behaviour_logprobs: jax.Array  # [N, T] float32: the sampler's, at the spec temperature
    rewards: jax.Array  # [N] or [N, K] float32
    policy_version: jax.Array  # [N] int32: the parameter version that sampled each row
    ref_logprobs: jax.Array | None = None  # [N, T] float32; needed iff beta > 0
    teacher_logprobs: jax.Array | None = None  # [N, T] float32; iff algo.distill_coef > 0
    num_generations: int = struct.field(pytree_node=False, default=1)  # G
    routes: jax.Array | None = None  # [N, P + T, L, k] int16: the sampler's (MoE models)

    @property
    def group_ids(self) -> jax.Array:
        """[N] int32: the prompt (group) of each row."""
        n = self.tokens.shape[0]
        return jnp.arange(n, dtype=jnp.int32) // self.num_generations

    @classmethod
    def from_sample(cls, out, rewards, ref_logprobs=None, teacher_logprobs=None) -> RolloutBatch:
        """From a `sampling.SampleOutput`; host rewards [N] / [N, K] are put on device (an
        explicit transfer, allowed under transfer_guard) sharded like the rows."""
        check_groups(out.tokens.shape[0], out.num_generations, "RolloutBatch")
        return cls(
            prompt_tokens=out.prompt_tokens,
            prompt_mask=out.prompt_mask,
            tokens=out.tokens,
            mask=out.mask,
            loss_mask=out.loss_mask,
            behaviour_logprobs=out.logprobs,
            rewards=_rows_like(rewards, out.lengths),
            policy_version=out.policy_version,
            ref_logprobs=ref_logprobs,
            teacher_logprobs=teacher_logprobs,
            num_generations=out.num_generations,
            routes=getattr(out, "routes", None),
        )


def _rows_like(x, like: jax.Array) -> jax.Array:
    """Host [N, ...] -> float32 device array sharded over rows like `like`."""
    if isinstance(x, jax.ShapeDtypeStruct):  # abstract, for compiling only
        return x
    if isinstance(x, jax.Array):
        return x.astype(jnp.float32)
    x = np.asarray(x, np.float32)
    sharding = like.sharding
    if isinstance(sharding, NamedSharding):
        spec = (sharding.spec[0] if sharding.spec else None,) + (None,) * (x.ndim - 1)
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec))
    return jax.device_put(x, sharding)


def completion_hidden(
    model_cfg,
    params,
    prompt_tokens,
    prompt_mask,
    tokens,
    mask,
    dropout=None,
    routes=None,
    with_routes=False,
    layers=None,
):
    """Teacher-forced hidden states that predict each completion token.

    prompt_tokens, prompt_mask [N, P] (left-padded); tokens, mask [N, T] (right-padded) ->
    hidden [N, T, D]: row t is the final-normed state at sequence position P - 1 + t, i.e.
    after reading the prompt and tokens[:, :t]. dropout: a LoRA dropout key, or None.
    routes: replayed experts [N, P + T, L, k] (module doc). with_routes: also the MoE
    layers' own top-k of the completion tokens [N, T, L, k] (None for a dense model).
    layers: each layer's parameters already sliced (`models.forward`), or None.
    """
    ids = jnp.concatenate([prompt_tokens, tokens], axis=1)
    attention = jnp.concatenate([prompt_mask, mask], axis=1).astype(bool)
    kw = dict(dropout=dropout, routes=routes, with_routes=True, layers=layers)
    hidden, own = models.forward(model_cfg, params, ids, attention, **kw)
    p = prompt_tokens.shape[1]
    own = None if own is None else own[:, p:]
    return (hidden[:, p - 1 : -1], own) if with_routes else hidden[:, p - 1 : -1]


def sequence_logprobs(
    model_cfg,
    params,
    prompt_tokens,
    prompt_mask,
    tokens,
    mask,
    *,
    temperature=1.0,
    chunk_size=128,
    dropout=None,
    routes=None,
    with_routes=False,
    packing=None,
    layers=None,
):
    """Teacher-forced log pi(token) and entropy of each completion token.

    [N, P], [N, P], [N, T], [N, T] -> (logp [N, T], entropy [N, T]) float32, 0 off-mask.
    Chunked over T (never [N, T, V]); differentiable w.r.t. params. dropout: a LoRA
    dropout key (the update's gradient forward), or None. routes, with_routes (a third
    result, the own top-k [N, T, L, k]): as in `completion_hidden`. packing: a
    `rl.packing.PackPlan` of these rows that fits (`packed_sequence_logprobs`; dense
    models only, which route nothing), or None: padded rows. layers: each layer's
    parameters already sliced (`models.forward`), or None.
    """
    if packing is not None:
        out = packed_sequence_logprobs(
            model_cfg,
            params,
            prompt_tokens,
            prompt_mask,
            tokens,
            mask,
            packing,
            temperature=temperature,
            chunk_size=chunk_size,
            dropout=dropout,
            layers=layers,
        )
        return (*out, None) if with_routes else out
    hidden, own = completion_hidden(
        model_cfg, params, prompt_tokens, prompt_mask, tokens, mask, dropout, routes, True, layers
    )
    kw = dict(temperature=temperature, chunk_size=chunk_size)
    logp, ent = _completion_logprobs(model_cfg, params, hidden, tokens, mask, **kw)
    return (logp, ent, own) if with_routes else (logp, ent)


def packed_or_padded(fn, prompt_mask, mask, capacity: float):
    """fn(plan) with the rows' `rl.packing.PackPlan` when they fit in ceil(n * capacity)
    sequences, else fn(None) (padded): a `lax.cond` on the plan, both compiled, one
    run. Wrap the whole forward AND backward (the update's micro-batch gradient), not a
    differentiated function: under autodiff a cond's two branches would each carry the
    other's residuals. capacity 0, or no fewer sequences than rows: fn(None) alone."""
    n = mask.shape[0]
    if not capacity or packed_seqs(n, capacity) >= n:
        return fn(None)
    plan = plan_packing(prompt_mask, mask, packed_seqs(n, capacity))
    return jax.lax.cond(plan.fits, lambda: fn(plan), lambda: fn(None))


def _completion_logprobs(model_cfg, params, hidden, tokens, mask, temperature, chunk_size):
    """hidden [N, T, D] (`completion_hidden`) -> (logp, entropy) [N, T], 0 off-mask."""
    w = models.unembed_matrix(model_cfg, params)
    cap = model_cfg.final_logit_softcapping
    logp, ent = token_logprobs(
        hidden, w, tokens, temperature=temperature, chunk_size=chunk_size, softcap=cap
    )
    valid = mask.astype(bool)
    return jnp.where(valid, logp, 0.0), jnp.where(valid, ent, 0.0)


def packed_sequence_logprobs(
    model_cfg,
    params,
    prompt_tokens,
    prompt_mask,
    tokens,
    mask,
    plan,
    *,
    temperature=1.0,
    chunk_size=128,
    dropout=None,
    layers=None,
):
    """`sequence_logprobs` with the rows packed as `plan` (`rl.packing.plan_packing`, which
    must fit) says: the layers run over the packed sequences only. The log-probs are
    taken where there are fewer positions: over the packed [S, P + T] (the target of a
    position is the next packed token, the same as in its row) or over the rows' [N, T]
    completion steps (hidden states gathered back); either way they return to the
    [N, T] row layout, so what follows (advantages, loss, aggregation) is the padded
    path's. With LoRA dropout the packed forward draws its masks over the packed layout
    (other masks, the same law)."""
    n, p = prompt_tokens.shape
    t = tokens.shape[1]
    kw = dict(
        temperature=temperature,
        chunk_size=chunk_size,
        softcap=model_cfg.final_logit_softcapping,
    )
    ids = jnp.concatenate([prompt_tokens, tokens], axis=1)
    attend = jnp.concatenate([prompt_mask, mask], axis=1).astype(bool)
    ids, attend, positions, segments = pack(plan, ids, attend)
    kw_model = dict(dropout=dropout, layers=layers)
    hidden = models.forward(model_cfg, params, ids, attend, positions, segments, **kw_model)
    w = models.unembed_matrix(model_cfg, params)
    if plan.num_seqs * (p + t) < n * t:
        targets = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)
        out = token_logprobs(hidden, w, targets, **kw)
        logp, ent = (unpack_completion(plan, x, p, t) for x in out)
    else:
        logp, ent = token_logprobs(unpack_completion(plan, hidden, p, t), w, tokens, **kw)
    valid = mask.astype(bool)
    return jnp.where(valid, logp, 0.0), jnp.where(valid, ent, 0.0)


def context_mesh(mesh_or_sharding):
    """The context of a trace on this mesh (a Mesh, a NamedSharding or None): its
    abstract mesh is set when its `context` axis is > 1, so that the model's forward
    splits the sequence over it (`models.partitioning.shard_sequence`), or its `expert`
    axis is > 1, so that an MoE layer's grouped-matmul kernel runs per device on its own
    experts (`models.moe_kernels`: `auto` takes it on TPU), or its `fsdp` axis is > 1, so
    that the embedded tokens are split by rows (`models.partitioning.shard_sequence`),
    or the program is compiled for TPU chips (the Pallas kernels run per device);
    otherwise nothing."""
    mesh = getattr(mesh_or_sharding, "mesh", mesh_or_sharding)
    if not isinstance(mesh, jax.sharding.Mesh):
        return contextlib.nullcontext()
    # On TPU the Pallas kernels (splash attention, grouped matmul) run per device in
    # `shard_map`, over the mesh set here: XLA does not partition a Mosaic kernel.
    kernels = target.backend() == "tpu" and mesh.size > 1
    if not kernels and all(mesh.shape.get(a, 1) == 1 for a in ("context", "expert", "fsdp")):
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def make_logprob_fn(
    model_cfg,
    spec,
    chunk_size: int = 128,
    micro_batches: int = 1,
    mesh=None,
    packing="off",
    packing_capacity: float = DEFAULT_CAPACITY,
    replay: bool = False,
):
    """Jitted (params, rows) -> logp [N, T] (no gradient), rows a `sampling.SampleOutput`
    or `RolloutBatch` (prompt_tokens, prompt_mask, tokens, mask).

    For the reference model and old-policy recomputes, at the spec's temperature; the G =
    spec.num_generations rows of a group share their prompt, which is read once
    (`shared_prompt_logprobs`). micro_batches bounds the memory of the forward (N must be
    a multiple of it). mesh: the log-probs come out sharded by rows over its ('data',
    'fsdp'), pinned, so the update that reads them can be compiled before they exist.
    packing: 'auto' | 'on' | 'off' (`rl.packing.resolve_packing`): rows that each read
    their own prompt (G == 1) run packed into packing_capacity of the padded sequences.
    replay: route with the rows' recorded `routes` (routing replay) where they have them.
    """
    shards = 1 if mesh is None else batch_size_multiple(mesh)
    # an MoE model's routes are laid out by row; a hybrid model's recurrent state does
    # not reset between packed sequences: both run padded
    capacity = resolve_packing(packing, packing_capacity, shards, model_cfg.moe or model_cfg.hybrid)
    kw = dict(
        num_generations=spec.num_generations,
        micro_batches=micro_batches,
        temperature=spec.logprob_temperature,
        chunk_size=chunk_size,
        packing=capacity,
    )

    def logprobs(params, rows):
        inputs = (rows.prompt_tokens, rows.prompt_mask, rows.tokens, rows.mask)
        routes = getattr(rows, "routes", None) if replay else None
        with context_mesh(mesh):
            return batch_logprobs(model_cfg, params, *inputs, **kw, routes=routes)

    if mesh is None:
        return jax.jit(logprobs)
    rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    return jax.jit(logprobs, out_shardings=rows)


def batch_logprobs(
    model_cfg,
    params,
    prompt_tokens,
    prompt_mask,
    tokens,
    mask,
    *,
    num_generations,
    micro_batches,
    temperature,
    chunk_size,
    packing=0.0,
    routes=None,
):
    """`make_logprob_fn`'s function, unjitted (the update's old-policy recompute):
    log-probs [N, T] one row slice at a time, each prompt read once when G > 1, else
    each slice packed (`sequence_logprobs`' packing: a capacity, 0 = padded).
    routes: replayed experts [N, P + T, L, k], or None."""
    rows = (prompt_tokens, prompt_mask, tokens, mask)
    kw = dict(temperature=temperature, chunk_size=chunk_size)
    # a hybrid model's prompt is a recurrent state, not keys/values: every row reads its own
    if num_generations > 1 and tokens.shape[1] > 1 and not model_cfg.hybrid:
        logp = shared_prompt_logprobs(
            model_cfg,
            params,
            *rows,
            num_generations=num_generations,
            micro_batches=micro_batches,
            routes=routes,
            **kw,
        )
    else:

        def one(r):
            *r, replayed = r
            run = lambda plan: sequence_logprobs(  # noqa: E731
                model_cfg, params, *r, **kw, routes=replayed, packing=plan
            )
            return packed_or_padded(run, r[1], r[3], packing)[0]

        logp = map_rows(one, (*rows, routes), micro_batches)
    return jax.lax.stop_gradient(logp)
