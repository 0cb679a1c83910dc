"""SFT examples: a dataset row -> prompt ids + completion ids -> right-padded batches.

    batches = sft_batches(config, tokenizer)   # endless SFTBatch [sft.batch_size, T]

The prompt is built by the `data` pipeline exactly as the RL trainer builds it (template,
tokenizer, BOS), so a model fine-tuned here sees the same prompts when RL starts. The
completion is `sft.completion.template` over the row's fields (arithmetic: `"{answer}"`),
tokenized without special tokens, then EOS: the stop token the sampler uses.

`sft.completion.alt_template` gives a second completion style to a fixed share
(`sft.completion.alt_prob`) of the rows, fixed per row by `data.seed` and the row index
(so every epoch shows a row the same way, like a dataset that contains both styles).
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np
from flax import struct

from jaxrl_llm import data


@struct.dataclass
class SFTBatch:
    """Right-padded prompt + completion sequences."""

    tokens: jax.Array  # [B, T] int32
    mask: jax.Array  # [B, T] bool: real (prompt or completion) tokens
    loss_mask: jax.Array  # [B, T] bool: completion tokens (EOS included), the ones scored


def unpadded(batch: data.Batch) -> list[list[int]]:
    """The prompts of a left-padded `data.Batch` as token-id lists."""
    pairs = zip(batch.prompt_ids, batch.prompt_mask, strict=True)
    return [ids[mask].tolist() for ids, mask in pairs]


def completion_template(completion, seed: int, row: int) -> str:
    """The row's completion template: `alt_template` for a fixed `alt_prob` share of rows."""
    if completion.alt_prob and np.random.default_rng([seed, row]).random() < completion.alt_prob:
        return completion.alt_template
    return completion.template


def completion_ids(tokenizer, template: str, example: dict, max_len: int, where: str):
    """`template` over the row, tokenized without special tokens, then EOS."""
    ids = tokenizer(template.format_map(example), add_special_tokens=False)["input_ids"]
    ids = list(ids) + [tokenizer.eos_token_id]
    if len(ids) > max_len:
        raise data.BadRow(f"{where}: completion is {len(ids)} tokens > sft.completion.max_len")
    return ids


def make_sft_batch(prompts, completions, length: int, pad_id: int) -> SFTBatch:
    """Token-id lists -> numpy SFTBatch [B, length]: prompt then completion, then padding."""
    B = len(prompts)
    tokens = np.full((B, length), pad_id, np.int32)
    mask, loss_mask = np.zeros((B, length), bool), np.zeros((B, length), bool)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        n = len(p) + len(c)
        if n > length:
            raise ValueError(f"row {i}: prompt + completion is {n} tokens > {length}")
        tokens[i, :n] = list(p) + list(c)
        mask[i, :n] = True
        loss_mask[i, len(p) : n] = True
    return SFTBatch(tokens=tokens, mask=mask, loss_mask=loss_mask)


def sft_batches(config, tokenizer) -> Iterator[SFTBatch]:
    """Endless training batches of this process's rows, from `config.data`, of length
    `data.max_prompt_len + sft.completion.max_len` (one shape: the step compiles once)."""
    it = data.make_iterator(
        config.data,
        tokenizer,
        config.sft.batch_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    completion = config.sft.completion
    length = config.data.max_prompt_len + completion.max_len
    for batch in it:
        completions = []
        for example, row in zip(batch.examples, batch.rows, strict=True):
            template = completion_template(completion, config.data.seed, row)
            where = it.source.describe(row)
            completions.append(
                completion_ids(tokenizer, template, example, completion.max_len, where)
            )
        yield make_sft_batch(unpadded(batch), completions, length, data.pad_id(tokenizer))
