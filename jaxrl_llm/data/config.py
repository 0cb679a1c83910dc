"""The `data` config section and the functions that turn it into a source and an iterator.

config.data = jaxrl_llm.data.default_config()
config.data.name = "countdown/numbers_4"          # or source="jsonl", path="my.jsonl"
it = jaxrl_llm.data.make_iterator(config.data, tokenizer, batch_size=64,
                                  process_index=jax.process_index(),
                                  process_count=jax.process_count())
"""

from __future__ import annotations

import ml_collections

from jaxrl_llm.data import reasoning_gym
from jaxrl_llm.data.iterator import PromptIterator
from jaxrl_llm.data.prompts import PromptBuilder, default_template, pad_id
from jaxrl_llm.data.sources import JsonlSource, RowFormat, TfdsSource

DEFAULT_FIELDS = {
    "gsm8k": {"question": "question", "answer": "answer"},
    "arithmetic": {"question": "question", "answer": "answer"},
    "countdown": {"question": "question", "numbers": "numbers", "target": "target"},
}
_TYPES = {
    "source": str,
    "name": str,
    "split": str,
    "data_dir": str,
    "download": bool,
    "path": str,
    "seed": int,
    "shuffle": bool,
    "skip_bad_rows": bool,
    "num_epochs": int,
    "max_prompt_len": int,
    "pad_multiple": int,
    "template": str,
    "system_prompt": str,
    "chat_template": str,
}


def default_config() -> ml_collections.ConfigDict:
    """Every data knob with its default."""
    cfg = ml_collections.ConfigDict()
    cfg.source = "tfds"  # "tfds" (tfds.data_source, array_record) or "jsonl"
    cfg.name = (
        "gsm8k"  # TFDS name[/config][:version]; ours: arithmetic/digits_N, countdown/numbers_N
    )
    cfg.split = "train"  # TFDS split, slices allowed ("train[:90%]")
    cfg.data_dir = ""  # TFDS data dir; "" = TFDS default (~/tensorflow_datasets)
    cfg.download = False  # let TFDS download a missing catalog dataset (ours never need it)
    cfg.path = ""  # JSONL file (source="jsonl")
    cfg.fields = ml_collections.ConfigDict()  # canonical -> column, e.g. {"question": "problem"}
    cfg.seed = 0  # shuffling seed; part of the saved data position
    cfg.shuffle = True
    cfg.skip_bad_rows = False  # False: stop at the first bad row, naming it
    cfg.num_epochs = 0  # 0 = endless
    cfg.max_prompt_len = 512  # tokens; a longer prompt is a bad row
    cfg.pad_multiple = 64  # prompt length bucket (fewer distinct shapes to compile)
    cfg.template = ""  # user turn, e.g. "{question}\nAnswer after ####."; "" = dataset default
    cfg.system_prompt = ""
    cfg.chat_template = "auto"  # auto | always | never
    # A reasoning-gym task's settings (its config's fields), e.g. {"max_terms": 2}.
    cfg.options = ml_collections.ConfigDict()
    return cfg


def check_config(cfg) -> None:
    """Raises ValueError naming the first wrong `data.*` key."""
    known = set(_TYPES) | {"fields", "options"}
    unknown = sorted(set(cfg.keys()) - known)
    if unknown:
        raise ValueError(f"data.{unknown[0]}: unknown key; known keys: {sorted(known)}")
    for key, kind in _TYPES.items():
        value = cfg.get(key, default_config()[key])
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"data.{key}: expected {kind.__name__}, got {value!r}")
    if cfg.source not in ("tfds", "jsonl"):
        raise ValueError(f"data.source must be 'tfds' or 'jsonl', got {cfg.source!r}")
    if cfg.source == "jsonl" and not cfg.path:
        raise ValueError("data.path: required when data.source='jsonl'")
    options = dict(cfg.get("options") or {})
    if cfg.source == "tfds" and cfg.get("name", "").startswith(reasoning_gym.PREFIX):
        reasoning_gym.check_name(cfg.name, cfg.get("split", "train"), options)
    elif options:
        raise ValueError(
            f"data.options={options}: only a reasoning-gym task "
            "(data.name='reasoning_gym/...') takes options"
        )
    for key in ("max_prompt_len", "pad_multiple"):
        if cfg[key] < 1:
            raise ValueError(f"data.{key} must be >= 1, got {cfg[key]}")
    if cfg.num_epochs < 0:
        raise ValueError(f"data.num_epochs must be >= 0 (0 = endless), got {cfg.num_epochs}")


def _merged(cfg) -> ml_collections.ConfigDict:
    merged = default_config()
    merged.update(cfg)
    return merged


def make_source(cfg):
    """The configured row source: `TfdsSource` or `JsonlSource`."""
    check_config(cfg)
    cfg = _merged(cfg)
    if cfg.source == "jsonl":
        return JsonlSource(cfg.path)
    if cfg.name.startswith(reasoning_gym.PREFIX):
        return reasoning_gym.ReasoningGymSource(cfg.name, cfg.split, dict(cfg.options))
    return TfdsSource(cfg.name, cfg.split, cfg.data_dir, cfg.download)


def row_format(cfg) -> RowFormat:
    """The configured column mapping (data.fields, else the dataset's default fields)."""
    cfg = _merged(cfg)
    dataset = cfg.name.split("/")[0].split(":")[0] if cfg.source == "tfds" else ""
    return RowFormat(dict(cfg.fields) or DEFAULT_FIELDS.get(dataset, {"question": "question"}))


def prompt_builder(cfg, tokenizer) -> PromptBuilder:
    """The configured prompt template, chat template and length limit."""
    cfg = _merged(cfg)
    template = cfg.template or (
        default_template(cfg.name) if cfg.source == "tfds" else "{question}"
    )
    if not cfg.template and cfg.source == "tfds" and cfg.name.startswith(reasoning_gym.PREFIX):
        template = reasoning_gym.TEMPLATE
    return PromptBuilder(
        tokenizer, template, cfg.system_prompt, cfg.chat_template, cfg.max_prompt_len
    )


def make_iterator(
    cfg, tokenizer, batch_size: int, process_index: int = 0, process_count: int = 1
) -> PromptIterator:
    """Source + row format + prompt builder + iterator, from the `data` config."""
    check_config(cfg)
    source = make_source(cfg)
    cfg = _merged(cfg)
    fields, builder = row_format(cfg), prompt_builder(cfg, tokenizer)

    def prepare(row, where):
        example = fields(row, where)
        text, ids = builder(example, where)
        return example, text, ids

    return PromptIterator(
        source,
        prepare,
        batch_size,
        seed=cfg.seed,
        shuffle=cfg.shuffle,
        process_index=process_index,
        process_count=process_count,
        skip_bad_rows=cfg.skip_bad_rows,
        num_epochs=cfg.num_epochs or None,
        pad_id=pad_id(tokenizer),
        pad_multiple=cfg.pad_multiple,
        max_len=cfg.max_prompt_len,
    )
