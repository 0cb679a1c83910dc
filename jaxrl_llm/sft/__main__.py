"""`python -m jaxrl_llm.sft --config=configs/sft_<task>.py --workdir=DIR [--config.x.y=v]`.

Any failure is one line `error: ...` on stderr (`--debug` for the traceback)."""

from absl import flags
from ml_collections import config_flags


def main(argv):
    del argv
    from jaxrl_llm import sft
    from jaxrl_llm.parallel import distributed

    distributed.initialize()
    sft.run(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
    from jaxrl_llm.errors import cli_main, run_absl
    from jaxrl_llm.parallel import allocator

    allocator.reexec_with_tcmalloc()
    config_flags.DEFINE_config_file("config", None, "configs/sft_<task>.py", lock_config=True)
    flags.DEFINE_string("workdir", None, "output directory: metrics.jsonl, tensorboard/, hf/")
    flags.mark_flags_as_required(["config", "workdir"])
    cli_main(lambda: run_absl(main))
