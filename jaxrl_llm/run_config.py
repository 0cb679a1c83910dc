"""The run config: every knob of `python -m jaxrl_llm.train` with its default, and the
checks that stop a bad config before anything compiles.

Experiment files in `configs/` start from `base_config()` and change what they need
(big_vision style); any key can be overridden on the command line
(`--config.algo.beta=0.0`). `algo.*` fields other than `name` are typed placeholders:
left at None they take the preset's value (`rl.preset(algo.name)`), set they override it.
"""

from __future__ import annotations

import dataclasses
import os
import re

import ml_collections
from ml_collections import config_dict

from jaxrl_llm.data import config as data_config
from jaxrl_llm.errors import UserError

BUILTIN_MODELS = {
    "quickstart": os.path.join(os.path.dirname(__file__), "assets", "quickstart_model"),
}
_ALGO_TYPES = {bool: bool, int: int, float: float, str: str}


def _algo_defaults() -> ml_collections.ConfigDict:
    """`name` + one typed None placeholder per AlgoConfig field."""
    from jaxrl_llm.rl.algos import AlgoConfig

    algo = ml_collections.ConfigDict()
    algo.name = "grpo"  # grpo | dr_grpo | dapo | gspo | rloo | reinforce_pp | ppo
    for field in dataclasses.fields(AlgoConfig):
        if field.name in ("name", "group_size", "max_completion_len"):
            continue  # set from rollout.num_generations / rollout.max_new_tokens
        default = field.default
        kind = _ALGO_TYPES.get(type(default), float)
        if field.name == "reward_weights":
            algo[field.name] = config_dict.placeholder(tuple)
        else:
            algo[field.name] = config_dict.placeholder(kind)
    return algo


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.model = ml_collections.ConfigDict()
    c.model.path = "quickstart"  # HF model dir, or a built-in name (quickstart)
    c.model.tokenizer = ""  # tokenizer dir; "" = model.path
    c.model.ref_path = ""  # reference model dir; "" = the initial policy
    c.model.dtype = "float32"  # params: float32 | bfloat16 (the optimizer keeps a f32 master)
    c.model.remat = "none"  # none | full | dots | dots_no_batch
    # False: unroll the layers (update, reference and sampler; faster on CPU, compile time
    # grows with depth, sampling holds a second copy of the layer weights).
    c.model.scan_layers = True

    c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})  # -1 = the rest

    c.data = data_config.default_config()

    c.rollout = ml_collections.ConfigDict()
    c.rollout.batch_size = 8  # B: prompts per step (global, all hosts)
    c.rollout.num_generations = 8  # G: completions per prompt
    c.rollout.max_new_tokens = 64
    c.rollout.temperature = 1.0
    c.rollout.top_k = 0
    c.rollout.top_p = 1.0
    c.rollout.stop_tokens = ("<eos>",)  # token strings; "<eos>" = the tokenizer's EOS
    # Prompts are left-padded to a bucket length, one compiled sampler / reference / update
    # per bucket: bucket_steps lengths per doubling (1: 16, 32, 64 ...; 2: 16, 24, 32, 48
    # ...; 4: 16, 20, 24, 28, 32, 40 ...; 8). More steps, less padding, more programs.
    c.rollout.bucket_steps = 2
    # The decode loop runs in this many segments, each over a KV cache just long enough for
    # its tokens (grown in between): a token's attention reads the filled slots plus at most
    # a segment's worth, not the whole prompt + max_new_tokens cache, for that many compiled
    # loop bodies (1 = one loop). Pays off most for long generations at large batch. While
    # the cache grows the old and new one coexist: peak KV memory under 2x one full cache.
    c.rollout.cache_segments = 4  # = sampling.CACHE_SEGMENTS

    c.algo = _algo_defaults()

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-6
    c.optim.schedule = "constant"  # constant | cosine | linear (after warmup)
    c.optim.warmup_steps = 0
    c.optim.end_lr_ratio = 0.0  # cosine / linear decay to learning_rate * this
    c.optim.weight_decay = 0.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.max_grad_norm = 1.0
    c.optim.micro_batches = 1  # gradient accumulation per optimizer step
    c.optim.mini_batches = 1  # optimizer steps per pass over a rollout batch
    c.optim.critic_learning_rate = 1e-5  # PPO

    c.rewards = ml_collections.ConfigDict(
        {"gsm8k": 1.0}
    )  # label -> weight | {name, weight, options}

    c.train = ml_collections.ConfigDict()
    c.train.num_steps = 100
    c.train.seed = 0
    c.train.log_every = 1
    c.train.print_samples_every = 10  # 0 = never
    c.train.num_printed_samples = 2
    c.train.skip_nonfinite = False  # False: a NaN/inf loss or gradient stops the run
    c.train.logprob_chunk = 128  # sequence chunk of the chunked log-prob computation
    c.train.verifier_workers = 0  # 0 = CPU count
    c.train.verifier_timeout_s = 10.0
    c.train.transfer_guard = True  # jax.transfer_guard("disallow") around the step body

    c.eval = ml_collections.ConfigDict()
    c.eval.every = 0  # steps; 0 = never (the final step is always evaluated when > 0)
    c.eval.split = "test"  # TFDS split of the held-out prompts
    c.eval.path = ""  # held-out JSONL file when data.source="jsonl"
    c.eval.num_prompts = 64
    c.eval.pass_k = 8
    c.eval.temperature = 1.0
    c.eval.correct_reward = ""  # reward label that decides pass@k; "" = the first one

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 50  # steps; 0 = only at the end and on SIGTERM
    c.checkpoint.keep = 3
    c.checkpoint.async_save = True

    c.logging = ml_collections.ConfigDict()
    c.logging.tensorboard = True
    c.logging.wandb = False
    c.logging.wandb_project = "jaxrl_llm"
    c.logging.run_name = ""
    return c


def resolve_model_path(path: str, key: str = "model.path", need_config: bool = True) -> str:
    """A model dir, a built-in name, or a hub name -> an existing directory with config.json.

    A hub name (`org/name`, not an existing local path) is downloaded once into the HF
    cache (weights, config, tokenizer); nothing else is ever fetched at run time.
    """
    path = BUILTIN_MODELS.get(path, path)
    if not path:
        raise ConfigError(
            f"{key} is empty: give an HF model directory, a hub name "
            f"(org/name) or one of {list(BUILTIN_MODELS)}"
        )
    if not os.path.exists(path) and _HUB_NAME.fullmatch(path):
        from huggingface_hub import snapshot_download

        path = snapshot_download(path, allow_patterns=_HUB_FILES)
    if not need_config and not os.path.isdir(path):
        raise ConfigError(f"{key}={path!r}: not a directory")
    if need_config and not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{key}={path!r}: no config.json there (an HF model directory)")
    return path


_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja"]


def algo_config(config):
    """The AlgoConfig of this run: preset(algo.name) with the non-None algo.* overrides."""
    from jaxrl_llm import rl

    overrides = {k: v for k, v in config.algo.items() if k != "name" and v is not None}
    return rl.preset(
        config.algo.name,
        group_size=config.rollout.num_generations,
        max_completion_len=config.rollout.max_new_tokens,
        **overrides,
    )


class ConfigError(UserError, ValueError):
    """A run config that cannot work; the message names the key."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(config, num_devices: int | None = None, process_count: int = 1) -> None:
    """Every cross-field check, before anything is compiled. Raises ConfigError naming the key."""
    import jax

    from jaxrl_llm import models, parallel, verifiers
    from jaxrl_llm.models.config import REMAT_POLICIES
    from jaxrl_llm.sampling import BUCKET_STEPS, bucket_length

    num_devices = jax.device_count() if num_devices is None else num_devices
    path = resolve_model_path(config.model.path)
    if config.model.ref_path:
        resolve_model_path(config.model.ref_path, "model.ref_path")
    if config.model.tokenizer:
        resolve_model_path(config.model.tokenizer, "model.tokenizer", need_config=False)
    _check(
        config.model.dtype in ("float32", "bfloat16", "float16"),
        f"model.dtype={config.model.dtype!r}: expected float32, bfloat16 or float16",
    )
    _check(
        config.model.remat in REMAT_POLICIES,
        f"model.remat={config.model.remat!r}: expected one of {REMAT_POLICIES}",
    )
    try:
        mesh_shape = parallel.mesh_shape(dict(config.mesh), num_devices, key_prefix="mesh")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    r = config.rollout
    _check(r.batch_size >= 1, f"rollout.batch_size={r.batch_size}: must be >= 1")
    _check(r.num_generations >= 1, f"rollout.num_generations={r.num_generations}: must be >= 1")
    rows, multiple = r.batch_size * r.num_generations, mesh_shape[0] * mesh_shape[1]
    _check(
        r.batch_size % multiple == 0,
        f"rollout.batch_size={r.batch_size} is not divisible by mesh data x fsdp = {multiple}",
    )
    _check(
        r.batch_size % process_count == 0,
        f"rollout.batch_size={r.batch_size} is not divisible by {process_count} processes",
    )
    _check(r.max_new_tokens >= 1, f"rollout.max_new_tokens={r.max_new_tokens}: must be >= 1")
    _check(r.temperature > 0, f"rollout.temperature={r.temperature}: training samples, use > 0")
    _check(0 < r.top_p <= 1, f"rollout.top_p={r.top_p}: must be in (0, 1]")
    _check(r.top_k >= 0, f"rollout.top_k={r.top_k}: must be >= 0")
    _check(
        r.bucket_steps in BUCKET_STEPS,
        f"rollout.bucket_steps={r.bucket_steps!r}: expected one of {BUCKET_STEPS}",
    )
    _check(
        isinstance(r.cache_segments, int) and r.cache_segments >= 1,
        f"rollout.cache_segments={r.cache_segments!r}: must be an integer >= 1 (1 = one loop)",
    )
    try:
        algo = algo_config(config)
    except ValueError as e:
        raise ConfigError(str(e).replace("algo.group_size", "rollout.num_generations")) from None
    model_cfg = models.ModelConfig.from_hf_dir(path)
    bucket = bucket_length(config.data.max_prompt_len, r.bucket_steps)
    _check(
        bucket + r.max_new_tokens <= model_cfg.max_position_embeddings,
        f"data.max_prompt_len={config.data.max_prompt_len} (bucket "
        f"{bucket}) + rollout.max_new_tokens="
        f"{r.max_new_tokens} exceeds the model's max_position_embeddings "
        f"{model_cfg.max_position_embeddings}",
    )
    o = config.optim
    _check(o.learning_rate > 0, f"optim.learning_rate={o.learning_rate}: must be > 0")
    _check(
        o.schedule in ("constant", "cosine", "linear"),
        f"optim.schedule={o.schedule!r}: expected constant, cosine or linear",
    )
    _check(0 <= o.end_lr_ratio <= 1, f"optim.end_lr_ratio={o.end_lr_ratio}: must be in [0, 1]")
    _check(
        o.mini_batches >= 1 and rows % o.mini_batches == 0,
        f"optim.mini_batches={o.mini_batches} does not divide the {rows} rollouts per step",
    )
    per_mini = rows // max(o.mini_batches, 1)
    _check(
        o.micro_batches >= 1 and per_mini % o.micro_batches == 0,
        f"optim.micro_batches={o.micro_batches} does not divide the {per_mini} rows per "
        f"optimizer step",
    )
    try:
        labels = [s.label for s in verifiers.parse_specs(config.rewards)]
    except ValueError as e:
        raise ConfigError(str(e) if str(e).startswith("rewards") else f"rewards: {e}") from None
    _check(bool(labels), "rewards: at least one verifier is needed")
    if algo.decouple_rewards or algo.reward_weights:
        _check(
            algo.reward_weights is None or len(algo.reward_weights) == len(labels),
            f"algo.reward_weights has {len(algo.reward_weights or ())} entries for "
            f"{len(labels)} rewards",
        )
    t = config.train
    _check(t.num_steps >= 1, f"train.num_steps={t.num_steps}: must be >= 1")
    _check(t.log_every >= 1, f"train.log_every={t.log_every}: must be >= 1")
    _check(t.logprob_chunk >= 1, f"train.logprob_chunk={t.logprob_chunk}: must be >= 1")
    e = config.eval
    _check(e.every >= 0, f"eval.every={e.every}: must be >= 0")
    _check(e.pass_k >= 1, f"eval.pass_k={e.pass_k}: must be >= 1")
    _check(
        not (e.every and config.data.source == "jsonl" and not e.path),
        "eval.path: required for evaluation when data.source='jsonl'",
    )
    _check(e.num_prompts >= 1, f"eval.num_prompts={e.num_prompts}: must be >= 1")
    _check(
        not e.correct_reward or e.correct_reward in labels,
        f"eval.correct_reward={e.correct_reward!r}: not a reward label ({labels})",
    )
    _check(config.checkpoint.every >= 0, f"checkpoint.every={config.checkpoint.every}: >= 0")
    _check(config.checkpoint.keep >= 1, f"checkpoint.keep={config.checkpoint.keep}: >= 1")
    try:
        data_config.check_config(config.data)
    except ValueError as err:
        raise ConfigError(str(err)) from None
