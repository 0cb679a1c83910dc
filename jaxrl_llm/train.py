"""The RL trainer: GRPO / DAPO / PPO / ... on a device mesh, from an ml_collections config.

    python -m jaxrl_llm.train --config=configs/quickstart.py --workdir=/tmp/quickstart \
        [--config.algo.beta=0.0 --config.rollout.num_generations=16 ...]

Rerunning the same command resumes from the workdir's latest checkpoint. With
`--compile_for=v6e:2x4` (no --workdir) it compiles the step for that TPU topology and
reports whether it fits and how fast it could be (`jaxrl_llm.tpu.compile_for`;
`--compile_workers_for` adds rollout workers' chips). This module is
the command line only: `train(config, workdir)` (`trainer.loop`) is the same run
in-process, and `Run` (`trainer.run`) the run itself, its step and its jitted programs.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the command line re-runs itself under tcmalloc (where it is
    # installed) before it imports anything heavy: the imports below would be paid twice.
    from jaxrl_llm.parallel import allocator, xla_flags
    from jaxrl_llm.tpu import chips

    COMPILE_ONLY = any(a.split("=")[0] == "--compile_for" for a in sys.argv[1:])
    chips.set_platforms(os.environ, compile_only=COMPILE_ONLY)

    xla_flags.set_cpu_defaults()
    allocator.reexec_with_tcmalloc()

import jax
from absl import logging as absl_logging

from jaxrl_llm.trainer.loop import NonFiniteError, train
from jaxrl_llm.trainer.run import Run

__all__ = ["NonFiniteError", "Run", "train"]


def main(argv):
    del argv
    from absl import flags

    from jaxrl_llm.parallel import allocator, distributed

    if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO
        absl_logging.set_verbosity(absl_logging.WARNING)
    if flags.FLAGS.compile_workers_for and not flags.FLAGS.compile_for:
        sys.exit("--compile_workers_for needs --compile_for=TOPOLOGY (the trainer's chips)")
    if flags.FLAGS.compile_for:  # compile for a TPU topology, run nothing
        from jaxrl_llm.tpu import compile_for

        workers = flags.FLAGS.compile_workers_for
        sys.exit(compile_for.run(flags.FLAGS.config, flags.FLAGS.compile_for, workers))
    distributed.initialize()
    if jax.default_backend() == "cpu" and jax.process_index() == 0:
        if note := allocator.hint():
            print(note, file=sys.stderr, flush=True)
    train(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
    from absl import flags

    from jaxrl_llm.errors import config_command

    flags.DEFINE_string(
        "compile_for",
        None,
        "compile the step for a TPU topology (v6e:2x4, v5p:4x4x4, v5e:16x16*2 for 2 slices) "
        "and report its memory and roofline per chip; runs nothing, needs no --workdir",
    )
    flags.DEFINE_string(
        "compile_workers_for",
        None,
        "with --compile_for and rollout.workers=N: one rollout worker's TPU topology, which "
        "the engine's programs are compiled for (the trainer's topology keeps the rest)",
    )
    config_command(
        main,
        "configs/<experiment>.py",
        "run directory (checkpoints, metrics); reruns resume",
        workdir_required=not COMPILE_ONLY,
    )
