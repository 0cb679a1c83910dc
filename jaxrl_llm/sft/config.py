"""The SFT config: the run config's sections that SFT reads, plus `sft`.

    config = default_config()
    config.model.tokenizer = assets.ARITHMETIC_TOKENIZER  # model.path "" = a new model
    config = check_config(config)  # ConfigError naming the key, before anything loads

The shared sections mean what they mean for the RL trainer (`config_lib.base_config`):

    model    path ("" = a new random model sized by sft.new_model), tokenizer, dtype,
             remat, scan_layers
    mesh, data, rewards, logging
    optim    learning_rate, schedule, warmup_steps, end_lr_ratio, weight_decay, b1, b2,
             eps, max_grad_norm
    train    num_steps, seed (new model's init, sampler), log_every, logprob_chunk,
             verifier_workers, verifier_timeout_s, transfer_guard
    eval     every, at_start, split, path, num_prompts, pass_k, temperature, correct_reward
    rollout  the sampling of evaluation: batch_size (prompts per sampler call),
             max_new_tokens, top_k, top_p, stop_tokens, bucket_steps, cache_segments

The RL trainer's other keys (`RL_ONLY`) are not part of this config: setting one is an
error that says so. The section checks are the run config's own (`config.checks` and
its section modules), run on the config seen as a run config (`_as_run_config`), so both
trainers word an error the same way.
"""

from __future__ import annotations

import ml_collections

from jaxrl_llm import config as config_lib
from jaxrl_llm.config import (
    ConfigError,
    checks,
    checks_model,
    checks_rewards,
    checks_rollout,
    checks_train,
)
from jaxrl_llm.config.derived import require

# RL trainer keys that SFT does not read (no algorithm, reference, checkpoint or resume).
RL_ONLY = (
    "algo",
    "checkpoint",
    "model.ref_path",
    "rollout.num_generations",  # SFT samples eval.pass_k completions per prompt
    "rollout.temperature",  # eval: greedy, and eval.temperature for pass@k
    "optim.micro_batches",
    "optim.mini_batches",
    "optim.critic_learning_rate",
    "train.skip_nonfinite",
    "train.print_samples_every",
    "train.num_printed_samples",
)
SHARED = ("model", "mesh", "data", "rollout", "optim", "rewards", "train", "eval", "logging")


def default_config() -> ml_collections.ConfigDict:
    """Every SFT knob with its default: `config_lib.base_config()` without `RL_ONLY`, SFT's
    defaults where they differ, and the `sft` section."""
    c = config_lib.base_config()
    for name in RL_ONLY:
        section, _, key = name.rpartition(".")
        del (c[section] if section else c)[key]

    c.model.path = ""  # HF model dir to fine-tune, hub or built-in name; "" = a new model
    c.model.tokenizer = ""  # tokenizer dir; "" = model.path (required for a new model)
    # Speed settings the RL trainer picks at start-up (`tuning`) are set here: SFT keeps
    # the values its shipped model was made with.
    c.model.scan_layers = True
    c.train.logprob_chunk = 128
    c.rollout.bucket_steps = 2

    c.rollout.batch_size = 256  # held-out prompts per sampler call
    c.rollout.max_new_tokens = 8  # completion budget of evaluation

    c.optim.learning_rate = 1e-3
    c.optim.schedule = "cosine"  # linear warmup, then cosine decay to end_lr_ratio
    c.optim.warmup_steps = 100
    c.optim.weight_decay = 0.01  # not on norm scales and biases (`rl.optim.decay_mask`)
    c.optim.b2 = 0.98

    c.train.num_steps = 1000
    c.train.log_every = 50

    c.eval.every = 1000  # steps; 0 = never; the last step is always evaluated when > 0
    c.eval.at_start = False  # a new model's step-0 accuracy is 0
    c.eval.num_prompts = 256  # the first prompts of eval.split (a fixed set)

    c.sft = ml_collections.ConfigDict()
    c.sft.batch_size = 128  # sequences per step (global)
    c.sft.completion = ml_collections.ConfigDict()
    c.sft.completion.template = "{answer}"  # over the row's fields; EOS is appended
    c.sft.completion.max_len = 8  # tokens, EOS included; sequences: data.max_prompt_len + this
    # A second completion style for a share of the rows (fixed per row by data.seed and the
    # row index), e.g. a flawed teacher: "{answer}{answer}" repeats the answer, which the
    # gsm8k check scores 0. "" / 0.0 = off.
    c.sft.completion.alt_template = ""
    c.sft.completion.alt_prob = 0.0
    # The shape of the new random model trained when model.path is "" (its vocabulary is
    # the tokenizer's); read only then.
    c.sft.new_model = ml_collections.ConfigDict()
    c.sft.new_model.architecture = "LlamaForCausalLM"  # or Qwen2ForCausalLM, Qwen3ForCausalLM
    c.sft.new_model.hidden_size = 128
    c.sft.new_model.intermediate_size = 512
    c.sft.new_model.num_layers = 4
    c.sft.new_model.num_heads = 4
    c.sft.new_model.num_kv_heads = 4
    c.sft.new_model.head_dim = 32
    c.sft.new_model.max_position_embeddings = 256
    c.sft.new_model.tie_word_embeddings = False
    c.sft.new_model.rope_theta = 10000.0
    c.sft.new_model.initializer_range = 0.02  # std of the random init of every weight matrix
    return c


def check_config(config, num_devices: int | None = None, process_count: int = 1):
    """The config with every default filled in; raises ConfigError naming the first bad key.

    Nothing is loaded or compiled; what needs the model's own config (its context length)
    is checked here for a local model and by `check_lengths` once a new one is sized."""
    import jax

    from jaxrl_llm import models

    _refuse_rl_only(config)
    checks.check_keys(config, default_config())
    c = _filled(config)
    num_devices = jax.device_count() if num_devices is None else num_devices
    mesh_shape = checks_model.check_mesh(c, num_devices)
    path = _check_model(c)
    _check_sft(c, mesh_shape, process_count)
    run = _as_run_config(c)
    checks_rollout.check_rollout(run, mesh_shape, process_count)
    checks_train.check_optim(run)
    labels = checks_rewards.check_rewards(run, config_lib.algo_config(run))
    checks_train.check_train(run)
    checks_train.check_eval(run, labels)
    checks_train.check_data(run)
    if path is not None:
        check_lengths(c, models.builtin.model_config(path))
    return c


def check_lengths(config, model_cfg) -> None:
    """Training sequences and evaluation (prompt bucket + budget) fit the model's context."""

    length = config.data.max_prompt_len + config.sft.completion.max_len
    require(
        length <= model_cfg.max_position_embeddings,
        f"data.max_prompt_len + sft.completion.max_len = {length} exceeds the model's "
        f"max_position_embeddings {model_cfg.max_position_embeddings}",
    )
    checks_model.check_context(config, model_cfg)


def _refuse_rl_only(config) -> None:
    for name in RL_ONLY:
        section, _, key = name.rpartition(".")
        holder = config.get(section) if section else config
        require(
            not (hasattr(holder, "keys") and key in holder),
            f"{name}: a key of the RL trainer (python -m jaxrl_llm.train) that SFT does not read",
        )


def _filled(config, prefix: str = "", into=None) -> ml_collections.ConfigDict:
    """default_config() with the given keys set (free-form sections replaced whole)."""
    from jaxrl_llm.config.checks import FREE_FORM

    into = default_config() if into is None else into
    for key, value in config.items():
        name, default = prefix + key, into[key]
        if isinstance(default, ml_collections.ConfigDict) and name not in FREE_FORM:
            _filled(value, name + ".", default)
            continue
        try:
            into[key] = value
        except TypeError:
            raise ConfigError(f"{name}: expected {type(default).__name__}, got {value!r}") from None
    return into


def _check_model(config) -> str | None:
    """-> the local model directory (None for a new model or a hub name)."""
    from jaxrl_llm.models.config_checks import REMAT_POLICIES

    m = config.model
    if m.path:
        return checks_model.check_model(_as_run_config(config))
    require(bool(m.tokenizer), "model.tokenizer: required when model.path is '' (a new model)")
    config_lib.resolve_model_path(m.tokenizer, "model.tokenizer", need_config=False, download=False)
    dtypes = checks_model.DTYPES
    require(m.dtype in dtypes, f"model.dtype={m.dtype!r}: expected one of {dtypes}")
    require(m.remat in REMAT_POLICIES, f"model.remat={m.remat!r}: expected one of {REMAT_POLICIES}")
    return None


def _check_sft(config, mesh_shape, process_count: int) -> None:

    s, comp = config.sft, config.sft.completion
    checks_rollout.check_batch_size("sft.batch_size", s.batch_size, mesh_shape, process_count)
    require(comp.max_len >= 1, f"sft.completion.max_len={comp.max_len}: must be >= 1")
    require(0 <= comp.alt_prob <= 1, f"sft.completion.alt_prob={comp.alt_prob}: must be in [0, 1]")
    require(
        bool(comp.alt_template) or not comp.alt_prob,
        f"sft.completion.alt_template: empty with alt_prob={comp.alt_prob}",
    )


def _as_run_config(config) -> ml_collections.ConfigDict:
    """The SFT config as a run config: its shared sections over `base_config()`, so the
    RL-only keys keep their defaults (which pass every check)."""
    run = config_lib.base_config()
    for section in SHARED:
        if section == "rewards":  # free-form: replaced, not merged
            run.rewards = config.rewards
        else:
            for key, value in config[section].items():
                run[section][key] = value
    return run
