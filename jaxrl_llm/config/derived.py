"""What the trainer derives from a run config: the algorithm, the rollout spec, the stop
ids, the LoRA config, the mesh axes and devices, the model path; and `ConfigError`, the
one-line error that names a config key, with `require`, the check that raises it.
"""

from __future__ import annotations

from jaxrl_llm.errors import UserError


class ConfigError(UserError, ValueError):
    """A run config that cannot work; the message names the key."""


def require(ok: bool, message: str) -> None:
    """Raises ConfigError(message) unless ok: the one-line form of every config check
    (`config.checks` and its section modules), the message naming the key."""
    if not ok:
        raise ConfigError(message)


MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")


def mesh_axes(mesh_config) -> dict:
    """{'data': .., 'fsdp': .., 'context': .., 'tensor': ..} of a mesh section (or its
    `rollout` part); the axes it leaves out are 1."""
    return {a: mesh_config[a] for a in MESH_AXES if a in mesh_config}


def model_runtime(config) -> dict:
    """The `ModelConfig` runtime fields a run config sets: how the model is computed,
    not what it computes (remat, layer scan, attention, experts' and DeltaNet's
    implementations, chunk sizes)."""
    m = config.model
    return dict(
        remat=m.remat,
        scan_layers=m.scan_layers,
        attention=m.attention,
        attention_block=m.attention_block,
        moe_impl=m.moe_impl,
        linear_impl=m.linear_impl,
        linear_chunk=m.linear_chunk,
        prefill_chunk=config.rollout.prefill_chunk,
    )


def split_devices(config, devices) -> tuple[list, list]:
    """(training devices, rollout devices): all and none unless rollout.mode='split',
    which gives the last `mesh.rollout_devices` devices to the rollout mesh."""
    devices = list(devices)
    n = config.mesh.rollout_devices if config.rollout.mode == "split" else 0
    return (devices[: len(devices) - n], devices[len(devices) - n :]) if n else (devices, [])


def lora_config(config):
    """`models.LoraConfig` of `model.lora`, or None when rank is 0."""
    from jaxrl_llm.models import LoraConfig

    lo = config.model.lora
    if not lo.rank:
        return None
    return LoraConfig(
        rank=int(lo.rank),
        alpha=float(lo.alpha),
        targets=tuple(lo.targets),
        dropout=float(lo.dropout),
    )


def resolve_model_path(
    path: str, key: str = "model.path", need_config: bool = True, download: bool = True
) -> str | None:
    """A model dir, .gguf file, built-in name or hub name -> an existing local path
    (`models.builtin.resolve`); ConfigError naming `key` when there is none. A hub name
    is downloaded only when `download` (else None: validation never touches the network)."""
    from jaxrl_llm.models import builtin

    try:
        return builtin.resolve(path, key, need_config, download=download)
    except builtin.ModelPathError as err:
        raise ConfigError(str(err)) from None


def algo_config(config):
    """The AlgoConfig of this run: preset(algo.name) with the non-None algo.* overrides."""
    from jaxrl_llm import rl

    overrides = {k: v for k, v in config.algo.items() if k != "name" and v is not None}
    teacher = config.get("teacher")
    if teacher is not None and (teacher.path or teacher.get("paths")):  # distillation
        overrides["distill_coef"] = float(teacher.weight)
    return rl.preset(config.algo.name, **overrides)


def stop_ids(tokenizer, stop_tokens) -> tuple[int, ...]:
    """`rollout.stop_tokens` (token strings; "<eos>" = the tokenizer's EOS) -> token ids."""
    ids = []
    for tok in stop_tokens:
        if tok == "<eos>":
            if tokenizer.eos_token_id is None:
                raise ConfigError("rollout.stop_tokens: the tokenizer has no EOS")
            ids.append(tokenizer.eos_token_id)
            continue
        tid = tokenizer.convert_tokens_to_ids(tok)
        if tid is None or tid == tokenizer.unk_token_id:
            raise ConfigError(f"rollout.stop_tokens: {tok!r} is not a single token")
        ids.append(int(tid))
    return tuple(dict.fromkeys(ids))


def rollout_spec(config, tokenizer):
    """The run's `sampling.RolloutSpec`: one G, one temperature, one budget, for the
    sampler, the reference log-probs and the update."""
    from jaxrl_llm.sampling import RolloutSpec

    r, env = config.rollout, config.get("env")
    return RolloutSpec(
        num_generations=r.num_generations,
        # Multi-turn: a trajectory's completion (turns and observations) is the width the
        # reference and the update see; one turn's budget is rollout.max_new_tokens.
        max_new_tokens=env.max_total_tokens if env is not None and env.name else r.max_new_tokens,
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        stop_ids=stop_ids(tokenizer, r.stop_tokens),
    )
