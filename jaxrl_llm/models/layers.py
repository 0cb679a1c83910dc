"""The decoder model in Flax NNX: embedding, the loop over its layers, final norm and
output projection (`Transformer`). One layer's parameters and math are `block.Block`;
the pure functions they are built from are in `layer_math`.

Gemma 3's layers differ by kind (sliding-window or global attention, each with its own
RoPE base). The kind is data, not code: `layer_math.layer_kinds(cfg)` gives per-layer
arrays that the layer scan reads like the stacked parameters, so one traced layer serves
both kinds. An MoE model's layers may differ in their MLP (experts or dense,
`cfg.dense_layers`): that is code, so each run of consecutive alike layers is one scan
over its kind's parameters (`ModelConfig.layer_segments`); a model whose layers are all
alike is one scan.

The modules only declare parameters (with logical axis names) and the math of one layer;
`transformer.py` holds the functional API that merges a plain params dict into them.
Layer parameters are stacked on a leading `layers` axis and run by one `jax.lax.scan`, so
compile time does not grow with depth; `cfg.remat` selects the activation checkpointing
policy of the scanned layer. `cfg.scan_layers=False` unrolls that scan in the
teacher-forced forward (the backward then reads each layer's residuals where they were
computed instead of from [L, ...] stacks the scan zero-fills and copies into), and with a
KV cache runs prefill and decode over one cache array per layer (`kv_cache.init_cache`).

What the layers attend to is an object per kind (`caches`): the loop is written once and
asks the cache how it runs (a scan carrying it, or a Python loop over each layer's own
parameter slices), and each layer calls the cache's `attend` with no branch on its kind.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_llm.models._nnx import nnx
from jaxrl_llm.models.block import Block, const_param, normal_param
from jaxrl_llm.models.caches import NoCache
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layer_math import dense, layer_kinds, norm
from jaxrl_llm.models.partitioning import shard_sequence
from jaxrl_llm.models.segments import layer_rows, layer_slice, segment_params
from jaxrl_llm.parallel import target


class Transformer(nnx.Module):
    """Embedding, scanned layers, final norm and (untied) output projection."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        V, D = cfg.vocab_size, cfg.hidden_size
        self.embed = normal_param(rngs, (V, D), ("vocab", "embed"), cfg.initializer_range, dtype)
        self.layers = Block(cfg, rngs, dtype)
        centered = cfg.centered_norm  # RMSNorm scales by 1 + weight
        self.final_norm = const_param(0.0 if centered else 1.0, (D,), ("norm",), dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = normal_param(
                rngs, (D, V), ("embed", "vocab"), cfg.initializer_range, dtype
            )
        if cfg.per_layer_input_size:  # Gemma 4's per-layer input embeddings
            LP, std = cfg.num_layers * cfg.per_layer_input_size, cfg.initializer_range
            shape = (cfg.per_layer_vocab_size, LP)
            self.per_layer_embed = normal_param(rngs, shape, ("vocab", None), std, dtype)
            self.per_layer_proj = normal_param(rngs, (D, LP), ("embed", None), std, dtype)
            self.per_layer_norm = const_param(1.0, (cfg.per_layer_input_size,), ("norm",), dtype)
        self.cfg = cfg

    def __call__(
        self,
        tokens,
        positions,
        mask,
        cache=None,
        layers=None,
        dropout=None,
        routes=None,
        recompute=False,
    ):
        """tokens [B,T] -> (final-normed hidden states [B,T,D], the cache as the layers left
        it, the MoE layers' own top-k experts [L,B,T,k] int32 or None for a dense model).

        cache: what the layers attend to (`caches`; None: the sequence itself), which also
        says how the loop runs (`loop`). layers: each layer's parameters already sliced
        out of the stacked ones (`layer_params`), e.g. once before a decode loop instead
        of per step (an unrolled loop reads them). dropout: a key for LoRA dropout (layer
        i folds in i), or None. routes: [L,B,T,k] experts to replay in the MoE layers
        (None: the router's own). recompute: in the Python loop over `layers`, each layer's
        backward recomputes its forward (`recompute_in_backward`) instead of keeping its
        activations from the forward.
        """
        cfg = self.cfg
        cache = NoCache() if cache is None else cache
        # Split by rows (and positions), not in the embedding table's layout.
        x = shard_sequence(self.embed_tokens(tokens))
        graphdef, stacked = nnx.split(self.layers)
        stacked = nnx.to_pure_dict(stacked)
        loop = cache.loop(cfg, layers)
        if loop == "unrolled" and layers is None:
            layers = {n: [a[j] for j in range(a.shape[0])] for n, a in stacked.items()}

        def layer(carry, xs, segment, shared=None):
            (x, c), (params, i, row, kind, route, extra, rows) = carry, xs
            key = None if dropout is None else jax.random.fold_in(dropout, i)
            block = nnx.merge(graphdef, params)
            c = c.replace(rows=rows, shared=shared)
            args = (x, positions, mask, c, row, key, kind)
            x, c, chosen = block(*args, routes=route, per_layer=extra, segment=segment)
            store = segment.share and segment.share[0] == "store"
            stored = c.shared if store else None
            return (x, c.replace(rows=None, shared=None)), (chosen, c.rows, stored)

        carry, ys = (x, cache.replace(rows=None, shared=None)), []
        # [L, ...] each, or None
        per_layer = (layer_kinds(cfg), routes, self.per_layer_inputs(tokens, x))
        stored = {}  # KV sharing: a layer type's storing layer's keep, for its reusers
        for segment in cfg.layer_segments():
            share = segment.share
            body = functools.partial(layer, segment=segment)
            start, stop, row = segment.start, segment.stop, self._first_row(segment)
            n, reuse = stop - start, share is not None and share[0] == "reuse"
            shared = stored.get(share[1]) if reuse else None
            # each layer's cache row: a KV-shared layer's is its storing layer's
            rows_of = [self._row_of(cfg.kv_source(start))] * n if reuse else range(row, row + n)
            rows = self._kind_rows(cache.rows, segment)  # [n, ...] in the run's cache rows
            if segment.wide:  # the cache's full-layer storage in front (`swap`)
                carry = (carry[0], carry[1].swap())
            if loop == "unrolled":  # Python: each layer's own slices (decode, unrolled update)
                outs = []
                for i in range(start, stop):
                    at = jax.tree.map(lambda a, i=i: a[i], per_layer)
                    at = (*at, jax.tree.map(lambda a, j=i - start: a[j], rows), shared)
                    step = functools.partial(_one_layer, body, i, rows_of[i - start])
                    if recompute:  # the backward slices layer i out of `stacked` again
                        reslice = functools.partial(_reslice, cfg, i)
                        step = recompute_in_backward(step, (stacked, reslice))
                    carry, out = step(carry, layer_slice(cfg, layers, i), at)
                    outs.append(out)
                out = jax.tree.map(lambda *a: jnp.stack(a), *outs)
            else:
                own = (segment_params(cfg, stacked, segment), jnp.arange(start, stop))
                xs = (*own, jnp.asarray(rows_of, jnp.int32))
                xs = (*xs, *layer_rows(per_layer, start, stop), rows)
                unroll = n if loop == "scan_unrolled" else 1
                body = functools.partial(body, shared=shared)
                carry, out = jax.lax.scan(_remat(body, cfg.remat), carry, xs, unroll=unroll)
            if share is not None and share[0] == "store":  # a run of one layer
                stored[share[1]] = jax.tree.map(lambda a: a[0], out[2])
            ys.append(out[:2])
            if segment.wide:
                carry = (carry[0], carry[1].swap())
        (x, cache), (chosen, rows) = carry, tuple(zip(*ys, strict=True))
        cache = cache.replace(rows=self._join_rows(rows))
        return norm(cfg, x, self.final_norm[...]), cache, self._join_routes(list(chosen), x)

    def _kind_rows(self, rows, segment):
        """A run's rows of the cache's per-layer values ([L, ...] leaves; with
        `split_attention` a pair (sliding layers' [Ls, ...], full layers' [Lg, ...]),
        the run's from its kind's): rows first_row .. first_row + its length."""
        if rows is None:
            return None
        n, first = segment.stop - segment.start, self._first_row(segment)
        if self.cfg.split_attention:
            rows = rows[segment.wide]
        return layer_rows(rows, first, first + n)

    def _join_rows(self, rows: tuple):
        """The runs' per-layer values -> [L, ...] (None stays None); with
        `split_attention` the pair (sliding layers', full layers'), each in layer order."""
        if not self.cfg.split_attention or rows[0] is None:
            return _join(rows)
        runs = self.cfg.layer_segments()
        return tuple(
            _join([r for r, s in zip(rows, runs, strict=True) if s.wide == w])
            for w in (False, True)
        )

    def _first_row(self, segment) -> int:
        """The cache row of a run's first layer: its index, or in a hybrid model or a
        `split_attention` one (whose cache holds each attention kind's layers apart) its
        index among its kind's."""
        split = self.cfg.hybrid or self.cfg.split_attention
        return segment.first_attn if split else segment.start

    def _row_of(self, i: int) -> int:
        """Layer i's cache row (`_first_row`)."""
        cfg = self.cfg
        if not (cfg.hybrid or cfg.split_attention):
            return i
        return cfg.attention_kinds[:i].count(cfg.attention_kinds[i])

    def _no_routes(self, x, n: int | None = None) -> jax.Array:
        """The routes of dense-MLP layers in an MoE model: -1 [B,T,k] (or [n,B,T,k])."""
        shape = x.shape[:2] + (self.cfg.num_experts_per_tok,)
        return jnp.full(shape if n is None else (n, *shape), -1, jnp.int32)

    def _join_routes(self, chosen: list, x):
        """The segments' own top-k [n,B,T,k] (None for a dense run) -> [L,B,T,k], -1 in
        the dense layers; None for a dense model."""
        if not self.cfg.moe:
            return None
        if len(chosen) == 1:
            return chosen[0]
        runs = self.cfg.layer_segments()
        return jnp.concatenate(
            [
                self._no_routes(x, r[1] - r[0]) if c is None else c
                for c, r in zip(chosen, runs, strict=True)
            ]
        )

    def per_layer_inputs(self, tokens, x) -> jax.Array | None:
        """Gemma 4's per-layer inputs [L,B,T,P] (None without them), transformers'
        `get_per_layer_inputs` and `project_per_layer_inputs`: the token's own
        per-layer embedding times sqrt(P) (rounded to its dtype), plus the RMS-normed
        projection of its input embedding x [B,T,D] times D^-1/2, the sum times 2^-1/2."""
        cfg = self.cfg
        P = cfg.per_layer_input_size
        if not P:
            return None
        B, T, L = *tokens.shape, cfg.num_layers
        table = self.per_layer_embed[...]
        own = jnp.take(table, tokens, axis=0) * jnp.asarray(P**0.5, table.dtype)
        mixed = dense(x, self.per_layer_proj[...]) * jnp.asarray(cfg.hidden_size**-0.5, x.dtype)
        mixed = norm(cfg, mixed.reshape(B, T, L, P), self.per_layer_norm[...])
        out = (mixed + own.reshape(B, T, L, P)) * jnp.asarray(2**-0.5, x.dtype)
        return jnp.moveaxis(out, 2, 0)

    def embed_tokens(self, tokens) -> jax.Array:
        """tokens [B,T] -> [B,T,D]; Gemma scales by sqrt(D), rounded to the embedding's
        dtype first (as HF does)."""
        x = jnp.take(self.embed[...], tokens, axis=0)
        if self.cfg.gemma:
            x = x * jnp.asarray(self.cfg.hidden_size**0.5, x.dtype)
        return x


def _join(rows: tuple):
    """The runs' stacked per-layer outputs -> one [L, ...] (None stays None)."""
    return rows[0] if len(rows) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *rows)


def _one_layer(body, i: int, row: int, carry, params, at):
    """Layer i of the Python loop (cache row `row`): `body` with its static indices; the
    last of `at` is what a KV-shared layer attends over (`caches`), or None."""
    return body(carry, (params, i, row, *at[:-1]), shared=at[-1])


def recompute_in_backward(fn, source):
    """fn(carry, params, at), differentiated by recomputing its forward in the backward
    pass from its inputs, which are all it keeps. The recompute is made to wait for the
    cotangent of fn's outputs: the carry it starts from is tied to that cotangent by data
    (`_after`), so XLA can neither schedule the recompute beside the first forward nor
    merge the two (an optimization barrier does not hold on XLA:CPU, which removes them,
    and `jax.checkpoint` leaves both free: in a Python loop of layers XLA then holds
    every layer's activations at once). Used for the shared prompts' forward of the
    update, whose backward follows all the micro-batches (`rl.gradients`).

    source: (stacked, reslice) where params were sliced from: the backward takes them
    again, reslice(stacked, offset) at an int offset tied to the cotangent, and keeps
    `stacked` (the caller's own arrays) instead of params. A slice is a copy: kept from
    the forward to the backward, every layer's would be resident at once."""
    stacked, reslice = source

    def with_source(carry, params, at, stacked):
        del stacked  # read by the backward only
        return fn(carry, params, at)

    def fwd(carry, params, at, stacked):
        return fn(carry, params, at), (carry, at, stacked)

    def bwd(res, g):
        carry, at, stacked = res
        params = reslice(stacked, _zero_after(g).astype(jnp.int32))
        return (*jax.vjp(fn, _after(carry, g), params, at)[1](g), None)

    f = jax.custom_vjp(with_source)
    f.defvjp(fwd, bwd)
    return lambda carry, params, at: f(carry, params, at, stacked)


def _reslice(cfg, i: int, stacked: dict, offset) -> dict:
    """Layer i's parameters out of the stacked ones, each index plus `offset` (a traced
    zero: the slices are taken where the offset is computed)."""
    rows = {n: _Rows(a, offset) for n, a in stacked.items()}
    return layer_slice(cfg, rows, i)


class _Rows:
    """rows[j] of a stacked array, at index j + offset."""

    def __init__(self, stacked, offset):
        self.stacked, self.offset = stacked, offset

    def __getitem__(self, j: int):
        return jax.lax.dynamic_index_in_dim(self.stacked, j + self.offset, keepdims=False)


def _after(tree, g):
    """tree's floating-point leaves plus a zero computed from g: equal values, but a data
    dependence on g that compilers keep (x * 0 is not folded for floats: it is NaN for
    an infinite x, which then also marks the cotangent as non-finite)."""
    zero = _zero_after(g)
    tie = lambda x: x + zero.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x  # noqa: E731
    return jax.tree.map(tie, tree)


def _zero_after(g):
    """A float32 zero computed from one element of g's first floating-point leaf."""
    first = next(x for x in jax.tree.leaves(g) if jnp.issubdtype(x.dtype, jnp.inexact))
    return first.reshape(-1)[0].astype(jnp.float32) * 0.0


def _remat(fn, policy: str):
    """The layer scan's body under `jax.checkpoint`. JAX's advice for a scan body is
    prevent_cse=False: the loop keeps XLA from merging the backward's recompute with the
    forward. XLA:TPU unrolls the layer loop, and there the merge happens: the update
    then holds every layer's saved values at once (each MoE layer's gathered (token,
    expert) rows in buffers of its own, docs/tpu.md). So for TPU chips the recompute is
    kept apart (prevent_cse=True)."""
    if policy == "none":
        return fn
    policies = {
        "full": None,
        "dots": jax.checkpoint_policies.checkpoint_dots,
        "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    }
    tpu = target.backend() == "tpu"
    return jax.checkpoint(fn, policy=policies[policy], prevent_cse=tpu)
