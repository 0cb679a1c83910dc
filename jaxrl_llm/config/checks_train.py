"""The checks of the training side of a run config: the optimizer (`optim`: learning rate
and schedule, mini- and micro-batches dividing the step's rollouts, packing), the train
loop (`train`: steps, logging, verifier workers and error budget), evaluation (`eval`),
checkpoints (`checkpoint`) and the data section (`data`, checked by `data.config`).

Part of the run config's checks (`checks.validate` runs them in order).
"""

from __future__ import annotations

from jaxrl_llm.config.derived import ConfigError, require
from jaxrl_llm.data import config as data_config


def check_optim(config) -> None:
    require(
        config.optim.packing in ("auto", "on", "off"),
        f"optim.packing={config.optim.packing!r}: one of 'auto', 'on', 'off'",
    )
    require(
        0.0 < config.optim.packing_capacity <= 1.0,
        f"optim.packing_capacity={config.optim.packing_capacity}: must be in (0, 1]",
    )
    o, rows = config.optim, config.rollout.batch_size * config.rollout.num_generations
    require(o.learning_rate > 0, f"optim.learning_rate={o.learning_rate}: must be > 0")
    require(
        o.schedule in ("constant", "cosine", "linear"),
        f"optim.schedule={o.schedule!r}: expected constant, cosine or linear",
    )
    require(0 <= o.end_lr_ratio <= 1, f"optim.end_lr_ratio={o.end_lr_ratio}: must be in [0, 1]")
    require(
        o.mu_dtype in ("float32", "bfloat16"),
        f"optim.mu_dtype={o.mu_dtype!r}: expected float32 or bfloat16",
    )
    require(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay}: must be >= 0")
    require(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps}: must be >= 0")
    require(
        o.mini_batches >= 1 and rows % o.mini_batches == 0,
        f"optim.mini_batches={o.mini_batches} does not divide the {rows} rollouts per step",
    )
    per_mini = rows // max(o.mini_batches, 1)
    require(
        o.micro_batches is None or (o.micro_batches >= 1 and per_mini % o.micro_batches == 0),
        f"optim.micro_batches={o.micro_batches} does not divide the {per_mini} rows per "
        f"optimizer step (None: picked at start-up)",
    )


def check_train(config) -> None:
    t = config.train
    require(t.num_steps >= 1, f"train.num_steps={t.num_steps}: must be >= 1")
    require(t.log_every >= 1, f"train.log_every={t.log_every}: must be >= 1")
    require(
        t.logprob_chunk is None or t.logprob_chunk >= 1,
        f"train.logprob_chunk={t.logprob_chunk}: must be >= 1 (None: picked at start-up)",
    )
    require(
        t.release_memory in ("compiles", "phases"),
        f"train.release_memory={t.release_memory!r}: one of 'compiles', 'phases'",
    )
    require(t.verifier_workers >= 0, f"train.verifier_workers={t.verifier_workers}: must be >= 0")
    require(t.verifier_timeout_s > 0, f"train.verifier_timeout_s={t.verifier_timeout_s}: > 0")
    require(
        t.verifier_memory_mb >= 0,
        f"train.verifier_memory_mb={t.verifier_memory_mb}: must be >= 0 (0 = no cap)",
    )
    require(
        0 <= t.max_verifier_error_rate <= 1,
        f"train.max_verifier_error_rate={t.max_verifier_error_rate}: must be in [0, 1]",
    )
    require(
        t.max_failed_steps >= 0,
        f"train.max_failed_steps={t.max_failed_steps}: must be >= 0 (0 = never stop)",
    )


def check_eval(config, labels) -> None:
    e = config.eval
    require(e.every >= 0, f"eval.every={e.every}: must be >= 0")
    require(e.pass_k >= 1, f"eval.pass_k={e.pass_k}: must be >= 1")
    require(e.temperature > 0, f"eval.temperature={e.temperature}: pass@k samples, use > 0")
    require(
        not (e.every and config.data.source == "jsonl" and not e.path),
        "eval.path: required for evaluation when data.source='jsonl'",
    )
    require(e.num_prompts >= 1, f"eval.num_prompts={e.num_prompts}: must be >= 1")
    require(
        not e.correct_reward or e.correct_reward in labels,
        f"eval.correct_reward={e.correct_reward!r}: not a reward label ({labels})",
    )


def check_checkpoint(config) -> None:
    c = config.checkpoint
    require(c.every >= 0, f"checkpoint.every={c.every}: must be >= 0")
    require(c.keep >= 1, f"checkpoint.keep={c.keep}: must be >= 1")


def check_data(config) -> None:
    try:
        data_config.check_config(config.data)
    except ValueError as err:
        raise ConfigError(str(err)) from None
