"""Shared benchmark helpers: model presets, a measured matmul peak, timing, memory."""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import time

import jax
import numpy as np

from jaxrl_llm import models
from jaxrl_llm.parallel import allocator
from jaxrl_llm.startup.peak import matmul_peak, measure_matmul_peak  # noqa: F401  (re-exported)
from jaxrl_llm.tpu import chips


def _cpu_where_libtpu_has_no_chips() -> None:
    """As the command line does (`tpu.chips.set_platforms`): with libtpu installed (the
    test extra) on a machine without TPU chips, jax stays on the CPU instead of trying a
    TPU backend and printing libtpu's errors. Benchmarks import this module before any
    jax backend starts, so setting the platform here still takes effect."""
    env = dict(os.environ)
    chips.set_platforms(env)
    if "JAX_PLATFORMS" in env and "JAX_PLATFORMS" not in os.environ:
        os.environ["JAX_PLATFORMS"] = env["JAX_PLATFORMS"]  # the benchmark's subprocesses
        jax.config.update("jax_platforms", env["JAX_PLATFORMS"])


_cpu_where_libtpu_has_no_chips()

PRESETS = {
    # ~25M Qwen3-like: the sampler / GRPO-step benchmarks.
    "25m": dict(
        vocab_size=32768,
        hidden_size=384,
        intermediate_size=1024,
        num_layers=8,
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
    ),
    # ~100M Qwen3-like (tied embeddings, q/k norm, GQA 12/4).
    "100m": dict(
        vocab_size=32768,
        hidden_size=768,
        intermediate_size=2048,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
    ),
    # A tiny Qwen3-like (vocabulary 64: the arithmetic tokenizer's 33 ids fit): long
    # sequences on CPU in seconds (device_check --preset=tiny, an 8k-token GRPO step).
    "tiny": dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    ),
    # Qwen2.5-0.5B shapes, with Qwen3's q/k norm.
    "0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
    ),
}


def config_wrapper(path: str, body: str) -> str:
    """The text of a run-config file whose get_config() takes `path`'s config and runs
    `body` on it (`c`, indented 4 spaces) before returning it."""
    return (
        "import importlib.util\n"
        f'_spec = importlib.util.spec_from_file_location("base", {path!r})\n'
        "_base = importlib.util.module_from_spec(_spec)\n"
        "_spec.loader.exec_module(_base)\n\n\n"
        "def get_config():\n"
        "    c = _base.get_config()\n"
        f"{body}"
        "    return c\n"
    )


def bool_flag(text: str) -> bool:
    """argparse type for --flag=true / false."""
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected true or false")
    return text.lower() in ("true", "1")


def preset_config(name: str) -> models.ModelConfig:
    return models.ModelConfig(
        "Qwen3ForCausalLM",
        qk_norm=True,
        tie_word_embeddings=True,
        rope_theta=1e6,
        max_position_embeddings=32768,
        **PRESETS[name],
    )


def block(x):
    jax.tree.map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)
    return x


def time_fn(fn, *args, repeats: int = 3) -> tuple[float, float]:
    """(compile + first run seconds, median seconds of `repeats` further runs)."""
    t0 = time.perf_counter()
    block(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        block(fn(*args))
        times.append(time.perf_counter() - t0)
    return first, float(np.median(times))


def peak_memory() -> str:
    """Device peak memory when the backend reports it, else this process's peak RSS."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return f"{stats['peak_bytes_in_use'] / 2**30:.2f} GiB device peak"
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return f"{rss_kib / 2**20:.2f} GiB host peak RSS"


def uptime() -> str:
    """The load average says whether other jobs shared the cores during the run."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def cpu_steal_s() -> float:
    """Seconds of CPU time the hypervisor has taken from this VM since boot (all cores;
    the `steal` column of /proc/stat), 0.0 where it is not reported. On shared cloud
    cores it is what makes the same code's step times drift."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def device_name() -> str:
    d = jax.devices()[0]
    name = f"{d.platform}:{getattr(d, 'device_kind', '')} x{jax.device_count()}"
    if d.platform == "cpu":  # the host allocator matters there (jaxrl_llm/parallel/allocator.py)
        name += f", host malloc: {'tcmalloc' if allocator.active() else 'system'}"
    return name


def table(rows: list[dict], columns: list[str]) -> str:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]

    def line(vals):
        return "| " + " | ".join(str(v).ljust(w) for v, w in zip(vals, widths, strict=True)) + " |"

    out = [line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line([r.get(c, "") for c in columns]) for r in rows]
    return "\n".join(out)
