"""`python -m jaxrl_llm.sft --config=configs/sft_<task>.py --workdir=DIR [--config.x.y=v]`.

Any failure is one line `error: ...` on stderr (`--debug` for the traceback)."""

from absl import flags


def main(argv):
    del argv
    from jaxrl_llm import sft
    from jaxrl_llm.parallel import distributed

    distributed.initialize()
    sft.run(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
    from jaxrl_llm.errors import config_command

    config_command(
        main, "configs/sft_<task>.py", "output directory: metrics.jsonl, tensorboard/, hf/"
    )
