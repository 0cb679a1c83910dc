"""The matmul peak that MFU divides by (`trainer.perf`), measured on the device in use,
once per machine, and kept next to the compilation cache, so that start-up does not
measure it again and every run on the machine has the same denominator.

    peak = device_peak("float32", cache_dir)      # FLOP/s; cache_dir None: measured now
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

_PACKAGES = ("jax", "jaxlib", "numpy", "ml_dtypes")


def measure_matmul_peak(dtype: str = "float32", n: int = 2048, repeats: int = 5) -> float:
    """Measured dense matmul FLOP/s of the default device at this dtype (a fresh
    measurement; `matmul_peak` is the same, measured once per process)."""
    # Drawn on the host: jax.random here would be programs to compile at start-up.
    rng = np.random.default_rng(0)
    a, b = (
        jax.device_put(rng.standard_normal((n, n), np.float32).astype(jnp.dtype(dtype)))
        for _ in range(2)
    )
    f = jax.jit(lambda a, b: (a @ b) @ b)  # two matmuls per call amortise dispatch
    f(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * 2 * n**3 / float(np.median(times))


matmul_peak = functools.lru_cache(maxsize=4)(measure_matmul_peak)


def device_peak(dtype: str, cache_dir: str | None) -> float:
    """The device's measured matmul FLOP/s at `dtype`: kept in `cache_dir` when given. A
    CPU reaches its peak at 1024^3, an eighth of the accelerators' size's cost."""
    size = 1024 if jax.default_backend() == "cpu" else 2048
    if cache_dir:
        return kept_matmul_peak(dtype, size, cache_dir)
    return matmul_peak(dtype, size)


KEPT_PEAKS = 32  # measurements kept in a directory's matmul_peak.json, the latest


def kept_matmul_peak(dtype: str, n: int, directory: str) -> float:
    """`matmul_peak(dtype, n)`, measured once for this machine and software and kept
    in `directory`/matmul_peak.json, keyed by `fingerprint()`: a later process with the
    same key reads it instead of measuring again. A file that cannot be read or written
    only costs the measurement."""
    path = os.path.join(directory, "matmul_peak.json")
    key = f"{fingerprint()} {dtype} {n}"
    try:
        with open(path, encoding="utf-8") as f:
            kept = json.load(f)
    except (OSError, ValueError):
        kept = {}
    if not isinstance(kept, dict):
        kept = {}
    value = kept.get(key)
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    peak = matmul_peak(dtype, n)
    kept.pop(key, None)
    kept[key] = peak
    kept = dict(list(kept.items())[-KEPT_PEAKS:])
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(kept, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass
    return peak


@functools.cache
def fingerprint() -> str:
    """What the measurement depends on: the packages that compile it, XLA_FLAGS, the
    devices and the host CPU."""
    h = hashlib.sha256(b"jaxrl_llm matmul peak 2")
    for package in _PACKAGES:
        try:
            h.update(f"{package}={importlib.metadata.version(package)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{package}=absent".encode())
    h.update(os.environ.get("XLA_FLAGS", "").encode())
    h.update(os.environ.get("LIBTPU_INIT_ARGS", "").encode())
    devices = jax.devices()
    h.update(f"{devices[0].client.platform_version}|{jax.process_count()}".encode())
    h.update(repr([(d.id, d.device_kind, d.process_index) for d in devices]).encode())
    h.update(_host_cpu().encode())
    return h.hexdigest()


def _host_cpu() -> str:
    """The host CPU's model and instruction-set flags (a cache directory shared between
    machines, a network home, must not hand one machine's figure to another)."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n\n")[0].splitlines()
    except OSError:
        return text + platform.processor()
    keep = ("model name", "flags", "Features", "CPU part")
    return text + "".join(line for line in lines if line.split(":")[0].strip() in keep)
