"""The platform and device count the programs being traced are compiled for.

    target.backend()          # "tpu" while compiling for TPU chips from a CPU process
    target.device_count()
    with target.compiling_for(devices): jitted.lower(...).compile()

The model's implementation choices (`model.attention='auto'`, `model.moe_impl='auto'`,
Pallas interpret mode, the paged kernel) follow the chips a program is compiled for.
That is the process's default backend, except in a compile-only run for a TPU topology
(`jaxrl_llm.tpu`), where the process is a CPU one and the devices are described chips.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Sequence

import jax

_TARGET: contextvars.ContextVar = contextvars.ContextVar("compile_target", default=None)


def backend() -> str:
    """The platform traced programs are compiled for ("cpu", "gpu", "tpu")."""
    devices = _TARGET.get()
    return jax.default_backend() if devices is None else devices[0].platform


def device_count() -> int:
    """The number of devices traced programs are compiled for (all processes')."""
    devices = _TARGET.get()
    return jax.device_count() if devices is None else len(devices)


@contextlib.contextmanager
def compiling_for(devices: Sequence[jax.Device]):
    """Within: `backend()` and `device_count()` describe `devices` (e.g. the chips of a
    `jax.experimental.topologies` description) instead of the process's own."""
    token = _TARGET.set(list(devices))
    try:
        yield
    finally:
        _TARGET.reset(token)
