"""Supervised fine-tuning (SFT) on prompt -> completion pairs, with the RL trainer's model code.

    python -m jaxrl_llm.sft --config=configs/sft_arithmetic.py --workdir=/tmp/sft \
        [--config.train.num_steps=500 ...]

From Python (a notebook): `jaxrl_llm.sft.run(config, workdir)`.

Each dataset row gives a prompt, built exactly as the RL trainer builds it (`data` template,
tokenizer, BOS), and a completion, `completion.template` over the row's fields (for
arithmetic `"{answer}"`) followed by EOS. The loss is the next-token negative
log-likelihood of the completion tokens only, averaged over the batch's completion tokens:

    L = - sum_{i, t in completion_i} log pi(y_{i,t} | prompt_i, y_{i,<t}) / sum_i |completion_i|

Prompt tokens and padding carry no loss. Log-probabilities come from the chunked
`rl.token_logprobs`, so [B, T, V] logits are never held at once. Optimizer: AdamW (no decay
on vectors: norms, biases) with linear warmup then cosine decay, global-norm clipping.

Writes to the workdir: `metrics.jsonl` (one object per log or eval step: `loss/nll`,
`optim/lr`, `optim/grad_norm`, `perf/step_s`, `eval/pass@1`, `eval/pass@k`, ...), and at the
end `hf/`, a Hugging Face model directory (weights, config, tokenizer) that
`models.load_hf`, the RL trainer (`model.path`) and `transformers` read. A rerun starts
over (there is no resume: SFT runs here are minutes long).
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import struct

from jaxrl_llm import data, models, parallel, sft_data, sft_eval, verifiers
from jaxrl_llm.errors import UserError
from jaxrl_llm.rl.logprobs import token_logprobs
from jaxrl_llm.rl.optim import Optimizer
from jaxrl_llm.rl.optim import make_optimizer as make_rl_optimizer
from jaxrl_llm.sft_data import SFTBatch

# --------------------------------------------------------------------------------- config


def default_config() -> ml_collections.ConfigDict:
    """Every SFT knob with its default; a config file may set any subset of these keys."""
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict()
    c.model.path = ""  # HF model dir to fine-tune; "" = a new random model from the keys below
    c.model.architecture = "LlamaForCausalLM"  # new model only, like every key down to rope_theta
    c.model.hidden_size = 128
    c.model.intermediate_size = 512
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.num_kv_heads = 4
    c.model.head_dim = 32
    c.model.max_position_embeddings = 256
    c.model.tie_word_embeddings = False
    c.model.rope_theta = 10000.0
    c.model.initializer_range = 0.02  # std of the random init of every weight matrix
    c.model.dtype = "float32"  # parameter dtype
    c.model.remat = "none"  # activation checkpointing: none | full | dots | dots_no_batch
    c.model.scan_layers = True  # False: unroll the layer loop of the training forward
    c.tokenizer = ""  # HF tokenizer dir; "" = model.path
    c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})
    c.data = data.default_config()  # the RL trainer's data section: same prompts
    c.completion = ml_collections.ConfigDict()
    c.completion.template = "{answer}"  # over the row's fields; EOS is appended
    c.completion.max_len = 8  # tokens, EOS included; sequences are max_prompt_len + this
    # A second completion style for a share of the rows (fixed per row by data.seed and the
    # row index), e.g. a flawed teacher: "{answer}{answer}" repeats the answer, which the
    # gsm8k check scores 0. "" / 0.0 = off.
    c.completion.alt_template = ""
    c.completion.alt_prob = 0.0
    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-3
    c.optim.warmup_steps = 100
    c.optim.end_lr_ratio = 0.0  # cosine decays to learning_rate * this
    c.optim.weight_decay = 0.01
    c.optim.b1 = 0.9
    c.optim.b2 = 0.98
    c.optim.eps = 1e-8
    c.optim.max_grad_norm = 1.0
    c.train = ml_collections.ConfigDict()
    c.train.num_steps = 1000
    c.train.batch_size = 128  # sequences per step (global)
    c.train.seed = 0  # parameter init of a new model
    c.train.log_every = 50
    c.train.logprob_chunk = 128  # sequence chunk of the log-prob computation
    c.eval = ml_collections.ConfigDict()
    c.eval.every = 0  # steps; 0 = only after the last step
    c.eval.split = "test"  # held-out split, same dataset as data.name
    c.eval.path = ""  # held-out JSONL file when data.source="jsonl"
    c.eval.num_examples = 256  # the first rows of the split (a fixed set)
    c.eval.num_samples = 8  # k of pass@k at eval.temperature; 0 = greedy only
    c.eval.temperature = 1.0
    c.eval.rewards = ml_collections.ConfigDict({"gsm8k": 1.0})  # as RL's; correct: reward >= 1
    c.eval.batch_size = 256  # prompts per generate call
    c.eval.seed = 0
    return c


class ConfigError(UserError, ValueError):
    """A config key that is unknown, of the wrong type, or inconsistent; names the key."""


def _check_keys(given, defaults, prefix: str) -> None:
    for key in given.keys():
        name = f"{prefix}{key}"
        if key not in defaults:
            raise ConfigError(f"{name}: unknown key; known keys: {sorted(defaults.keys())}")
        value, default = given[key], defaults[key]
        if isinstance(default, ml_collections.ConfigDict):
            if not isinstance(value, ml_collections.ConfigDict | dict):
                raise ConfigError(f"{name}: expected a section, got {value!r}")
            if name not in ("mesh", "data.fields", "eval.rewards"):  # free-form sections
                _check_keys(value, default, name + ".")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{name}: expected a number, got {value!r}")
        elif type(value) is not type(default):
            raise ConfigError(f"{name}: expected {type(default).__name__}, got {value!r}")


def check_config(config) -> ml_collections.ConfigDict:
    """The config with defaults filled in; raises ConfigError naming the first bad key."""
    _check_keys(config, default_config(), "")
    c = default_config()
    c.update(config)
    try:
        data.check_config(c.data)
        mesh_shape = parallel.mesh_shape(dict(c.mesh), jax.device_count(), "mesh")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    checks = [
        (c.model.path or c.tokenizer, "tokenizer: required when training a new model"),
        (c.train.num_steps >= 1, "train.num_steps: must be >= 1"),
        (c.train.log_every >= 1, "train.log_every: must be >= 1"),
        (c.completion.max_len >= 1, "completion.max_len: must be >= 1"),
        (0 <= c.completion.alt_prob <= 1, "completion.alt_prob: must be in [0, 1]"),
        (c.completion.alt_template or not c.completion.alt_prob, "completion.alt_template: empty"),
        (c.optim.learning_rate > 0, "optim.learning_rate: must be > 0"),
        (0 <= c.optim.warmup_steps < c.train.num_steps, "optim.warmup_steps: in [0, num_steps)"),
        (0 <= c.optim.end_lr_ratio <= 1, "optim.end_lr_ratio: must be in [0, 1]"),
        (c.optim.weight_decay >= 0, "optim.weight_decay: must be >= 0"),
        (c.eval.every >= 0 and c.eval.num_samples >= 0, "eval.every / num_samples: >= 0"),
        (c.eval.num_examples >= 1 and c.eval.batch_size >= 1, "eval.num_examples: >= 1"),
        (c.data.source != "jsonl" or c.eval.path, "eval.path: required when data.source=jsonl"),
        (
            c.train.batch_size % (mesh_shape[0] * mesh_shape[1] * jax.process_count()) == 0,
            f"train.batch_size={c.train.batch_size}: not divisible by mesh data x fsdp x "
            f"processes = {mesh_shape[0] * mesh_shape[1] * jax.process_count()}",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    try:
        verifiers.parse_specs(c.eval.rewards)
    except ValueError as err:
        raise ConfigError(f"eval.rewards: {err}") from None
    return c


# ------------------------------------------------------------------------ loss and update


def sft_loss(cfg, params, batch: SFTBatch, chunk_size: int = 128):
    """Mean NLL over completion tokens -> (loss, number of completion tokens)."""
    hidden = models.forward(cfg, params, batch.tokens[:, :-1], batch.mask[:, :-1])
    logp, _ = token_logprobs(
        hidden, models.unembed_matrix(cfg, params), batch.tokens[:, 1:], chunk_size=chunk_size
    )
    weight = batch.loss_mask[:, 1:].astype(jnp.float32)  # token t+1 is predicted at t
    count = jnp.sum(weight)
    return -jnp.sum(logp * weight) / jnp.maximum(count, 1.0), count


@struct.dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: optax.OptState


def make_optimizer(optim, num_steps: int) -> Optimizer:
    """The RL update's AdamW (`rl.optim`: clipping, no decay of norm scales and biases)
    with warmup then cosine decay to learning_rate * end_lr_ratio at num_steps."""
    return make_rl_optimizer(
        learning_rate=optim.learning_rate,
        warmup_steps=optim.warmup_steps,
        total_steps=num_steps,
        schedule="cosine",
        weight_decay=optim.weight_decay,
        b1=optim.b1,
        b2=optim.b2,
        eps=optim.eps,
        max_grad_norm=optim.max_grad_norm,
        end_lr_ratio=optim.end_lr_ratio,
    )


def train_step(cfg, opt: Optimizer, chunk_size: int, state: TrainState, batch: SFTBatch):
    """One optimizer step -> (new state, metrics). Pure; jitted by `run`."""
    grad_fn = jax.value_and_grad(lambda p: sft_loss(cfg, p, batch, chunk_size), has_aux=True)
    (loss, count), grads = grad_fn(state.params)
    lr = opt.schedule(state.step)
    params, opt_state = opt.step(grads, state.opt_state, state.params, lr)
    metrics = {
        "loss/nll": loss,
        "optim/grad_norm": optax.tree.norm(grads),
        "optim/lr": lr,
        "data/completion_tokens": count,
    }
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


# ---------------------------------------------------------------------------------- model


def load_tokenizer(config):
    from transformers import AutoTokenizer

    path = config.tokenizer or config.model.path
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer: {path} has no EOS token to end completions with")
    return tokenizer, path


def new_model_config(model, tokenizer) -> models.ModelConfig:
    """A ModelConfig for a random model sized by `config.model`, vocabulary = tokenizer's.

    The token ids go into the exported config.json, so `transformers.generate` knows EOS."""
    cfg = models.ModelConfig(
        architecture=model.architecture,
        vocab_size=len(tokenizer),
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_layers=model.num_layers,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        max_position_embeddings=model.max_position_embeddings,
        tie_word_embeddings=model.tie_word_embeddings,
        rope_theta=float(model.rope_theta),
        initializer_range=float(model.initializer_range),
        rms_norm_eps=1e-6,
        qk_norm=model.architecture == "Qwen3ForCausalLM",
        qkv_bias=model.architecture == "Qwen2ForCausalLM",
    )
    hf = cfg.to_hf_dict()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        hf[name] = getattr(tokenizer, name)
    return cfg.replace(hf_config=json.dumps(hf, sort_keys=True))


def init_model(config, tokenizer, mesh):
    """(ModelConfig, params): loaded from model.path, or new and random."""
    m = config.model
    runtime = dict(remat=m.remat, scan_layers=bool(m.scan_layers))
    if m.path:
        return models.load_hf(m.path, mesh=mesh, dtype=m.dtype, **runtime)
    try:
        cfg = new_model_config(m, tokenizer).replace(**runtime)
    except ValueError as err:
        raise ConfigError(f"model: {err}") from None
    return cfg, models.init_params(cfg, config.train.seed, mesh, m.dtype)


# ------------------------------------------------------------------------------------ run


class _Metrics:
    """metrics.jsonl in the workdir (process 0 writes), one object per call."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.write = jax.process_index() == 0
        if self.write:
            open(self.path, "w").close()  # a rerun starts over

    def __call__(self, step: int, metrics: dict) -> None:
        if self.write:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")


def _evaluate(config, cfg, params, tokenizer, eval_set, pool, mesh, step: int) -> dict:
    e = config.eval
    return sft_eval.evaluate(
        cfg, params, tokenizer, eval_set, pool, e.rewards,
        max_new_tokens=config.completion.max_len, num_samples=e.num_samples,
        temperature=e.temperature, batch_size=e.batch_size, seed=e.seed, step=step, mesh=mesh,
    )  # fmt: skip


def _state_and_step(config, cfg, params, mesh):
    """The initial TrainState on the mesh and the jitted update (state donated)."""
    opt = make_optimizer(config.optim, config.train.num_steps)
    state = TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=jax.jit(opt.init)(params)
    )
    # Scalars (step, Adam's count) are placed on the mesh too: the step's outputs are, and
    # an input sharding that differs on the second call would compile the step again.
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shardings = jax.tree.map(
        lambda x: x.sharding if isinstance(x.sharding, jax.sharding.NamedSharding) else replicated,
        state,
    )
    step_fn = jax.jit(
        lambda s, b: train_step(cfg, opt, config.train.logprob_chunk, s, b),
        donate_argnums=0,
        out_shardings=(shardings, None),
    )
    return jax.device_put(state, shardings), step_fn


def run(config, workdir: str) -> dict:
    """Trains, evaluates, exports to `workdir/hf`; returns the last metrics (eval included)."""
    from tqdm import tqdm

    # ---- Config, mesh, tokenizer, model
    config = check_config(config)
    os.makedirs(workdir, exist_ok=True)
    mesh = parallel.make_mesh(dict(config.mesh))
    tokenizer, tokenizer_dir = load_tokenizer(config)
    cfg, params = init_model(config, tokenizer, mesh)
    length = config.data.max_prompt_len + config.completion.max_len
    if length > cfg.max_position_embeddings:
        raise ConfigError(
            f"data.max_prompt_len + completion.max_len = {length} exceeds the model's "
            f"max_position_embeddings {cfg.max_position_embeddings}"
        )
    # ---- Input: training batches and the fixed held-out set
    batches = sft_data.sft_batches(config, tokenizer)
    eval_data = ml_collections.ConfigDict(config.data.to_dict())
    eval_data.path = config.eval.path
    eval_set = sft_eval.load_eval_set(
        eval_data, tokenizer, config.eval.split, config.eval.num_examples
    )
    state, step_fn = _state_and_step(config, cfg, params, mesh)
    put = parallel.shard_batch if jax.process_count() == 1 else parallel.shard_local_batch
    # ---- Loop: metrics are fetched only at log steps (async dispatch runs ahead otherwise)
    write, last, logged, t0 = _Metrics(workdir), {}, 0, time.perf_counter()
    num_steps, every = config.train.num_steps, config.eval.every
    with verifiers.VerifierPool(workers=1, timeout_s=10.0) as pool:
        bar = tqdm(range(1, num_steps + 1), desc="sft", disable=jax.process_index() != 0)
        for step in bar:
            state, metrics = step_fn(state, put(next(batches), mesh))
            if step % config.train.log_every == 0 or step == num_steps:
                last = {k: float(v) for k, v in jax.device_get(metrics).items()}
                if not np.isfinite(last["loss/nll"]):
                    raise FloatingPointError(f"step {step}: loss is {last['loss/nll']}")
                last["perf/step_s"] = (time.perf_counter() - t0) / (step - logged)
                write(step, last)
                bar.set_postfix(loss=f"{last['loss/nll']:.4f}")
                logged, t0 = step, time.perf_counter()
            if (every and step % every == 0) or step == num_steps:
                ev = _evaluate(config, cfg, state.params, tokenizer, eval_set, pool, mesh, step)
                write(step, ev)
                last.update(ev)
                bar.write(f"step {step}: " + ", ".join(f"{k}={v}" for k, v in ev.items()))
                t0 = time.perf_counter()  # eval time is not step time
    # ---- Export
    models.save_hf(cfg, state.params, os.path.join(workdir, "hf"), tokenizer_dir=tokenizer_dir)
    return last


def main(argv):
    del argv
    from absl import flags

    try:
        run(flags.FLAGS.config, flags.FLAGS.workdir)
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    from jaxrl_llm import allocator

    allocator.reexec_with_tcmalloc()
    config_flags.DEFINE_config_file("config", None, "configs/sft_<task>.py", lock_config=True)
    flags.DEFINE_string("workdir", None, "output directory: metrics.jsonl and hf/")
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)
