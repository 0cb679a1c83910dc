"""Prompts for RL: TFDS / JSONL sources, synthetic task builders, a resumable iterator.

    from jaxrl_llm import data
    cfg = data.default_config()
    cfg.name = "arithmetic/digits_3"          # generated locally on first use
    it = data.make_iterator(cfg, tokenizer, batch_size=32)
    batch = next(it)                          # prompt_ids [b, T], prompt_mask, examples
    position = it.state()                     # {"epoch", "index", "seed", ...}: JSON-able
    it.restore(position)
    data.check_rows(cfg, tokenizer)           # before compiling: BadRow naming file and line

TensorFlow-datasets is imported only when a TFDS source is opened.
"""

from jaxrl_llm.data.config import (
    DEFAULT_FIELDS,
    check_config,
    default_config,
    make_iterator,
    make_source,
)
from jaxrl_llm.data.iterator import Batch, PromptIterator
from jaxrl_llm.data.prompts import DEFAULT_TEMPLATES, PromptBuilder, collate, pad_id
from jaxrl_llm.data.sources import BadRow, JsonlSource, RowFormat, TfdsSource, plain
from jaxrl_llm.data.validate import RowCheck, check_rows

__all__ = [
    "DEFAULT_FIELDS",
    "DEFAULT_TEMPLATES",
    "BadRow",
    "Batch",
    "JsonlSource",
    "PromptBuilder",
    "PromptIterator",
    "RowCheck",
    "RowFormat",
    "TfdsSource",
    "check_config",
    "check_rows",
    "collate",
    "default_config",
    "make_iterator",
    "make_source",
    "pad_id",
    "plain",
]
