"""Row slices and shared prompts: the update's and the reference's ways through a batch.

    logp = shared_prompt_logprobs(model_cfg, params, prompt_tokens, prompt_mask, tokens,
                                  mask, num_generations=G)   # each group's prompt run once
    prefix = prompt_prefix(model_cfg, params, prompt_tokens, prompt_mask, G)
    logp, entropy = prefix_logprobs(model_cfg, params, prefix, prompt_mask, tokens, mask, groups)

Row slices: `split_rows(tree, k)` cuts N rows into k slices BY STRIDE (slice j holds rows
j, j + k, ...), so that when rows are sharded over ('data', 'fsdp') every slice keeps an
even share of each device's rows; `map_rows` runs a function over the slices in
sequence, bounding the memory of a no-gradient forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm import models
from jaxrl_llm.rl.logprobs import token_logprobs


def split_rows(tree, k: int):
    """[N, ...] -> [k, N / k, ...]; slice j holds rows j, j + k, j + 2k, ..."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), tree)


def merge_rows(tree):
    """Inverse of `split_rows`."""
    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), tree)


def map_rows(fn, rows, k: int):
    """fn over k row slices in sequence (bounded memory), results back in row order."""
    if k == 1:
        return fn(rows)
    return merge_rows(jax.lax.map(fn, split_rows(rows, k)))


def prompt_prefix(
    model_cfg,
    params,
    prompt_tokens,
    prompt_mask,
    num_generations: int,
    dropout=None,
    routes=None,
    layers=None,
    recompute: bool = False,
):
    """Each group's prompt run once: the first row of every G = `num_generations`
    consecutive rows -> (keys/values ([L, N / G, P, K, H] each), hidden state of the
    prompt's last position [N / G, D], which predicts the first completion token).
    Differentiable w.r.t. params; the input of `prefix_logprobs`. dropout: a LoRA
    dropout key (one mask per group's prompt), or None. routes [N, P + T, L, k]: replayed
    experts (module doc); the group's first row's prompt part is read. layers: each
    layer's parameters already sliced (`models.forward`), or None. recompute: with
    `layers`, the backward recomputes each layer's forward (`models.forward_after_prefix`)."""
    G, P = num_generations, prompt_tokens.shape[1]
    hidden, kv = models.forward_after_prefix(
        model_cfg,
        params,
        prompt_tokens[::G],
        prompt_mask[::G],
        dropout=dropout,
        routes=None if routes is None else routes[::G, :P],
        layers=layers,
        recompute=recompute,
    )
    return kv, hidden[:, -1]  # prompts are left-padded: the last column is a real token


def prefix_logprobs(
    model_cfg,
    params,
    prefix,
    prompt_mask,
    tokens,
    mask,
    groups,
    *,
    temperature=1.0,
    chunk_size=128,
    dropout=None,
    routes=None,
    with_routes=False,
    layers=None,
):
    """`sequence_logprobs` of rows whose prompts were run by `prompt_prefix`.

    prefix: `prompt_prefix`'s output; prompt_mask [N', P], tokens, mask [N', T] (T > 1)
    for N' rows of any groups, groups [N'] int: each row's index into the prefix. The
    completions read their group's keys/values; the last token, which predicts nothing,
    is not fed. -> (logp [N', T], entropy [N', T]) float32, 0 off-mask. Differentiable
    w.r.t. params and prefix (a prefix's cotangent sums over the rows of its group).
    dropout: a LoRA dropout key for the completions' forward, or None. routes
    [N', P + T, L, k], with_routes: as in `sequence_logprobs` (the last token, not fed,
    gets own routes -1). layers: as in `prompt_prefix`.
    """
    kv, last = prefix
    kv_rows = jax.tree.map(lambda x: jnp.take(x, groups, axis=1), kv)
    P, T = prompt_mask.shape[1], tokens.shape[1]
    h, _, own = models.forward_after_prefix(
        model_cfg,
        params,
        tokens[:, :-1],
        mask[:, :-1],
        kv_rows,
        prompt_mask,
        dropout,
        routes=None if routes is None else routes[:, P : P + T - 1],
        with_routes=True,
        layers=layers,
    )
    h = jnp.concatenate([jnp.take(last, groups, axis=0)[:, None].astype(h.dtype), h], axis=1)
    w = models.unembed_matrix(model_cfg, params)
    cap = model_cfg.final_logit_softcapping
    logp, ent = token_logprobs(
        h, w, tokens, temperature=temperature, chunk_size=chunk_size, softcap=cap
    )
    valid = mask.astype(bool)
    logp, ent = jnp.where(valid, logp, 0.0), jnp.where(valid, ent, 0.0)
    if not with_routes:
        return logp, ent
    if own is not None:
        own = jnp.pad(own, ((0, 0), (0, 1), (0, 0), (0, 0)), constant_values=-1)
    return logp, ent, own


def check_groups(n: int, num_generations: int, what: str) -> None:
    if num_generations < 1 or n % num_generations:
        raise ValueError(f"{what}: {n} rows are not groups of num_generations={num_generations}")


def shared_prompt_logprobs(
    model_cfg,
    params,
    prompt_tokens,
    prompt_mask,
    tokens,
    mask,
    *,
    num_generations: int,
    micro_batches: int = 1,
    temperature: float = 1.0,
    chunk_size: int = 128,
    routes=None,
):
    """`sequence_logprobs` (log-probs only) reading each prompt once.

    Rows come in groups of G = `num_generations` consecutive rows with the same prompt
    (the G samples of a GRPO group): the prompts run once (`prompt_prefix`, N / G rows),
    and each row slice (`map_rows`) runs its completions after its group's keys/values
    (`prefix_logprobs`). The layers then run over N / G prompts instead of N: with 8
    samples per prompt, 7/8 of the prompt's share of a forward is saved. The rows
    of a group must share prompt_tokens and prompt_mask; only the group's first row's
    prompt is read. Needs T > 1. routes: replayed experts [N, P + T, L, k], or None.
    """
    G = num_generations
    check_groups(prompt_tokens.shape[0], G, "shared_prompt_logprobs")
    prefix = prompt_prefix(model_cfg, params, prompt_tokens, prompt_mask, G, routes=routes)
    kw = dict(temperature=temperature, chunk_size=chunk_size)

    def one(rows):
        *rows, r = rows
        return prefix_logprobs(model_cfg, params, prefix, *rows, **kw, routes=r)[0]

    groups = jnp.arange(tokens.shape[0], dtype=jnp.int32) // G
    return map_rows(one, (prompt_mask, tokens, mask, groups, routes), micro_batches)
