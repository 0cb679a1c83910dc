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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_llm.models._nnx import nnx
from jaxrl_llm.models.block import Block, const_param, normal_param
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layer_math import layer_kinds, norm
from jaxrl_llm.models.partitioning import shard_sequence
from jaxrl_llm.models.segments import layer_rows, layer_slice, segment_params


class Transformer(nnx.Module):
    """Embedding, scanned layers, final norm and (untied) output projection."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        V, D = cfg.vocab_size, cfg.hidden_size
        self.embed = normal_param(rngs, (V, D), ("vocab", "embed"), cfg.initializer_range, dtype)
        self.layers = Block(cfg, rngs, dtype)
        centered = cfg.gemma or cfg.zero_centered_norm  # RMSNorm scales by 1 + weight
        self.final_norm = const_param(0.0 if centered else 1.0, (D,), ("norm",), dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = normal_param(
                rngs, (D, V), ("embed", "vocab"), cfg.initializer_range, dtype
            )
        self.cfg = cfg

    def __call__(
        self, tokens, positions, mask, cache=None, index=None, layers=None, dropout=None,
        routes=None, paged=None,
    ):  # fmt: skip
        """tokens [B,T] -> (final-normed hidden states [B,T,D], the new cache k, v, the MoE
        layers' own top-k experts [L,B,T,k] int32 or None for a dense model).

        layers: with a per-layer cache, each layer's parameters already sliced out of the
        stacked ones (`layer_params`), e.g. once before a decode loop instead of per step.
        dropout: a key for LoRA dropout (layer i folds in i), or None.
        routes: [L,B,T,k] experts to replay in the MoE layers (None: the router's own).
        paged: a `paged_attention.PagedWrite`: cache is then the page pool (k, v)
        [L, P, page_size, K, H], each layer writing and reading its own pages (`Block`).
        """
        cfg = self.cfg
        x = shard_sequence(self.embed_tokens(tokens))  # context parallelism
        graphdef, stacked = nnx.split(self.layers)
        stacked = nnx.to_pure_dict(stacked)
        kinds = layer_kinds(cfg)

        def layer(carry, xs, sparse, linear):
            x, kv = carry
            layer_state, i, row, kind, route = xs
            key = None if dropout is None else jax.random.fold_in(dropout, i)
            block = nnx.merge(graphdef, layer_state)
            x, kv, chosen = block(
                x, positions, mask, kv, index, row, dropout=key, kind=kind, routes=route,
                sparse=sparse, paged=paged, linear=linear,
            )  # fmt: skip
            return (x, kv), chosen

        if paged is not None and layers is not None:  # the pool, layers unrolled
            chosen = []
            for i in range(cfg.num_layers):
                kind = jax.tree.map(lambda a, i=i: a[i], kinds)
                block = nnx.merge(graphdef, layer_slice(cfg, layers, i))
                route = None if routes is None else routes[i]
                x, cache, own = block(
                    x, positions, mask, cache, layer=i, kind=kind, routes=route,
                    sparse=cfg.sparse_layers[i], paged=paged,
                )  # fmt: skip
                chosen.append(own if own is not None else self._no_routes(x))
            chosen = jnp.stack(chosen) if cfg.moe else None
            return norm(cfg, x, self.final_norm[...]), cache, chosen
        if cache is not None and isinstance(cache[0], tuple):  # one cache array per layer
            kv, chosen = [], []
            per_index = layers or {n: [a[j] for j in range(a.shape[0])] for n, a in stacked.items()}
            for i in range(cfg.num_layers):
                kind = jax.tree.map(lambda a, i=i: a[i], kinds)
                block = nnx.merge(graphdef, layer_slice(cfg, per_index, i))
                cache_i = (cache[0][i], cache[1][i])
                route = None if routes is None else routes[i]
                x, layer_kv, own = block(
                    x, positions, mask, cache_i, index, kind=kind, routes=route,
                    sparse=cfg.sparse_layers[i],
                )  # fmt: skip
                kv.append(layer_kv)
                chosen.append(own if own is not None else self._no_routes(x))
            kv = tuple(tuple(c) for c in zip(*kv, strict=True))
            chosen = jnp.stack(chosen) if cfg.moe else None
            return norm(cfg, x, self.final_norm[...]), kv, chosen
        carry, chosen = (x, cache), []
        for segment in cfg.layer_segments():
            start, stop = segment.start, segment.stop
            body = functools.partial(layer, sparse=segment.sparse, linear=segment.linear)
            body = _remat(body, cfg.remat)
            unroll = stop - start if cache is None and not cfg.scan_layers else 1
            # a hybrid model's cache holds each attention kind's layers apart: its rows
            row = segment.first_attn if cfg.hybrid else start
            xs = (
                segment_params(cfg, stacked, segment),
                jnp.arange(start, stop),
                jnp.arange(row, row + stop - start),
                layer_rows(kinds, start, stop),
                layer_rows(routes, start, stop),
            )
            carry, own = jax.lax.scan(body, carry, xs, unroll=unroll)
            chosen.append(own)
        x, kv = carry
        return norm(cfg, x, self.final_norm[...]), kv, self._join_routes(chosen, x)

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

    def embed_tokens(self, tokens) -> jax.Array:
        """tokens [B,T] -> [B,T,D]; Gemma scales by sqrt(D), rounded to the embedding's
        dtype first (as HF does)."""
        x = jnp.take(self.embed[...], tokens, axis=0)
        if self.cfg.gemma:
            x = x * jnp.asarray(self.cfg.hidden_size**0.5, x.dtype)
        return x

    def with_prefix(self, tokens, positions, mask, prefix, dropout=None, routes=None,
                    layers=None):  # fmt: skip
        """tokens [B,T] after a prefix of P tokens whose per-layer keys/values are given ->
        (final-normed hidden [B,T,D], this sequence's keys/values ([L,B,T,K,H] each), the
        MoE layers' own top-k [L,B,T,k] or None).

        prefix: (k, v) [L,B,P,K,H] each (P may be 0), as this method returned them for the
        earlier tokens; mask [B,T,P+T]. Scanned (or unrolled) like the full forward, with
        its remat policy and its attention backward, so it trains as fast. dropout, routes:
        as in `__call__`. layers: each layer's parameters already sliced out of the stacked
        ones (`layer_params`; inference only): the layers run unrolled over them, so a loop
        of calls (a decode loop) does not slice the weights again in every call.
        """
        cfg = self.cfg
        x = shard_sequence(self.embed_tokens(tokens))  # context parallelism
        graphdef, stacked = nnx.split(self.layers)
        stacked = nnx.to_pure_dict(stacked)
        kinds = layer_kinds(cfg)
        if layers is not None:  # inference: unrolled over the caller's per-layer slices
            kv, chosen = [], []
            for i in range(cfg.num_layers):
                kind = jax.tree.map(lambda a, i=i: a[i], kinds)
                route = None if routes is None else routes[i]
                block = nnx.merge(graphdef, layer_slice(cfg, layers, i))
                x, own_kv, own = block(
                    x, positions, mask, prefix=(prefix[0][i], prefix[1][i]), kind=kind,
                    routes=route, sparse=cfg.sparse_layers[i],
                )  # fmt: skip
                kv.append(own_kv)
                chosen.append(own if own is not None else self._no_routes(x))
            kv = tuple(jnp.stack(c) for c in zip(*kv, strict=True))
            chosen = jnp.stack(chosen) if cfg.moe else None
            return norm(cfg, x, self.final_norm[...]), kv, chosen

        def layer(x, xs, sparse):
            layer_state, pk, pv, i, kind, route = xs
            key = None if dropout is None else jax.random.fold_in(dropout, i)
            block = nnx.merge(graphdef, layer_state)
            x, kv, chosen = block(
                x, positions, mask, prefix=(pk, pv), dropout=key, kind=kind, routes=route,
                sparse=sparse,
            )  # fmt: skip
            return x, (kv, chosen)

        kvs, chosen = [], []
        for segment in cfg.layer_segments():
            start, stop, sparse = segment.start, segment.stop, segment.sparse
            body = _remat(functools.partial(layer, sparse=sparse), cfg.remat)
            unroll = 1 if cfg.scan_layers else stop - start
            xs = (
                segment_params(cfg, stacked, segment),
                *(layer_rows(p, start, stop) for p in prefix),
                jnp.arange(start, stop),
                layer_rows(kinds, start, stop),
                layer_rows(routes, start, stop),
            )
            x, (kv, own) = jax.lax.scan(body, x, xs, unroll=unroll)
            kvs.append(kv)
            chosen.append(own)
        kv = kvs[0] if len(kvs) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *kvs)
        return norm(cfg, x, self.final_norm[...]), kv, self._join_routes(chosen, x)


def _remat(fn, policy: str):
    if policy == "none":
        return fn
    policies = {
        "full": None,
        "dots": jax.checkpoint_policies.checkpoint_dots,
        "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    }
    return jax.checkpoint(fn, policy=policies[policy], prevent_cse=False)
