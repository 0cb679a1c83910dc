"""The checks of the `rollout` section: the batch and its split over the mesh, sampling
settings, the rollout mode (sync / overlap / split) with its staleness and partial
rollouts, rollout workers in processes of their own, and the engine (static or paged)
with the paged engine's settings.

Part of the run config's checks (`checks.validate` runs them in order); `check_batch_size`
is also the check of any other global batch (the SFT trainer's).
"""

from __future__ import annotations

import os

from jaxrl_llm.config.derived import mesh_axes, require
from jaxrl_llm.parallel import target

# Partial rollouts decode a chunk at a time, a compiled program per chunk (its cache width).
MAX_PARTIAL_CHUNKS = 32
ROLLOUT_MODES = ("sync", "overlap", "split")
ENGINES = ("static", "paged")  # rollout.engine


def check_batch_size(key: str, size: int, mesh_shape, process_count: int) -> None:
    """A global batch of `size` rows (prompts) splits over the mesh's batch axes and over
    the processes."""
    multiple = mesh_shape[0] * mesh_shape[1] * mesh_shape[2]  # parallel.BATCH_AXES
    require(size >= 1, f"{key}={size}: must be >= 1")
    require(
        size % multiple == 0,
        f"{key}={size} is not divisible by mesh data x fsdp x expert = {multiple}",
    )
    require(
        size % process_count == 0, f"{key}={size} is not divisible by {process_count} processes"
    )


def check_worker_processes(config, processes: int) -> None:
    """A rollout worker of `processes` processes (its config checked as one process's:
    each gets every request, `workers.serve`): the static engine's programs take each
    process's own rows of a step, so rollout.batch_size must split over them; the paged
    engine runs the whole batch on every process."""
    b = config.rollout.batch_size
    require(
        config.rollout.engine != "static" or b % processes == 0,
        f"rollout.batch_size={b} is not divisible by this rollout worker's {processes} "
        "processes (the static engine splits a step's prompts over them; "
        "rollout.engine=paged runs the whole batch on each)",
    )


def check_rollout(config, mesh_shape, process_count: int) -> None:
    from jaxrl_llm.sampling import BUCKET_STEPS

    r = config.rollout
    check_batch_size("rollout.batch_size", r.batch_size, mesh_shape, process_count)
    require(r.num_generations >= 1, f"rollout.num_generations={r.num_generations}: must be >= 1")
    require(r.max_new_tokens >= 1, f"rollout.max_new_tokens={r.max_new_tokens}: must be >= 1")
    require(r.temperature > 0, f"rollout.temperature={r.temperature}: training samples, use > 0")
    require(0 < r.top_p <= 1, f"rollout.top_p={r.top_p}: must be in (0, 1]")
    require(r.top_k >= 0, f"rollout.top_k={r.top_k}: must be >= 0")
    require(
        r.bucket_steps is None or r.bucket_steps in BUCKET_STEPS,
        f"rollout.bucket_steps={r.bucket_steps!r}: expected one of {BUCKET_STEPS} "
        "(None: picked at start-up)",
    )
    require(
        isinstance(r.cache_segments, int) and r.cache_segments >= 1,
        f"rollout.cache_segments={r.cache_segments!r}: must be an integer >= 1 (1 = one loop)",
    )
    require(
        isinstance(r.prefill_chunk, int) and r.prefill_chunk >= 0,
        f"rollout.prefill_chunk={r.prefill_chunk!r}: must be an integer >= 0 (0 = one shot)",
    )
    require(
        r.mode in ROLLOUT_MODES,
        f"rollout.mode={r.mode!r}: expected one of {', '.join(ROLLOUT_MODES)}",
    )
    require(
        isinstance(r.max_staleness, int) and r.max_staleness >= 0,
        f"rollout.max_staleness={r.max_staleness!r}: must be an integer >= 0 (0 = sync)",
    )
    require(
        not r.partial or r.mode == "split",
        f"rollout.partial=True needs rollout.mode='split' (got {r.mode!r})",
    )
    require(
        isinstance(r.partial_chunk, int) and r.partial_chunk >= 1,
        f"rollout.partial_chunk={r.partial_chunk!r}: must be an integer >= 1",
    )
    chunks = -(-r.max_new_tokens // r.partial_chunk)
    require(
        not r.partial or chunks <= MAX_PARTIAL_CHUNKS,
        f"rollout.partial_chunk={r.partial_chunk} cuts rollout.max_new_tokens="
        f"{r.max_new_tokens} into {chunks} chunks, each a decode program to compile; use "
        f"rollout.partial_chunk >= {-(-r.max_new_tokens // MAX_PARTIAL_CHUNKS)} "
        f"(at most {MAX_PARTIAL_CHUNKS} chunks)",
    )
    check_engine(config, process_count)
    check_workers(config)
    if r.workers:
        check_worker_sync(config, process_count)
    if r.workers and config.get("env", {}).get("name"):
        require(
            process_count == 1,
            "env.name with rollout.workers: the environments' turns go to the workers from "
            "a trainer of one process; run the trainer on one host",
        )
    if r.mode == "split" and not r.workers:
        require(
            process_count == 1,
            "rollout.mode='split' with a rollout mesh runs on one host; use 'overlap', or "
            "rollout workers (rollout.workers, docs/workers.md#a-trainer-of-several-hosts)",
        )
        from jaxrl_llm import parallel

        m = config.mesh
        shape = parallel.mesh_shape(mesh_axes(m.rollout), m.rollout_devices)
        check_batch_size("rollout.batch_size", r.batch_size, shape, 1)


def check_workers(config) -> None:
    """rollout.workers and rollout.worker_addresses: N addresses host:port (or @file),
    rollout.worker_timeout_s, worker_start_s, worker_retry_s and worker_tls_ca, split
    mode, LoRA merged (docs/workers.md says what is not built)."""
    r = config.rollout
    n = r.get("workers", 0)
    require(
        isinstance(n, int) and n >= 0,
        f"rollout.workers={n!r}: must be an integer >= 0 (0 = the rollout runs here)",
    )
    if not n:
        return
    require(
        r.mode == "split",
        f"rollout.workers={n}: rollout workers serve rollout.mode='split' (got {r.mode!r})",
    )
    for key, default in (("worker_timeout_s", 600.0), ("worker_start_s", 60.0)):
        seconds = r.get(key, default)
        require(
            isinstance(seconds, int | float) and seconds > 0,
            f"rollout.{key}={seconds!r}: must be a number of seconds > 0",
        )
    retry = r.get("worker_retry_s", 30.0)
    require(
        isinstance(retry, int | float) and retry >= 0,
        f"rollout.worker_retry_s={retry!r}: must be a number of seconds >= 0",
    )
    ca = r.get("worker_tls_ca", "")
    require(
        not ca or os.path.isfile(ca),
        f"rollout.worker_tls_ca={ca!r}: no such file (the PEM file the workers' "
        f"certificates chain to)",
    )
    given = str(r.worker_addresses)
    if given.startswith("@"):  # a file of addresses, read again between steps
        require(
            len(given) > 1,
            "rollout.worker_addresses='@': give the file after @, e.g. @/shared/run/workers",
        )
    else:
        addresses = [a.strip() for a in given.split(",") if a.strip()]
        require(
            len(addresses) == n,
            f"rollout.worker_addresses={given!r}: {len(addresses)} addresses for "
            f"rollout.workers={n}; give 'host:port' of each, comma-separated (or @file)",
        )
        for a in addresses:
            host, _, port = a.rpartition(":")
            require(
                bool(host) and port.isdigit() and 0 < int(port) < 65536,
                f"rollout.worker_addresses: {a!r} is not host:port",
            )
    lora = config.model.lora
    require(
        not lora.get("rank") or lora.get("sampler") != "unmerged",
        "model.lora.sampler='unmerged': rollout workers sample merged weights (each "
        "merges the base and the adapters a sync sends); set it to 'merged' or 'auto'",
    )


def check_worker_sync(config, process_count: int) -> None:
    """rollout.worker_sync: 'host', or 'transfer' where this jax has it, from a trainer of
    one process, without LoRA or TLS (docs/workers.md, "The accelerator path")."""
    r, why = config.rollout, "rollout.worker_sync='transfer'"
    sync = r.get("worker_sync", "host")
    require(
        sync in ("host", "transfer"),
        f"rollout.worker_sync={sync!r}: must be 'host' or 'transfer'",
    )
    if sync != "transfer":
        return
    import importlib.util

    import jax

    require(
        importlib.util.find_spec("jax.experimental.transfer") is not None,
        f"{why}: this jax ({jax.__version__}) has no jax.experimental.transfer; use 'host'",
    )
    require(
        process_count == 1,
        f"{why} offers the weights from a trainer of one process; a trainer of several uses 'host'",
    )
    require(
        not config.model.lora.get("rank"),
        f"{why} sends whole weights: with model.lora use 'host' (the adapters alone)",
    )
    require(
        not r.get("worker_tls_ca", ""),
        f"{why}: the transfer server sends the weights unencrypted; with "
        "rollout.worker_tls_ca use 'host'",
    )


def check_engine(config, process_count: int) -> None:
    """rollout.engine and, for 'paged', its settings and what it does not combine with yet
    (every rollout.mode is served: the rollout thread's stream session in overlap and split;
    environments and the gateway in every mode: `envs.play`, `sampling.serve`,
    played by the rollout thread outside sync, partial rollouts included)."""
    r = config.rollout
    require(
        r.engine in ENGINES, f"rollout.engine={r.engine!r}: expected one of {', '.join(ENGINES)}"
    )
    if r.engine != "paged":
        return
    p = r.paged
    for key in ("slots", "pages"):
        value = p[key]
        ok = isinstance(value, int) and value >= 0
        require(ok, f"rollout.paged.{key}={value!r}: must be an integer >= 0 (0 = automatic)")
    for key in ("page_size", "chunk_steps", "prefill_chunk"):
        value = p[key]
        require(
            isinstance(value, int) and value >= 1,
            f"rollout.paged.{key}={value!r}: must be an integer >= 1",
        )
    names = ("auto", "pages", "gather", "pallas")  # sampling.paged_programs.ATTENTION
    require(
        p.attention in names,
        f"rollout.paged.attention={p.attention!r}: expected one of {', '.join(names)}",
    )
    require(
        p.attention != "pallas" or target.backend() != "cpu",
        "rollout.paged.attention='pallas': the kernel's interpret mode moves data "
        "between host and device, which the trainer's loop forbids on CPU; use 'auto' "
        "(the portable path on CPU)",
    )
    require(
        p.prefill_chunk % p.page_size == 0,
        f"rollout.paged.prefill_chunk={p.prefill_chunk}: must be a multiple of "
        f"rollout.paged.page_size={p.page_size}",
    )
    workers = r.get("workers", 0)
    require(
        process_count == 1,
        "rollout.engine='paged' on a trainer of several processes (each reads its own "
        "prompts); use 'static'"
        + (
            f" (with rollout.workers={workers} the trainer's engine serves its evaluation "
            "only: the workers take --config.rollout.engine=paged on their own command line)"
            if workers
            else ", or rollout workers with the paged engine (docs/workers.md)"
        ),
    )
