"""SFT training: the loss, the jitted step, held-out evaluation and the loop.

Each dataset row gives a prompt, built exactly as the RL trainer builds it, and a
completion (`sft.data`). The loss is the next-token negative log-likelihood of the
completion tokens only, averaged over the batch's completion tokens:

    L = - sum_{i, t in completion_i} log pi(y_{i,t} | prompt_i, y_{i,<t}) / sum_i |completion_i|

Prompt tokens and padding carry no loss. Log-probabilities come from the chunked
`rl.token_logprobs`, so [B, T, V] logits are never held at once. The optimizer and the
train state are the RL update's (`rl.optimizer_from_config`, `rl.TrainState`); the
evaluation is the RL trainer's (`evaluation.evaluate`: greedy pass@1 and pass@k, a sample
correct when `evaluation.is_correct`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from jaxrl_llm import config as config_lib
from jaxrl_llm import data, models, parallel, rl, sampling
from jaxrl_llm.rollout import evaluation, scoring
from jaxrl_llm.sft import data as sft_data
from jaxrl_llm.sft import model as sft_model
from jaxrl_llm.sft.config import check_config
from jaxrl_llm.trainer import console

# --------------------------------------------------------------------- loss and update


def sft_loss(cfg, params, batch: sft_data.SFTBatch, chunk_size: int = 128):
    """Mean NLL over completion tokens -> (loss [], number of completion tokens []).

    batch: tokens, mask, loss_mask [B, T]; position t predicts token t + 1."""
    hidden = models.forward(cfg, params, batch.tokens[:, :-1], batch.mask[:, :-1])
    logp, _ = rl.token_logprobs(
        hidden,
        models.unembed_matrix(cfg, params),
        batch.tokens[:, 1:],
        chunk_size=chunk_size,
        softcap=cfg.final_logit_softcapping,
    )
    weight = batch.loss_mask[:, 1:].astype(jnp.float32)
    count = jnp.sum(weight)
    return -jnp.sum(logp * weight) / jnp.maximum(count, 1.0), count


def train_step(cfg, opt: rl.Optimizer, chunk_size: int, state: rl.TrainState, batch):
    """One optimizer step -> (new state, metrics). Pure; jitted by `make_step_fn`."""
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
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def make_step_fn(cfg, opt: rl.Optimizer, chunk_size: int, state: rl.TrainState):
    """`train_step` jitted with the state donated and pinned to its current shardings (an
    output sharded differently would make the next call compile again)."""
    shardings = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(
        functools.partial(train_step, cfg, opt, chunk_size),
        donate_argnums=0,
        out_shardings=(shardings, None),
    )


# ---------------------------------------------------------------------------- evaluation


@dataclasses.dataclass
class HeldOutEval:
    """The fixed held-out prompts, and the sampler and scorer that evaluate a policy on
    them with `evaluation.evaluate` (as the RL trainer does)."""

    sampler: sampling.Sampler
    scorer: scoring.Scorer
    batches: list  # [data.Batch]: the first eval.num_prompts of eval.split, unshuffled
    correct_label: str  # the reward term that decides correctness
    eval_config: ml_collections.ConfigDict  # the `eval` section

    def __call__(self, params, step: int) -> dict[str, float]:
        e = self.eval_config
        metrics = evaluation.evaluate(
            self.sampler,
            params,
            self.batches,
            self.scorer,
            correct_label=self.correct_label,
            pass_k=e.pass_k,
            temperature=e.temperature,
            step=step,
        )
        return parallel.host_mean(metrics)


def held_out_eval(config, model_cfg, tokenizer, pool, mesh=None) -> HeldOutEval:
    """The evaluation of a run: prompts of `eval.split` (or `eval.path`) in batches of
    `rollout.batch_size`, sampled with the `rollout` settings, scored by `rewards` in
    `pool` (a `verifiers.VerifierPool`)."""
    from jaxrl_llm import verifiers

    c = config
    r = c.rollout
    spec = sampling.RolloutSpec(
        max_new_tokens=r.max_new_tokens,
        top_k=r.top_k,
        top_p=r.top_p,
        stop_ids=config_lib.stop_ids(tokenizer, r.stop_tokens),
    )
    sampler = sampling.Sampler(
        model_cfg,
        mesh,
        seed=c.train.seed,
        pad_id=data.pad_id(tokenizer),
        bucket_steps=r.bucket_steps,
        cache_segments=r.cache_segments,
    )
    scorer = scoring.Scorer(tokenizer, pool, verifiers.parse_specs(c.rewards), spec, mesh=mesh)
    return HeldOutEval(
        sampler=sampler,
        scorer=scorer,
        batches=evaluation.held_out_batches(c, tokenizer, r.batch_size),
        correct_label=c.eval.correct_reward or scorer.specs[0].label,
        eval_config=c.eval,
    )


# ----------------------------------------------------------------------------------- run


def run(config, workdir: str) -> dict:
    """Trains, evaluates, exports to `workdir/hf`; returns the last metrics (eval included).

    Writes `metrics.jsonl` (and TensorBoard / W&B per `logging`) in the workdir; a rerun
    starts over (there is no resume: SFT runs here are minutes long)."""
    from jaxrl_llm import verifiers
    from jaxrl_llm.trainer import metrics

    # ---- Config, mesh, tokenizer, model
    c = config = check_config(config, process_count=jax.process_count())
    mesh = parallel.make_mesh(config_lib.mesh_axes(c.mesh))
    tokenizer, tokenizer_dir = sft_model.load_tokenizer(c)
    model_cfg, params = sft_model.init_model(c, tokenizer, mesh)
    # ---- Optimizer, state, update step
    opt = rl.optimizer_from_config(c.optim, c.train.num_steps)
    state = rl.init_train_state(rl.owned(params), opt)  # loaded weights: donatable
    step_fn = make_step_fn(model_cfg, opt, c.train.logprob_chunk, state)
    # ---- Input, evaluation, metrics
    batches = sft_data.sft_batches(c, tokenizer)
    pool = None
    if c.eval.every:  # the verifiers run in worker processes, not in this one
        pool = verifiers.VerifierPool(
            c.train.verifier_workers or None, timeout_s=c.train.verifier_timeout_s
        )
    writer = metrics.MetricWriter(
        workdir,
        c.to_dict(),
        tensorboard=c.logging.tensorboard,
        wandb=c.logging.wandb,
        wandb_project=c.logging.wandb_project,
        run_name=c.logging.run_name or None,
    )
    progress = console.Progress(c.train.num_steps, desc="sft")
    try:
        held_out = held_out_eval(c, model_cfg, tokenizer, pool, mesh) if pool is not None else None
        state, last = _loop(c, state, step_fn, batches, mesh, held_out, writer, progress)
    finally:
        progress.close()
        writer.close()
        if pool is not None:
            pool.close()
    # ---- Export
    models.save_hf(model_cfg, state.params, os.path.join(workdir, "hf"), tokenizer_dir)
    return last


def _loop(c, state, step_fn, batches, mesh, held_out, writer, progress):
    """The training steps with their logging and evaluation -> (state, last metrics).
    Metrics are fetched only at log steps: otherwise async dispatch runs ahead."""
    put = parallel.shard_batch if jax.process_count() == 1 else parallel.shard_local_batch
    num_steps, every = c.train.num_steps, c.eval.every
    last, logged, t0 = {}, 0, time.perf_counter()
    if held_out is not None and c.eval.at_start:
        writer.write(0, last := held_out(state.params, 0))
    for step in range(1, num_steps + 1):
        with _transfer_guard(c.train.transfer_guard):
            state, metrics = step_fn(state, put(next(batches), mesh))
        if step % c.train.log_every == 0 or step == num_steps:
            last = {k: float(v) for k, v in jax.device_get(metrics).items()}
            if not np.isfinite(last["loss/nll"]):
                raise FloatingPointError(f"step {step}: loss/nll is {last['loss/nll']}")
            last["perf/step_s"] = (time.perf_counter() - t0) / (step - logged)
            writer.write(step, last)
            logged, t0 = step, time.perf_counter()
        if held_out is not None and (step % every == 0 or step == num_steps):
            ev = held_out(state.params, step)
            writer.write(step, ev)
            last = last | ev
            progress.write(f"step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in ev.items()))
            t0 = time.perf_counter()  # evaluation time is not step time
        progress.update(step, **({"loss": last["loss/nll"]} if "loss/nll" in last else {}))
    return state, last


def _transfer_guard(on: bool):
    """`jax.transfer_guard("disallow")` around a step: the batch goes over explicitly."""
    return jax.transfer_guard("disallow") if on else contextlib.nullcontext()
