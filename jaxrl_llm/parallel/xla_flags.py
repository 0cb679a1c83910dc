"""XLA flags the command line sets before jax starts, where jax can only use the CPU.

    xla_flags.set_cpu_defaults()   # in a __main__ block, before any jax backend exists

`--xla_backend_optimization_level=1`. XLA:CPU compiles each fusion of a program into its
own kernel through LLVM, and LLVM's optimisation passes over those kernels are most of a
cold start's compile time. At level 1 they compile faster while the steps take as long:
the matrix products, where the time goes, run in YNNPACK's prebuilt kernels, which the
level does not touch (measured: benchmarks/RESULTS.md, "Start-up"). The test suite,
whose models are tiny, compiles at -O0 (tests/conftest.py).

XLA reads `XLA_FLAGS` once, when jax creates its first backend, so the flag goes into the
environment before that, and only where it cannot reach an accelerator's compiler (where
the level also drives GPU kernel generation): when `JAX_PLATFORMS` names only `cpu`, or
when no accelerator plugin is installed (no `jax_plugins` entry point or module, no
`libtpu`, no `TPU_LIBRARY_PATH`). A flag already in `XLA_FLAGS` is left as it is: a
user's own level wins. Code that uses the library in-process gets the same by calling
`set_cpu_defaults()` before it first uses jax (the quickstart notebook does), or with
`XLA_FLAGS=--xla_backend_optimization_level=1`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pkgutil

LEVEL = "--xla_backend_optimization_level"
CPU_DEFAULTS = {LEVEL: "1"}


def accelerator_plugins(environ) -> list[str]:
    """The accelerator backends jax could load besides its CPU (plugin names)."""
    found = [ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")]
    # The `jax_plugins` namespace package: one module per plugin installed that way.
    if (spec := importlib.util.find_spec("jax_plugins")) is not None:
        found += [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations or [])]
    if environ.get("TPU_LIBRARY_PATH") or importlib.util.find_spec("libtpu") is not None:
        found.append("tpu")
    return found


def cpu_only(environ) -> bool:
    """Whether jax can only pick its CPU backend in a process with this environment."""
    platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return all(p == "cpu" for p in platforms)
    return not accelerator_plugins(environ)


def named(flag: str, environ=os.environ) -> str | None:
    """The value `XLA_FLAGS` gives `flag` (the last one where several do), or None."""
    values = [w.split("=", 1) for w in environ.get("XLA_FLAGS", "").split()]
    return next((v[1] if len(v) > 1 else "" for v in reversed(values) if v[0] == flag), None)


def with_cpu_defaults(environ) -> str | None:
    """The `XLA_FLAGS` value with the CPU defaults added, or None when nothing changes:
    an accelerator is reachable, or every default is already named there."""
    flags = environ.get("XLA_FLAGS", "")
    missing = [f"{k}={v}" for k, v in CPU_DEFAULTS.items() if named(k, environ) is None]
    if not missing or not cpu_only(environ):
        return None
    return " ".join([*flags.split(), *missing])


def set_cpu_defaults() -> None:
    """Adds the CPU defaults to this process's `XLA_FLAGS` (see the module doc). Call it
    before jax creates a backend: XLA reads the flags then, once."""
    flags = with_cpu_defaults(os.environ)
    if flags is not None:
        os.environ["XLA_FLAGS"] = flags
