"""Multi-process start-up: `jax.distributed.initialize()` when the launch asks for it."""

from __future__ import annotations

import os

import jax


def initialize() -> None:
    """`jax.distributed.initialize()` when JAXRL_DISTRIBUTED=1 (set by launch/*.sh).

    JAX detects the cluster itself on TPU VM pods, GKE TPU slices and SLURM.
    JAXRL_COORDINATOR / JAXRL_NUM_PROCESSES / JAXRL_PROCESS_ID give it explicitly (e.g.
    several processes on one machine). CPU collectives go through gloo (needed for
    multi-process CPU runs; other backends ignore it).
    """
    if os.environ.get("JAXRL_DISTRIBUTED") != "1":
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    explicit = {}
    if "JAXRL_COORDINATOR" in os.environ:
        explicit = dict(
            coordinator_address=os.environ["JAXRL_COORDINATOR"],
            num_processes=int(os.environ["JAXRL_NUM_PROCESSES"]),
            process_id=int(os.environ["JAXRL_PROCESS_ID"]),
        )
    jax.distributed.initialize(**explicit)
