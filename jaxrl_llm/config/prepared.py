"""The one entry from a run config to what a run is built from: checked once, the model's
config read once, the speed settings the config leaves unset picked once.

    prepared = config.prepare(raw)      # raises ConfigError naming the key
    prepared.config                     # every key set (tuning's picks recorded)
    prepared.tuning_line                # "cpu defaults: micro_batches=4 (...), ..."
    prepared.model_cfg, prepared.model_path, prepared.tokenizer_path

`train.train` calls it before it takes the workdir's lock and compares a resume; `Run`
takes its result (`Run.build(raw, workdir)` prepares and builds in one call).
"""

from __future__ import annotations

import dataclasses

import jax
import ml_collections

from jaxrl_llm.config import checks, checks_model, tuning
from jaxrl_llm.config.derived import mesh_axes, resolve_model_path, split_devices
from jaxrl_llm.parallel import xla_flags


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A checked run config with its speed settings picked, and the model it names."""

    config: ml_collections.ConfigDict
    tuning_line: str  # what `tuning` picked and why ("" when the config set every key)
    model_cfg: object  # the model's `models.ModelConfig` (before LoRA)
    model_path: str  # the model, resolved to a local path
    tokenizer_path: str


def prepare(raw: ml_collections.ConfigDict, devices=None, process_count: int | None = None):
    """-> `Prepared`: every check (`checks.validate`), the model path resolved (a hub name
    is downloaded here, after the checks), the speed settings picked for this backend and
    model (`tuning.resolve`), the context checked with them. devices: the devices the run
    uses (default all); process_count: default jax's."""
    devices = jax.devices() if devices is None else list(devices)
    processes = jax.process_count() if process_count is None else process_count
    model_cfg = checks.validate(raw, len(devices), processes)  # its context checked too
    model_path = resolve_model_path(raw.model.path)
    tokenizer_path = resolve_model_path(
        raw.model.tokenizer or model_path, "model.tokenizer", need_config=False
    )
    hub = model_cfg is None
    if hub:  # a hub model: its config came with the download
        from jaxrl_llm import models

        model_cfg = models.builtin.model_config(model_path)
    train_devices, _ = split_devices(raw, devices)
    from jaxrl_llm import parallel

    shape = parallel.mesh_shape(mesh_axes(raw.mesh), len(train_devices))
    backend = jax.default_backend()
    shards = shape[0] * shape[1] * shape[2]  # parallel.BATCH_AXES
    config, line = tuning.resolve(raw, model_cfg, backend, batch_shards=shards)
    if backend == "cpu" and (level := xla_flags.named(xla_flags.LEVEL)):
        line = "; ".join(filter(None, [line, f"XLA_FLAGS: {xla_flags.LEVEL}={level}"]))
    if hub:  # the context of a local model was checked with the rest (same buckets)
        checks_model.check_context(config, model_cfg)
    return Prepared(
        config=config,
        tuning_line=line,
        model_cfg=model_cfg,
        model_path=model_path,
        tokenizer_path=tokenizer_path,
    )
