"""The jitted GRPO / PPO update step: rollout batch in, new parameters and metrics out.

    opt = make_optimizer(learning_rate=1e-6, max_grad_norm=1.0)
    state = init_train_state(params, opt)
    update = make_update_fn(model_cfg, algo_cfg, opt, spec, micro_batches=4, seed=0)
    state, metrics = update(state, RolloutBatch.from_sample(sample_output, rewards, ref_logprobs))

`spec` is the rollout's `sampling.RolloutSpec`: its temperature is the one the log-probs
are taken at, its num_generations (G) the group size, its max_new_tokens Dr. GRPO's L_max.

One call of `update` (one TRAINER step; `state.step` counts these) does, on device:

1. old_logp: on-policy (num_iterations == 1 and mini_batches == 1) the ratio is exactly 1
   (pi_old = sg(pi_theta), no extra forward). Otherwise, and whenever the KL is folded into
   the reward (beta > 0, kl_in_reward), pi_old is recomputed once with the params the call
   starts from, without gradient. PPO: the critic's rollout-time values V_old likewise.
2. Advantages on the whole batch (`rl.compute_advantages`).
3. num_iterations passes (mu in GRPO); each pass permutes the rows with a key derived from
   (seed, state.step) (PureJaxRL style: permutation, then reshape) and takes `mini_batches`
   optimizer steps. A step sums the gradients of `micro_batches` row slices (`lax.scan`),
   each divided by the aggregation denominator of the whole mini-batch
   (`rl.loss_denominator`), so the sum is exactly the mini-batch gradient.
4. Non-finite loss or gradient: with skip_nonfinite the step is dropped (params and
   optimizer state unchanged); either way `optim/nonfinite` = 1.
5. PPO: for state.step < critic_warmup_steps only the critic moves; the policy params and
   optimizer state are selected unchanged (bit-identical).

Shared prompts (G > 1, the G samples of a prompt consecutive): the
pi_old recompute reads each prompt once, and with mini_batches == 1 so does the
forward + backward: the prompts run once before the micro-batches, each micro-batch's
completions attend to their group's keys/values, the keys/values' cotangents are summed
over the micro-batches and one backward through the prompts follows.

Packing (`packing`, docs/packing.md): the forwards that run whole rows (no shared prompt)
lay each micro-batch's rows end to end in fewer sequences (`rl.packing`) and gather the
log-probs back to the rows, so the loss is computed on the same [N, T] arrays. Context
parallelism: on a mesh whose `context` axis is > 1 the program is traced with that mesh
set, so the model's forward splits each sequence over it (docs/sharding.md).

Optimizer steps per call = num_iterations * mini_batches; the learning rate is
opt.schedule(state.step) for all of them (see optim.py).

Rows are split into mini- / micro-batches by stride (slice j holds rows j, j + k, ...), so
each slice keeps an even share of every device's rows when the batch is sharded over
('data', 'fsdp').
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import models
from jaxrl_llm.models import lora
from jaxrl_llm.parallel.mesh import batch_size_multiple
from jaxrl_llm.rl import critic as critic_lib
from jaxrl_llm.rl.advantages import compute_advantages, distillation_metrics
from jaxrl_llm.rl.algos import AlgoConfig, check_num_generations
from jaxrl_llm.rl.batch import (
    RolloutBatch,
    batch_logprobs,
    context_mesh,
    make_logprob_fn,
    sequence_logprobs,
)
from jaxrl_llm.rl.gradients import Carry, Rows, Setup, gradients, reduce_metrics
from jaxrl_llm.rl.losses import masked_mean
from jaxrl_llm.rl.optim import Optimizer, make_optimizer
from jaxrl_llm.rl.packing import DEFAULT_CAPACITY, resolve_packing
from jaxrl_llm.rl.prefix import check_groups, map_rows, split_rows
from jaxrl_llm.rl.state import TrainState, init_train_state
from jaxrl_llm.sampling.spec import RolloutSpec

__all__ = [
    "RolloutBatch",
    "TrainState",
    "UpdateFn",
    "init_train_state",
    "make_logprob_fn",
    "make_optimizer",
    "make_update_fn",
    "sequence_logprobs",
]

_sg = jax.lax.stop_gradient


_DROPOUT_STREAM = 0x64726F70  # "drop": LoRA dropout keys, apart from the permutation's


def _batch_metrics(adv, mask, returns, old_values) -> dict:
    """Exact full-batch statistics: advantages; PPO's rollout-time values (CleanRL-style
    explained variance 1 - Var(R - V) / Var(R))."""
    valid = mask.astype(bool)
    mean = masked_mean(adv, valid)
    some = jnp.any(valid)
    out = {
        "adv/mean": mean,
        "adv/std": jnp.sqrt(masked_mean(jnp.square(adv - mean), valid)),
        "adv/min": jnp.where(some, jnp.min(jnp.where(valid, adv, jnp.inf)), 0.0),
        "adv/max": jnp.where(some, jnp.max(jnp.where(valid, adv, -jnp.inf)), 0.0),
    }
    if old_values is not None:
        var = lambda x: masked_mean(jnp.square(x - masked_mean(x, valid)), valid)  # noqa: E731
        r_var = var(returns)
        out["value/mean"] = masked_mean(old_values, valid)
        out["value/explained_variance"] = jnp.where(
            r_var > 0, 1.0 - var(returns - old_values) / r_var, 0.0
        )
    return out


def _select(pred, new, old):
    """new where pred, else old. A pred that is True in Python selects nothing: a traced
    select keeps the old parameters and moments alive beside the new ones, so XLA copies
    the moments before updating them in place (a float32 copy of the optimizer state in
    the update's peak memory)."""
    if pred is True:
        return new
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)


def _optimizer_step(s: Setup, step, policy_on, frozen, dropout, carry: Carry, xs):
    """One optimizer step on mini-batch xs = (rows, j) -> (new carry, metrics).
    dropout: the pass's LoRA dropout key (mini-batch j folds in j), or None."""
    rows, j = xs
    key = None if dropout is None else jax.random.fold_in(dropout, j)
    grads, metrics = gradients(s, carry, rows, frozen, key)
    norm = optax.tree.norm(grads["policy"])
    finite = jnp.isfinite(metrics["loss/total"]) & jnp.isfinite(norm)
    metrics["optim/grad_norm"] = norm
    if "critic" in grads:
        c_norm = optax.tree.norm(grads["critic"])
        finite &= jnp.isfinite(metrics["loss/value"]) & jnp.isfinite(c_norm)
        metrics["optim/critic_grad_norm"] = c_norm
    metrics["optim/nonfinite"] = 1.0 - finite.astype(jnp.float32)
    apply = finite if s.skip_nonfinite else True
    params, opt_state = s.opt.step(
        grads["policy"], carry.opt_state, carry.params, s.opt.schedule(step)
    )
    keep_old = (carry.params, carry.opt_state)
    gate = apply if policy_on is True else policy_on & apply
    params, opt_state = _select(gate, (params, opt_state), keep_old)
    new = carry.replace(params=params, opt_state=opt_state)
    if "critic" in grads:
        c_params, c_state = s.critic_opt.step(
            grads["critic"],
            carry.critic_opt_state,
            carry.critic_params,
            s.critic_opt.schedule(step),
        )
        c_old = (carry.critic_params, carry.critic_opt_state)
        c_params, c_state = _select(apply, (c_params, c_state), c_old)
        new = new.replace(critic_params=c_params, critic_opt_state=c_state)
    return new, metrics


def _prepare(s: Setup, state: TrainState, batch: RolloutBatch, frozen) -> Rows:
    """Steps 1-2 of the module doc: pi_old, V_old (no gradient) and the advantages."""
    k = s.micro_batches * s.mini_batches  # the forward of one micro-batch at a time
    inputs = (batch.prompt_tokens, batch.prompt_mask, batch.tokens, batch.mask)
    old_logp = old_values = None
    G = s.num_generations
    grouped = G > 1 and batch.tokens.shape[1] > 1
    if s.needs_old_logp:
        old_logp = batch_logprobs(
            s.model_cfg,
            lora.combine(frozen, state.params),
            *inputs,
            num_generations=s.prompt_group,
            micro_batches=k,
            temperature=s.spec.logprob_temperature,
            chunk_size=s.chunk_size,
            packing=s.packing,
            routes=s.replayed(batch.routes),
        )
    if s.algo.uses_critic:
        values = functools.partial(critic_lib.values, s.model_cfg, state.critic_params)
        old_values = _sg(map_rows(lambda r: values(*r), inputs, k))
    adv = compute_advantages(
        s.algo,
        batch.rewards,
        batch.loss_mask,
        G,
        old_logp=old_logp,
        ref_logp=batch.ref_logprobs,
        values=old_values,
        teacher_logp=batch.teacher_logprobs,
        behaviour_logp=batch.behaviour_logprobs,
    )
    return Rows(
        prompt_tokens=batch.prompt_tokens,
        prompt_mask=batch.prompt_mask,
        tokens=batch.tokens,
        mask=batch.mask,
        loss_mask=batch.loss_mask,
        behaviour_logp=batch.behaviour_logprobs,
        advantages=adv.advantages,
        old_logp=old_logp,
        ref_logp=batch.ref_logprobs,
        returns=adv.returns,
        old_values=old_values,
        groups=batch.group_ids if grouped and s.shares_prompts else None,
        routes=batch.routes,
    )


def _check(s: Setup, state: TrainState, batch: RolloutBatch) -> None:
    """Shape and configuration errors, raised while tracing, naming what is wrong."""
    n = batch.tokens.shape[0]
    k = s.micro_batches * s.mini_batches
    if n % k:
        raise ValueError(f"batch of {n} rows is not divisible by mini_batches x micro_batches={k}")
    if batch.num_generations != s.num_generations:
        raise ValueError(
            f"batch.num_generations={batch.num_generations}: the update was made for "
            f"spec.num_generations={s.num_generations}"
        )
    check_groups(n, s.num_generations, "update")
    if s.algo.needs_ref and batch.ref_logprobs is None:
        raise ValueError(f"algo.beta={s.algo.beta} > 0 needs batch.ref_logprobs")
    if s.algo.distill_coef > 0 and batch.teacher_logprobs is None:
        raise ValueError("algo.distill_coef > 0 (a teacher) needs batch.teacher_logprobs")
    if s.algo.uses_critic and state.critic_params is None:
        raise ValueError("algo.advantage='gae' needs a critic: init_train_state(critic_params=)")


def _update(s: Setup, state: TrainState, batch: RolloutBatch, frozen=None):
    """state, batch -> (new state, metrics). See the module doc. frozen: LoRA's base
    weights (state.params are then the adapters)."""
    _check(s, state, batch)
    rows = _prepare(s, state, batch, frozen)
    policy_on = True  # static where it always holds (see `_select`)
    if s.algo.uses_critic and s.algo.critic_warmup_steps > 0:
        policy_on = state.step >= s.algo.critic_warmup_steps
    key = jax.random.fold_in(jax.random.key(s.seed), state.step)
    drop_key = None  # LoRA dropout: its own stream of train.seed, one key per step and pass
    if s.lora_dropout:
        drop_key = jax.random.fold_in(jax.random.key(s.seed), _DROPOUT_STREAM)
        drop_key = jax.random.fold_in(drop_key, state.step)
    n = batch.tokens.shape[0]

    def one_pass(carry, i):
        r = rows
        if s.mini_batches > 1:  # a fresh split into mini-batches on every pass
            perm = jax.random.permutation(jax.random.fold_in(key, i), n)
            r = jax.tree.map(lambda x: jnp.take(x, perm, axis=0), rows)
        dropout = None if drop_key is None else jax.random.fold_in(drop_key, i)
        step = functools.partial(_optimizer_step, s, state.step, policy_on, frozen, dropout)
        xs = (split_rows(r, s.mini_batches), jnp.arange(s.mini_batches))
        return jax.lax.scan(step, carry, xs)

    carry = Carry(
        params=state.params,
        opt_state=state.opt_state,
        critic_params=state.critic_params,
        critic_opt_state=state.critic_opt_state,
    )
    carry, metrics = jax.lax.scan(one_pass, carry, jnp.arange(s.algo.num_iterations))
    metrics = reduce_metrics(metrics, sum_losses=False)
    metrics.update(_batch_metrics(rows.advantages, rows.loss_mask, rows.returns, rows.old_values))
    if batch.teacher_logprobs is not None:  # on-policy distillation (advantages.py)
        metrics.update(distillation_metrics(batch, rows.loss_mask))
    metrics["optim/lr"] = s.opt.schedule(state.step)
    new_state = TrainState(
        step=state.step + 1,
        params=carry.params,
        opt_state=carry.opt_state,
        critic_params=carry.critic_params,
        critic_opt_state=carry.critic_opt_state,
    )
    return new_state, metrics


def make_update_fn(
    model_cfg: models.ModelConfig,
    algo_cfg: AlgoConfig,
    opt: Optimizer,
    spec: RolloutSpec,
    micro_batches: int = 1,
    mini_batches: int = 1,
    chunk_size: int = 128,
    critic_optimizer: Optimizer | None = None,
    skip_nonfinite: bool = False,
    seed: int = 0,
    share_prompts: bool = True,
    packing="off",
    packing_capacity: float = DEFAULT_CAPACITY,
) -> UpdateFn:
    """The jitted `update(state, batch) -> (state, metrics)`; state is donated.

    spec: the rollout's `sampling.RolloutSpec`. Log-probs are recomputed at its
    temperature; its num_generations (G) consecutive rows share their prompt, which is
    then read once per group: in the old-policy recompute, and in the forward + backward
    when mini_batches == 1 (`rl.prefix.prompt_prefix` / `prefix_logprobs`; the result is
    the same up to float rounding, only the group's first row's prompt is read); its
    max_new_tokens is L_max of seq-mean-token-sum-norm.
    micro_batches: gradient-accumulation slices per optimizer step (memory knob; the
    result does not depend on it). mini_batches: optimizer steps per pass over the batch.
    critic_optimizer: required when algo_cfg uses a critic (PPO).
    seed: the mini-batch permutations derive from (seed, step) (`train.seed`).
    share_prompts: False makes every row read its own prompt (the same result up to float
    rounding, more compute; a reference for the shared path).
    packing: 'auto' | 'on' | 'off': the forwards that run whole rows (every row reading
    its own prompt) pack each micro-batch's rows into packing_capacity of its padded
    sequences (`rl.packing`; the same result up to float rounding); 'auto' packs when
    the batch's rows are on one device (`rl.packing.resolve_packing`, per layout).
    """
    resolve_packing(packing, packing_capacity, 1)  # a bad mode or capacity fails here
    if micro_batches < 1 or mini_batches < 1:
        raise ValueError(f"micro_batches={micro_batches}, mini_batches={mini_batches}: >= 1")
    if algo_cfg.uses_critic and critic_optimizer is None:
        raise ValueError(f"algo.advantage={algo_cfg.advantage!r} needs critic_optimizer")
    check_num_generations(algo_cfg, spec.num_generations)
    setup = Setup(
        model_cfg=model_cfg,
        algo=algo_cfg,
        opt=opt,
        critic_opt=critic_optimizer if algo_cfg.uses_critic else None,
        spec=spec,
        micro_batches=int(micro_batches),
        mini_batches=int(mini_batches),
        chunk_size=int(chunk_size),
        skip_nonfinite=bool(skip_nonfinite),
        seed=int(seed),
        # a hybrid model's prompt is a recurrent state, which `prompt_prefix` cannot carry
        share_prompts=bool(share_prompts) and not model_cfg.hybrid,
    )
    return UpdateFn(setup, packing, float(packing_capacity))


class UpdateFn:
    """`update(state, batch) -> (state, metrics)`, jitted with the state donated.

    The new state is pinned to the shardings the state came in with: left to itself, the
    compiler may shard an output differently (e.g. a replicated norm scale over 'fsdp'),
    which would make the next call and the sampler compile again for the new layout. One
    jitted program is kept per input layout; `traces` counts compilations by [N, T].
    """

    def __init__(self, setup: Setup, packing="off", packing_capacity: float = DEFAULT_CAPACITY):
        self._setup = setup
        self._packing = (packing, packing_capacity)
        self._jitted: dict = {}
        self.traces: collections.Counter = collections.Counter()

    def _for(self, state: TrainState):
        """The jitted program for this state's layout; `state.frozen` (LoRA's base) is a
        separate argument: read, never donated, not an output."""
        shardings = jax.tree.map(lambda x: x.sharding, state.replace(frozen=None))
        key = (jax.tree.structure(shardings), tuple(jax.tree.leaves(shardings)))
        if key not in self._jitted:
            first = jax.tree.leaves(shardings)[0]
            if isinstance(first, NamedSharding):
                scalars = NamedSharding(first.mesh, PartitionSpec())
            else:
                scalars = jax.sharding.SingleDeviceSharding(next(iter(first.device_set)))
            setup = self._layout_setup(first)
            traced = functools.partial(self._traced, setup, first)
            jitted = jax.jit(traced, donate_argnums=0, out_shardings=(shardings, scalars))
            self._jitted[key] = jitted
        return self._jitted[key]

    def _layout_setup(self, sharding) -> Setup:
        """The setup with packing resolved for this layout (rows over data x fsdp)."""
        shards = 1
        if isinstance(sharding, NamedSharding):
            shards = batch_size_multiple(sharding.mesh)
        cfg = self._setup.model_cfg
        capacity = resolve_packing(*self._packing, shards, cfg.moe or cfg.hybrid)
        return dataclasses.replace(self._setup, packing=capacity)

    def _traced(self, setup: Setup, sharding, state: TrainState, frozen, batch: RolloutBatch):
        self.traces[batch.tokens.shape] += 1
        with context_mesh(sharding):  # the mesh's `context` axis, if > 1, splits sequences
            return _update(setup, state, batch, frozen)

    def __call__(self, state: TrainState, batch: RolloutBatch):
        frozen = state.frozen
        new, metrics = self._for(state)(state.replace(frozen=None), frozen, batch)
        return new.replace(frozen=frozen), metrics

    @property
    def forward_passes(self) -> int:
        """Sequence forwards per call, counting a forward + backward as 3: the model-FLOP
        multiplier of the update over one forward of the batch. The policy's only: PPO's
        critic passes are not counted, so its MFU reads low."""
        s = self._setup
        return 3 * s.algo.num_iterations + int(s.needs_old_logp)

    @property
    def shared_prompt_passes(self) -> int:
        """How many of `forward_passes` read each prompt once per group (G > 1)."""
        s = self._setup
        if s.prompt_group == 1:
            return 0
        return 3 * s.algo.num_iterations * s.shares_prompts + int(s.needs_old_logp)

    def lower(self, state: TrainState, batch: RolloutBatch):
        """`jax.jit(...).lower` of the program for this state's layout (AOT, memory)."""
        program, args = self.program(state, batch)
        return program.lower(*args)

    def program(self, state: TrainState, batch: RolloutBatch):
        """The jitted program for this state's layout and the arguments a call with this
        state and batch gives it (what start-up lowers and compiles ahead of the call)."""
        return self._for(state), (state.replace(frozen=None), state.frozen, batch)
