"""The checks of a run config, one per section, run before anything is loaded or compiled.

    config.validate(raw)   # raises ConfigError naming the key, e.g.
    # rollout.batch_size=6 is not divisible by mesh data x fsdp x expert = 4
    # rollout.batchsize: unknown key; did you mean rollout.batch_size?

No check touches the network: a hub model name is accepted by its form, and what needs the
model's own config (its context length) is checked here only for local models; the
trainer checks the rest with `check_context` once the model is loaded, still before
anything compiles.
"""

from __future__ import annotations

import difflib
import math
import os

import jax
import ml_collections

from jaxrl_llm.config import tuning
from jaxrl_llm.config.defaults import base_config
from jaxrl_llm.config.derived import ConfigError, algo_config, mesh_axes, resolve_model_path
from jaxrl_llm.data import config as data_config

# Sections whose keys are the user's own names.
FREE_FORM = (
    "rewards",
    "data.fields",
    "data.options",
    "env.options",
    "teacher.paths",
    "agent.options",
)
DTYPES = ("float32", "bfloat16", "float16")
# Partial rollouts decode a chunk at a time, a compiled program per chunk (its cache width).
MAX_PARTIAL_CHUNKS = 32


def check_batch_size(key: str, size: int, mesh_shape, process_count: int) -> None:
    """A global batch of `size` rows (prompts) splits over the mesh's batch axes and over
    the processes."""
    multiple = mesh_shape[0] * mesh_shape[1] * mesh_shape[2]  # parallel.BATCH_AXES
    _check(size >= 1, f"{key}={size}: must be >= 1")
    _check(
        size % multiple == 0,
        f"{key}={size} is not divisible by mesh data x fsdp x expert = {multiple}",
    )
    _check(size % process_count == 0, f"{key}={size} is not divisible by {process_count} processes")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(config, num_devices: int | None = None, process_count: int = 1):
    """Every section's check; raises ConfigError naming the first bad key. -> the model's
    `models.ModelConfig` where the model is local (read once, for `prepare`), else None."""
    num_devices = jax.device_count() if num_devices is None else num_devices
    check_keys(config, base_config())
    mesh_shape = check_mesh(config, num_devices)
    path = check_model(config)
    check_rollout(config, mesh_shape, process_count)
    check_teacher(config)  # before the algo, which takes teacher.weight
    algo = check_algo(config)
    check_optim(config)
    labels = check_rewards(config, algo)
    check_env(config, algo)
    check_agent(config, algo, process_count)
    check_train(config)
    check_eval(config, labels)
    check_checkpoint(config)
    check_data(config)
    if path is None:
        return None
    from jaxrl_llm import models

    model_cfg = models.builtin.model_config(path)
    check_context(config, model_cfg)
    return model_cfg


def check_keys(config, defaults, prefix: str = "") -> None:
    """Every key of `config` exists in `defaults` (sections recursively, FREE_FORM ones
    excepted); an unknown one is named with the closest known key."""
    for key in config.keys():
        name = prefix + key
        if key not in defaults:
            known = list(defaults.keys())
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"known keys: {sorted(known)}"
            raise ConfigError(f"{name}: unknown key; {hint}")
        value, default = config[key], defaults[key]
        if isinstance(default, ml_collections.ConfigDict) and name not in FREE_FORM:
            if not isinstance(value, ml_collections.ConfigDict | dict):
                raise ConfigError(f"{name}: expected a section, got {value!r}")
            check_keys(value, default, name + ".")


def check_mesh(config, num_devices: int) -> tuple[int, ...]:
    """-> the training mesh's shape (in split mode, also checks the rollout mesh's)."""
    from jaxrl_llm import parallel

    m, split = config.mesh, config.get("rollout", {}).get("mode") == "split"
    n = m.get("rollout_devices", 0)
    if split and num_devices < 2:
        on_cpu = jax.default_backend() == "cpu"
        raise ConfigError(
            f"rollout.mode='split': needs two devices or more (the update on some, the "
            f"sampler on mesh.rollout_devices others); this process has {num_devices}; "
            + ("on CPU, start with XLA_FLAGS=--xla_force_host_platform_device_count=N "
               "(N >= 2) in the environment, or use rollout.mode='sync'" if on_cpu
               else "run on more devices, or use rollout.mode='sync'")
        )  # fmt: skip
    _check(
        isinstance(n, int) and (0 < n < num_devices if split else n == 0),
        f"mesh.rollout_devices={n!r}: "
        + (f"rollout.mode='split' needs 1 .. {num_devices - 1} of the {num_devices} devices"
           if split else "only rollout.mode='split' uses a rollout mesh; set it to 0"),
    )  # fmt: skip
    try:
        if split:
            parallel.mesh_shape(mesh_axes(m.rollout), n, key_prefix="mesh.rollout")
        return parallel.mesh_shape(mesh_axes(m), num_devices - n, key_prefix="mesh")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_model(config) -> str | None:
    """-> the local model directory (None for a hub name, fetched when the run starts)."""
    from jaxrl_llm.models.config import ATTENTION_IMPLEMENTATIONS, MOE_IMPLS, REMAT_POLICIES

    m = config.model
    path = resolve_model_path(m.path, download=False)
    if m.ref_path:
        resolve_model_path(m.ref_path, "model.ref_path", download=False)
    if m.tokenizer:
        resolve_model_path(m.tokenizer, "model.tokenizer", need_config=False, download=False)
    _check(m.dtype in DTYPES, f"model.dtype={m.dtype!r}: expected one of {DTYPES}")
    _check(m.remat in REMAT_POLICIES, f"model.remat={m.remat!r}: expected one of {REMAT_POLICIES}")
    _check(m.moe_impl in MOE_IMPLS, f"model.moe_impl={m.moe_impl!r}: expected one of {MOE_IMPLS}")
    _check(
        m.attention in ATTENTION_IMPLEMENTATIONS,
        f"model.attention={m.attention!r}: expected one of {ATTENTION_IMPLEMENTATIONS}",
    )
    _check(
        isinstance(m.attention_block, int) and m.attention_block >= 1,
        f"model.attention_block={m.attention_block!r}: must be an int >= 1",
    )
    check_lora(m.lora)
    return path


LORA_SAMPLERS = ("auto", "merged", "unmerged")


def check_lora(lora) -> None:
    """model.lora: rank 0 (off) or a positive rank, known targets, a dropout rate."""
    from jaxrl_llm.models.config import LORA_TARGETS

    _check(
        isinstance(lora.rank, int) and lora.rank >= 0,
        f"model.lora.rank={lora.rank!r}: must be an integer >= 0 (0 = off)",
    )
    _check(lora.alpha > 0, f"model.lora.alpha={lora.alpha}: must be > 0")
    targets = (lora.targets,) if isinstance(lora.targets, str) else tuple(lora.targets or ())
    unknown = [t for t in targets if t not in LORA_TARGETS]
    _check(
        bool(targets) and not unknown and len(set(targets)) == len(targets),
        f"model.lora.targets={targets!r}: expected distinct names among {', '.join(LORA_TARGETS)}"
        + (f" ({unknown[0]!r} is not one)" if unknown else ""),
    )
    _check(
        isinstance(lora.dropout, int | float) and 0 <= lora.dropout < 1,
        f"model.lora.dropout={lora.dropout!r}: must be a rate in [0, 1)",
    )
    _check(
        lora.sampler in LORA_SAMPLERS,
        f"model.lora.sampler={lora.sampler!r}: expected one of {LORA_SAMPLERS}",
    )


ROLLOUT_MODES = ("sync", "overlap", "split")
ENGINES = ("static", "paged")  # rollout.engine


def check_rollout(config, mesh_shape, process_count: int) -> None:
    from jaxrl_llm.sampling import BUCKET_STEPS

    r = config.rollout
    check_batch_size("rollout.batch_size", r.batch_size, mesh_shape, process_count)
    _check(r.num_generations >= 1, f"rollout.num_generations={r.num_generations}: must be >= 1")
    _check(r.max_new_tokens >= 1, f"rollout.max_new_tokens={r.max_new_tokens}: must be >= 1")
    _check(r.temperature > 0, f"rollout.temperature={r.temperature}: training samples, use > 0")
    _check(0 < r.top_p <= 1, f"rollout.top_p={r.top_p}: must be in (0, 1]")
    _check(r.top_k >= 0, f"rollout.top_k={r.top_k}: must be >= 0")
    _check(
        r.bucket_steps is None or r.bucket_steps in BUCKET_STEPS,
        f"rollout.bucket_steps={r.bucket_steps!r}: expected one of {BUCKET_STEPS} "
        "(None: picked at start-up)",
    )
    _check(
        isinstance(r.cache_segments, int) and r.cache_segments >= 1,
        f"rollout.cache_segments={r.cache_segments!r}: must be an integer >= 1 (1 = one loop)",
    )
    _check(
        isinstance(r.prefill_chunk, int) and r.prefill_chunk >= 0,
        f"rollout.prefill_chunk={r.prefill_chunk!r}: must be an integer >= 0 (0 = one shot)",
    )
    _check(
        r.mode in ROLLOUT_MODES,
        f"rollout.mode={r.mode!r}: expected one of {', '.join(ROLLOUT_MODES)}",
    )
    _check(
        isinstance(r.max_staleness, int) and r.max_staleness >= 0,
        f"rollout.max_staleness={r.max_staleness!r}: must be an integer >= 0 (0 = sync)",
    )
    _check(
        not r.partial or r.mode == "split",
        f"rollout.partial=True needs rollout.mode='split' (got {r.mode!r})",
    )
    _check(
        isinstance(r.partial_chunk, int) and r.partial_chunk >= 1,
        f"rollout.partial_chunk={r.partial_chunk!r}: must be an integer >= 1",
    )
    chunks = -(-r.max_new_tokens // r.partial_chunk)
    _check(
        not r.partial or chunks <= MAX_PARTIAL_CHUNKS,
        f"rollout.partial_chunk={r.partial_chunk} cuts rollout.max_new_tokens="
        f"{r.max_new_tokens} into {chunks} chunks, each a decode program to compile; use "
        f"rollout.partial_chunk >= {-(-r.max_new_tokens // MAX_PARTIAL_CHUNKS)} "
        f"(at most {MAX_PARTIAL_CHUNKS} chunks)",
    )
    check_engine(config, process_count)
    if r.mode == "split":
        _check(process_count == 1, "rollout.mode='split' runs on one host; use 'overlap'")
        from jaxrl_llm import parallel

        m = config.mesh
        shape = parallel.mesh_shape(mesh_axes(m.rollout), m.rollout_devices)
        check_batch_size("rollout.batch_size", r.batch_size, shape, 1)


def check_engine(config, process_count: int) -> None:
    """rollout.engine and, for 'paged', its settings and what it does not combine with yet
    (every rollout.mode is served: `trainer.paged_stream` in overlap and split;
    environments and the gateway in every mode: `envs.play_paged`, `gateway.rollout`,
    played by the rollout thread outside sync, partial rollouts included)."""
    r = config.rollout
    _check(
        r.engine in ENGINES, f"rollout.engine={r.engine!r}: expected one of {', '.join(ENGINES)}"
    )
    if r.engine != "paged":
        return
    p = r.paged
    for key in ("slots", "pages"):
        value = p[key]
        ok = isinstance(value, int) and value >= 0
        _check(ok, f"rollout.paged.{key}={value!r}: must be an integer >= 0 (0 = automatic)")
    for key in ("page_size", "chunk_steps", "prefill_chunk"):
        value = p[key]
        _check(isinstance(value, int) and value >= 1,
               f"rollout.paged.{key}={value!r}: must be an integer >= 1")  # fmt: skip
    names = ("auto", "pages", "gather", "pallas")  # sampling.paged.ATTENTION
    _check(p.attention in names,
           f"rollout.paged.attention={p.attention!r}: expected one of "
           f"{', '.join(names)}")  # fmt: skip
    _check(p.prefill_chunk % p.page_size == 0,
           f"rollout.paged.prefill_chunk={p.prefill_chunk}: must be a multiple of "
           f"rollout.paged.page_size={p.page_size}")  # fmt: skip
    _check(process_count == 1, "rollout.engine='paged' runs on one process; use 'static'")


def check_algo(config):
    from jaxrl_llm import rl

    try:
        algo = algo_config(config)
        rl.check_num_generations(algo, config.rollout.num_generations)
    except ValueError as e:
        message = str(e)
        if message.startswith("num_generations"):
            message = "rollout." + message
        raise ConfigError(message) from None
    _check(
        not (algo.dynamic_sampling and config.rollout.mode != "sync"),
        f"rollout.mode={config.rollout.mode!r} does not combine with dynamic sampling (algo "
        f"{algo.name!r}: its extra sampling rounds need this step's rewards); use mode='sync'",
    )
    return algo


def check_teacher(config) -> None:
    """teacher.path resolves (its tokenizer is compared with the student's when the run
    loads them: `trainer.run`); teacher.weight > 0."""
    t = config.teacher
    paths = dict(t.paths)
    _check(
        bool(t.field) == bool(paths),
        f"teacher.field={t.field!r} and teacher.paths ({len(paths)} entries): several "
        "teachers need both (the row field that names a row's teacher, and name -> path)",
    )
    if not t.path and not paths:
        return
    if t.path:
        resolve_model_path(t.path, "teacher.path", download=False)
    for name, path in paths.items():
        _check(isinstance(path, str) and bool(path), f"teacher.paths.{name}: expected a path")
        resolve_model_path(path, f"teacher.paths.{name}", download=False)
    w = t.weight
    _check(
        isinstance(w, int | float) and math.isfinite(w) and w > 0,
        f"teacher.weight={w!r}: must be a finite number > 0",
    )


def check_optim(config) -> None:
    _check(
        config.optim.packing in ("auto", "on", "off"),
        f"optim.packing={config.optim.packing!r}: one of 'auto', 'on', 'off'",
    )
    _check(
        0.0 < config.optim.packing_capacity <= 1.0,
        f"optim.packing_capacity={config.optim.packing_capacity}: must be in (0, 1]",
    )
    o, rows = config.optim, config.rollout.batch_size * config.rollout.num_generations
    _check(o.learning_rate > 0, f"optim.learning_rate={o.learning_rate}: must be > 0")
    _check(
        o.schedule in ("constant", "cosine", "linear"),
        f"optim.schedule={o.schedule!r}: expected constant, cosine or linear",
    )
    _check(0 <= o.end_lr_ratio <= 1, f"optim.end_lr_ratio={o.end_lr_ratio}: must be in [0, 1]")
    _check(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay}: must be >= 0")
    _check(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps}: must be >= 0")
    _check(
        o.mini_batches >= 1 and rows % o.mini_batches == 0,
        f"optim.mini_batches={o.mini_batches} does not divide the {rows} rollouts per step",
    )
    per_mini = rows // max(o.mini_batches, 1)
    _check(
        o.micro_batches is None or (o.micro_batches >= 1 and per_mini % o.micro_batches == 0),
        f"optim.micro_batches={o.micro_batches} does not divide the {per_mini} rows per "
        f"optimizer step (None: picked at start-up)",
    )


def check_rewards(config, algo) -> list[str]:
    """-> the reward labels."""
    from jaxrl_llm import verifiers

    if config.env.name:
        _check(
            not config.rewards,
            "rewards: with env.name set the environment gives the reward (its verifier is "
            "an env.options entry); set config.rewards = {}",
        )
        return []
    if config.agent.entry:
        _check(
            not config.rewards,
            "rewards: with agent.entry set the agent's return value is the reward; set "
            "config.rewards = {}",
        )
        return []
    try:
        labels = [s.label for s in verifiers.parse_specs(config.rewards)]
    except ValueError as e:
        raise ConfigError(str(e) if str(e).startswith("rewards") else f"rewards: {e}") from None
    _check(bool(labels), "rewards: at least one verifier is needed")
    check_judges(config)
    if algo.decouple_rewards or algo.reward_weights:
        _check(
            algo.reward_weights is None or len(algo.reward_weights) == len(labels),
            f"algo.reward_weights has {len(algo.reward_weights or ())} entries for "
            f"{len(labels)} rewards",
        )
    return labels


def check_judges(config) -> None:
    """Judge reward entries (verifiers/judge.py): their options and a model path that
    resolves."""
    from jaxrl_llm import verifiers
    from jaxrl_llm.verifiers import judge

    for spec in verifiers.parse_specs(config.rewards):
        if not judge.is_judge(spec):
            continue
        where = f"rewards.{spec.label}.options"
        try:
            judge.check_options(spec.options, where)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        resolve_model_path(spec.options["model"], f"{where}.model", download=False)


def check_env(config, algo) -> None:
    """Multi-turn settings (only read when env.name is set)."""
    from jaxrl_llm.envs import hubs, schedule

    e = config.env
    if not e.name:
        return
    try:
        hubs.check_options(e.name, dict(e.options))
        most = schedule.most(e.max_turns)
    except ValueError as err:
        message = str(err)
        raise ConfigError(
            message if message.startswith("env.") else f"env.name: {message}"
        ) from None
    turn = config.rollout.max_new_tokens
    _check(
        most >= 1 and e.max_total_tokens >= turn,
        f"env.max_total_tokens={e.max_total_tokens} is below one turn "
        f"(rollout.max_new_tokens={turn})",
    )
    _check(e.turn_reward_discount >= 0, f"env.turn_reward_discount={e.turn_reward_discount}: >= 0")
    _check(e.step_timeout_s > 0, f"env.step_timeout_s={e.step_timeout_s}: must be > 0")
    _check(e.trajectory_timeout_s > 0, f"env.trajectory_timeout_s={e.trajectory_timeout_s}: > 0")
    _check(e.workers >= 0, f"env.workers={e.workers}: must be >= 0 (0 = CPU count)")
    workers = e.workers or os.cpu_count() or 1
    _check(
        isinstance(e.lanes, int) and 1 <= e.lanes <= workers,
        f"env.lanes={e.lanes}: must be an integer between 1 and env.workers ({workers})",
    )
    _check(e.memory_mb >= 0, f"env.memory_mb={e.memory_mb}: must be >= 0 (0 = no cap)")
    _check(not algo.dynamic_sampling, "algo.dynamic_sampling: not available with env.name yet")
    _check(
        config.rollout.mode != "overlap" or jax.process_count() == 1,
        "rollout.mode='overlap' with env.name runs on one host (its trajectories are played "
        "by a thread); use 'sync'",
    )


def check_agent(config, algo, process_count: int) -> None:
    """Agents through the gateway (only read when agent.entry is set)."""
    a = config.agent
    if not a.entry:
        return
    import importlib.util

    from jaxrl_llm.gateway import agents

    _check(not config.env.name, "agent.entry and env.name: set one of them")
    missing = [p for p in ("aiohttp", "openai") if importlib.util.find_spec(p) is None]
    _check(not missing, f"agent.entry: the gateway needs {' and '.join(missing)}: "
           "pip install 'jaxrl_llm[agents]'")  # fmt: skip
    try:
        agents.check(a.entry, dict(a.options))
    except ValueError as err:
        message = str(err)
        raise ConfigError(
            f"agent.options: {message}" if " option" in message else f"agent.entry: {message}"
        ) from None
    _check(
        a.max_total_tokens >= config.rollout.max_new_tokens,
        f"agent.max_total_tokens={a.max_total_tokens} is below one response "
        f"(rollout.max_new_tokens={config.rollout.max_new_tokens})",
    )
    _check(a.timeout_s > 0, f"agent.timeout_s={a.timeout_s}: must be > 0")
    _check(a.batch_wait_s >= 0, f"agent.batch_wait_s={a.batch_wait_s}: must be >= 0")
    _check(process_count == 1, "agent.entry: the gateway runs on one host")
    _check(not algo.dynamic_sampling, "algo.dynamic_sampling: not available with agent.entry")
    _check(algo.routing_replay in (None, "none"),
           "algo.routing_replay='rollout': the gateway (agent.entry) does not record the "
           "sampler's expert routes; use algo.routing_replay='none'")  # fmt: skip


def check_train(config) -> None:
    t = config.train
    _check(t.num_steps >= 1, f"train.num_steps={t.num_steps}: must be >= 1")
    _check(t.log_every >= 1, f"train.log_every={t.log_every}: must be >= 1")
    _check(
        t.logprob_chunk is None or t.logprob_chunk >= 1,
        f"train.logprob_chunk={t.logprob_chunk}: must be >= 1 (None: picked at start-up)",
    )
    _check(t.verifier_workers >= 0, f"train.verifier_workers={t.verifier_workers}: must be >= 0")
    _check(t.verifier_timeout_s > 0, f"train.verifier_timeout_s={t.verifier_timeout_s}: > 0")
    _check(
        t.verifier_memory_mb >= 0,
        f"train.verifier_memory_mb={t.verifier_memory_mb}: must be >= 0 (0 = no cap)",
    )
    _check(
        0 <= t.max_verifier_error_rate <= 1,
        f"train.max_verifier_error_rate={t.max_verifier_error_rate}: must be in [0, 1]",
    )
    _check(
        t.max_failed_steps >= 0,
        f"train.max_failed_steps={t.max_failed_steps}: must be >= 0 (0 = never stop)",
    )


def check_eval(config, labels) -> None:
    e = config.eval
    _check(e.every >= 0, f"eval.every={e.every}: must be >= 0")
    _check(e.pass_k >= 1, f"eval.pass_k={e.pass_k}: must be >= 1")
    _check(e.temperature > 0, f"eval.temperature={e.temperature}: pass@k samples, use > 0")
    _check(
        not (e.every and config.data.source == "jsonl" and not e.path),
        "eval.path: required for evaluation when data.source='jsonl'",
    )
    _check(e.num_prompts >= 1, f"eval.num_prompts={e.num_prompts}: must be >= 1")
    _check(
        not e.correct_reward or e.correct_reward in labels,
        f"eval.correct_reward={e.correct_reward!r}: not a reward label ({labels})",
    )


def check_checkpoint(config) -> None:
    c = config.checkpoint
    _check(c.every >= 0, f"checkpoint.every={c.every}: must be >= 0")
    _check(c.keep >= 1, f"checkpoint.keep={c.keep}: must be >= 1")


def check_data(config) -> None:
    try:
        data_config.check_config(config.data)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_context(config, model_cfg, prompt_len: int | None = None) -> None:
    """The longest prompt's bucket + the completion budget fits the model's context,
    mesh.context divides its attention heads, and optim.packing='on' has a dense model."""
    from jaxrl_llm.sampling import bucket_length

    _check(
        not (model_cfg.moe and config.optim.packing == "on"),
        "optim.packing='on': a mixture-of-experts model runs its rows padded (its routes "
        "are laid out by row); use 'auto' or 'off'",
    )
    r = config.rollout
    prompt_len = config.data.max_prompt_len if prompt_len is None else prompt_len
    bucket = bucket_length(prompt_len, tuning.bucket_steps(config, jax.default_backend()))
    key, budget = "rollout.max_new_tokens", r.max_new_tokens
    if "env" in config and config.env.name:
        key, budget = "env.max_total_tokens", config.env.max_total_tokens
    if "agent" in config and config.agent.entry:
        key, budget = "agent.max_total_tokens", config.agent.max_total_tokens
    context, tensor = config.mesh.get("context", 1), config.mesh.get("tensor", 1)
    split = context * max(tensor, 1)  # tensor=-1 (the rest) is checked at trace time
    _check(
        context == 1 or model_cfg.num_heads % split == 0,
        f"mesh.context={context}: context parallelism splits the attention heads over it "
        f"(times mesh.tensor), and the model's {model_cfg.num_heads} heads are not "
        f"divisible by {split}",
    )
    _check(
        bucket + budget <= model_cfg.max_position_embeddings,
        f"data.max_prompt_len={prompt_len} (bucket {bucket}) + {key}="
        f"{budget} exceeds the model's max_position_embeddings "
        f"{model_cfg.max_position_embeddings}",
    )
