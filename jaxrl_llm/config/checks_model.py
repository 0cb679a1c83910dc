"""The checks of the model and the mesh it runs on: `mesh` (the training mesh's shape,
and the rollout mesh's in split mode), `model` (its path, dtype, remat, attention and
MoE implementations), `model.lora`, and, once the model's own config is read, whether
the prompts and completions fit its context and `mesh.context` divides its heads.

Part of the run config's checks (`checks.validate` runs them in order); kept together
because each needs the model's or the mesh's own constants (`models.config`,
`parallel.mesh_shape`) and nothing from the other sections.
"""

from __future__ import annotations

import os

import jax

from jaxrl_llm.config import tuning
from jaxrl_llm.config.derived import ConfigError, mesh_axes, require, resolve_model_path
from jaxrl_llm.parallel import target

DTYPES = ("float32", "bfloat16", "float16")


def check_mesh(config, num_devices: int) -> tuple[int, ...]:
    """-> the training mesh's shape (in split mode, also checks the rollout mesh's)."""
    from jaxrl_llm import parallel

    m, split = config.mesh, config.get("rollout", {}).get("mode") == "split"
    split = split and not config.rollout.get("workers", 0)  # with workers: no rollout mesh
    n = m.get("rollout_devices", 0)
    if split and num_devices < 2:
        on_cpu = jax.default_backend() == "cpu"
        raise ConfigError(
            f"rollout.mode='split': needs two devices or more (the update on some, the "
            f"sampler on mesh.rollout_devices others); this process has {num_devices}; "
            + (
                "on CPU, start with XLA_FLAGS=--xla_force_host_platform_device_count=N "
                "(N >= 2) in the environment, or use rollout.mode='sync'"
                if on_cpu
                else "run on more devices, or use rollout.mode='sync'"
            )
        )
    require(
        isinstance(n, int) and (0 < n < num_devices if split else n == 0),
        f"mesh.rollout_devices={n!r}: "
        + (
            f"rollout.mode='split' needs 1 .. {num_devices - 1} of the {num_devices} devices"
            if split
            else "with rollout.workers the workers sample and every device here trains; set it to 0"
            if config.get("rollout", {}).get("workers", 0)
            else "only rollout.mode='split' uses a rollout mesh; set it to 0"
        ),
    )
    try:
        if split:
            parallel.mesh_shape(mesh_axes(m.rollout), n, key_prefix="mesh.rollout")
        return parallel.mesh_shape(mesh_axes(m), num_devices - n, key_prefix="mesh")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_model(config) -> str | None:
    """-> the local model directory (None for a hub name, fetched when the run starts)."""
    from jaxrl_llm.models.config_checks import (
        ATTENTION_IMPLEMENTATIONS,
        LINEAR_IMPLS,
        MOE_IMPLS,
        REMAT_POLICIES,
    )

    m = config.model
    path = resolve_model_path(m.path, download=False)
    if m.ref_path:
        resolve_model_path(m.ref_path, "model.ref_path", download=False)
    if m.tokenizer:
        resolve_model_path(m.tokenizer, "model.tokenizer", need_config=False, download=False)
    require(m.dtype in DTYPES, f"model.dtype={m.dtype!r}: expected one of {DTYPES}")
    require(m.remat in REMAT_POLICIES, f"model.remat={m.remat!r}: expected one of {REMAT_POLICIES}")
    require(m.moe_impl in MOE_IMPLS, f"model.moe_impl={m.moe_impl!r}: expected one of {MOE_IMPLS}")
    require(
        m.linear_impl in LINEAR_IMPLS,
        f"model.linear_impl={m.linear_impl!r}: expected one of {LINEAR_IMPLS}",
    )
    require(
        isinstance(m.linear_chunk, int) and m.linear_chunk >= 1,
        f"model.linear_chunk={m.linear_chunk!r}: must be an int >= 1",
    )
    require(
        m.attention in ATTENTION_IMPLEMENTATIONS,
        f"model.attention={m.attention!r}: expected one of {ATTENTION_IMPLEMENTATIONS}",
    )
    require(
        isinstance(m.attention_block, int) and m.attention_block >= 1,
        f"model.attention_block={m.attention_block!r}: must be an int >= 1",
    )
    require(
        m.attention not in ("cudnn", "pallas") or target.backend() != "cpu",
        f"model.attention={m.attention!r}: a GPU/TPU kernel, not available on CPU; use "
        "'auto', 'xla' or 'blockwise'",
    )
    check_lora(m.lora)
    return path


LORA_SAMPLERS = ("auto", "merged", "unmerged")


def check_lora(lora) -> None:
    """model.lora: rank 0 (off) or a positive rank, known targets, a dropout rate."""
    from jaxrl_llm.models.config import LORA_TARGETS

    require(
        isinstance(lora.rank, int) and lora.rank >= 0,
        f"model.lora.rank={lora.rank!r}: must be an integer >= 0 (0 = off)",
    )
    require(lora.alpha > 0, f"model.lora.alpha={lora.alpha}: must be > 0")
    targets = (lora.targets,) if isinstance(lora.targets, str) else tuple(lora.targets or ())
    unknown = [t for t in targets if t not in LORA_TARGETS]
    require(
        bool(targets) and not unknown and len(set(targets)) == len(targets),
        f"model.lora.targets={targets!r}: expected distinct names among {', '.join(LORA_TARGETS)}"
        + (f" ({unknown[0]!r} is not one)" if unknown else ""),
    )
    require(
        isinstance(lora.dropout, int | float) and 0 <= lora.dropout < 1,
        f"model.lora.dropout={lora.dropout!r}: must be a rate in [0, 1)",
    )
    require(
        lora.sampler in LORA_SAMPLERS,
        f"model.lora.sampler={lora.sampler!r}: expected one of {LORA_SAMPLERS}",
    )


def check_context(config, model_cfg, prompt_len: int | None = None) -> None:
    """The longest prompt's bucket + the completion budget fits the model's context,
    mesh.context divides its attention heads, and optim.packing='on' has a dense model."""
    from jaxrl_llm.sampling import bucket_length

    require(
        not (model_cfg.moe and config.optim.packing == "on"),
        "optim.packing='on': a mixture-of-experts model runs its rows padded (its routes "
        "are laid out by row); use 'auto' or 'off'",
    )
    require(
        not (model_cfg.hybrid and config.optim.packing == "on"),
        "optim.packing='on': a hybrid (Gated DeltaNet) model does not reset its recurrent "
        "state between packed sequences yet; use 'off'",
    )
    require(
        not (
            model_cfg.hybrid
            and config.rollout.engine == "paged"
            and config.rollout.paged.attention == "gather"
        ),
        "rollout.paged.attention='gather': its prefix is keys/values, not a hybrid (Gated "
        "DeltaNet) model's recurrent state; use 'auto' or 'pages'",
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
    require(
        context == 1 or model_cfg.num_heads % split == 0,
        f"mesh.context={context}: context parallelism splits the attention heads over it "
        f"(times mesh.tensor), and the model's {model_cfg.num_heads} heads are not "
        f"divisible by {split}",
    )
    require(
        bucket + budget <= model_cfg.max_position_embeddings,
        f"data.max_prompt_len={prompt_len} (bucket {bucket}) + {key}="
        f"{budget} exceeds the model's max_position_embeddings "
        f"{model_cfg.max_position_embeddings}",
    )
    check_page_pool(config, model_cfg)


def check_page_pool(config, model_cfg) -> None:
    """A set `rollout.paged.pages` fits this machine's memory: the pool's KV cache
    (pages x page_size tokens, K and V per layer) is allocated whole at the start, and a
    hybrid model's recurrent-state rows with it (at most two per slot and one more:
    `paged_pool.Pool`)."""
    from jaxrl_llm.models import gated_deltanet

    r = config.rollout
    if r.engine != "paged" or not r.paged.pages:
        return
    p, m = r.paged, model_cfg
    width = 2 if config.model.dtype == "bfloat16" else 4
    size = p.pages * p.page_size * m.kv_per_token * width
    held = f"{p.pages} pages of {p.page_size} tokens"
    if m.hybrid:
        rows = 2 * (p.slots or r.batch_size * r.num_generations) + 2
        size += rows * gated_deltanet.state_bytes(m, config.model.dtype)
        held += f" and {rows} recurrent-state rows"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    require(
        size <= memory,
        f"rollout.paged.pages={p.pages}: the page pool's KV cache is {size / 2**30:,.1f} GiB "
        f"({held}), more than this machine's "
        f"{memory / 2**30:,.1f} GiB; lower rollout.paged.pages (0 = automatic)",
    )
