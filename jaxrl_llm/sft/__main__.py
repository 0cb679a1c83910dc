"""`python -m jaxrl_llm.sft --config=configs/sft_<task>.py --workdir=DIR [--config.x.y=v]`."""

import sys

from absl import app, flags
from ml_collections import config_flags

from jaxrl_llm.run_config import ConfigError


def main(argv):
    del argv
    from jaxrl_llm import sft
    from jaxrl_llm.parallel import distributed

    distributed.initialize()
    try:
        sft.run(flags.FLAGS.config, flags.FLAGS.workdir)
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None


if __name__ == "__main__":
    from jaxrl_llm.parallel import allocator

    allocator.reexec_with_tcmalloc()
    config_flags.DEFINE_config_file("config", None, "configs/sft_<task>.py", lock_config=True)
    flags.DEFINE_string("workdir", None, "output directory: metrics.jsonl, tensorboard/, hf/")
    flags.mark_flags_as_required(["config", "workdir"])
    try:
        app.run(main)
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        if flags.FLAGS.is_parsed():
            raise  # a failure of the run itself, not of the command line
        # ml_collections reports an unknown --config key as an exception while absl parses
        # the flags: turn it into the one line it means.
        text = str(err).replace("\\n", " ").replace("\\", "").replace("'", "")
        sys.exit(f"error: bad --config override: {' '.join(text.split())}")
