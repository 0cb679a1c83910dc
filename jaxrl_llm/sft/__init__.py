"""Supervised fine-tuning (SFT) on prompt -> completion pairs, with the RL trainer's parts.

    python -m jaxrl_llm.sft --config=configs/sft_arithmetic.py --workdir=/tmp/sft \
        [--config.train.num_steps=500 --config.sft.batch_size=32 ...]

From Python (a notebook):

    from jaxrl_llm import sft
    config = sft.default_config()             # or a configs/sft_*.py file's get_config()
    config.model.path = "/path/to/hf_model"   # fine-tune; "" = a new random model
    metrics = sft.run(config, "/tmp/sft")

The config is the RL run config's shared sections (model, mesh, data, rollout, optim,
rewards, train, eval, logging) plus `sft` (`config.py`); the data pipeline, optimizer,
train state, sampler, scorer and evaluation are the RL trainer's. Modules: `config`
(keys and checks), `data` (SFT batches), `model` (tokenizer, new or loaded model),
`trainer` (loss, step, evaluation, loop).

Writes to the workdir: `metrics.jsonl` (one object per log or eval step: `loss/nll`,
`optim/lr`, `optim/grad_norm`, `data/completion_tokens`, `perf/step_s`, `eval/pass@1`,
`eval/pass@k`, ...), TensorBoard events per `logging.tensorboard`, and at the end `hf/`,
a Hugging Face model directory (weights, config, tokenizer) that `models.load_hf`, the RL
trainer (`model.path`) and `transformers` read. A rerun starts over.
"""

from jaxrl_llm.sft.config import RL_ONLY, check_config, default_config


def run(config, workdir: str) -> dict:
    """Trains, evaluates, exports to `workdir/hf`; returns the last metrics (`trainer.run`).

    The trainer is imported here, so that config files can import `default_config`
    without it."""
    from jaxrl_llm.sft import trainer

    return trainer.run(config, workdir)


__all__ = ["RL_ONLY", "check_config", "default_config", "run"]
