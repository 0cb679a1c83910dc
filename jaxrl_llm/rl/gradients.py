"""The gradient of one mini-batch: policy (and PPO value) losses summed over micro-batches.

`gradients(s, carry, rows)` is step 3 of the update (update.py's module doc): the rows of
one optimizer step are cut into `micro_batches` slices by stride (`prefix.split_rows`),
each slice's loss is divided by the aggregation denominator of the whole mini-batch
(`rl.loss_denominator`), and a `lax.scan` sums their float32 gradients, so the sum is
exactly the mini-batch gradient. With shared prompts the groups' prompts run once before
the slices; each slice adds the cotangent of their keys/values, and one backward through
the prompts' forward follows. With each layer's weights sliced (`_Sliced`) that backward
recomputes the prompts' forward layer by layer (`models.layers.recompute_in_backward`)
instead of holding every layer's activations through all the micro-batches: one more
forward over the prompts, and the update's peak no longer holds them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl_llm import models
from jaxrl_llm.models import lora, moe
from jaxrl_llm.rl import critic as critic_lib
from jaxrl_llm.rl.algos import AlgoConfig
from jaxrl_llm.rl.batch import packed_or_padded, sequence_logprobs
from jaxrl_llm.rl.losses import loss_denominator, policy_objective, value_objective
from jaxrl_llm.rl.optim import Optimizer
from jaxrl_llm.rl.prefix import prefix_logprobs, prompt_prefix, split_rows
from jaxrl_llm.sampling.spec import RolloutSpec

_sg = jax.lax.stop_gradient


@struct.dataclass
class Rows:
    """Per-row training data after step 1-2 of the module doc (None = not needed)."""

    prompt_tokens: jax.Array
    prompt_mask: jax.Array
    tokens: jax.Array
    mask: jax.Array
    loss_mask: jax.Array
    behaviour_logp: jax.Array
    advantages: jax.Array  # [N, T]
    old_logp: jax.Array | None
    ref_logp: jax.Array | None
    returns: jax.Array | None
    old_values: jax.Array | None
    groups: jax.Array | None = None  # [N] int32: each row's prompt group (shared prompts)
    routes: jax.Array | None = None  # [N, P + T, L, k]: the sampler's experts (MoE models)


@struct.dataclass
class Carry:
    params: Any
    opt_state: Any
    critic_params: Any
    critic_opt_state: Any


@dataclasses.dataclass(frozen=True)
class Setup:
    """The static settings of one compiled update function."""

    model_cfg: models.ModelConfig
    algo: AlgoConfig
    opt: Optimizer
    critic_opt: Optimizer | None
    spec: RolloutSpec
    micro_batches: int
    mini_batches: int
    chunk_size: int
    skip_nonfinite: bool
    seed: int
    share_prompts: bool = True
    packing: float = 0.0  # packed capacity of the full-row forwards (rl.packing); 0 = off

    @property
    def num_generations(self) -> int:
        return self.spec.num_generations

    @property
    def prompt_group(self) -> int:
        """Rows per prompt read once in the no-gradient forwards (1 = every row its own)."""
        return self.num_generations if self.share_prompts else 1

    @property
    def shares_prompts(self) -> bool:
        """The policy's forward + backward reads each prompt once per group: G > 1 and the
        rows are not permuted into mini-batches (which would split groups)."""
        return self.prompt_group > 1 and self.mini_batches == 1

    @property
    def on_policy(self) -> bool:
        return self.algo.num_iterations == 1 and self.mini_batches == 1

    @property
    def lora_dropout(self) -> bool:
        """The gradient forward drops adapter inputs (model.lora.dropout > 0)."""
        return self.model_cfg.lora is not None and self.model_cfg.lora.dropout > 0

    @property
    def replay(self) -> bool:
        """The forwards route with the sampler's recorded experts (routing replay)."""
        return self.algo.routing_replay == "rollout"

    def replayed(self, routes):
        """The routes a forward is given: the recorded ones under replay, else None."""
        return routes if self.replay else None

    @property
    def slices_layers(self) -> bool:
        """The gradient reads each layer's weights as slices taken once per mini-batch
        (`gradients`): an unrolled model (`scan_layers=False`) without remat or LoRA."""
        c = self.model_cfg
        return not c.scan_layers and c.remat == "none" and c.lora is None

    @property
    def needs_old_logp(self) -> bool:
        return not self.on_policy or (self.algo.kl_in_reward and self.algo.beta > 0)


def _policy_loss(s: Setup, params, r: Rows, den, prefix=None, dropout=None, plan=None, layers=None):
    """-J of one micro-batch (divided by the mini-batch denominator) and its metrics.
    prefix: the groups' prompts already run (`prompt_prefix`), or None. dropout: the
    micro-batch's LoRA dropout key, or None. plan: the rows' packing (`rl.packing`), or
    None. layers: each layer's weights already sliced (`_Sliced`), or None."""
    kw = dict(temperature=s.spec.logprob_temperature, chunk_size=s.chunk_size, dropout=dropout)
    kw |= dict(routes=s.replayed(r.routes), with_routes=True, layers=layers)
    if prefix is None:
        logp, entropy, own = sequence_logprobs(
            s.model_cfg,
            params,
            r.prompt_tokens,
            r.prompt_mask,
            r.tokens,
            r.mask,
            **kw,
            packing=plan,
        )
    else:
        logp, entropy, own = prefix_logprobs(
            s.model_cfg, params, prefix, r.prompt_mask, r.tokens, r.mask, r.groups, **kw
        )
    if not s.algo.entropy_coef:  # the bonus is off: its gradient need not be traced
        entropy = _sg(entropy)
    old = None if s.on_policy else r.old_logp
    loss, metrics = policy_objective(
        s.algo,
        logp,
        old,
        r.behaviour_logp,
        r.ref_logp,
        r.advantages,
        r.loss_mask,
        entropy,
        denominator=den,
        max_len=s.spec.max_new_tokens,
    )
    if own is not None and r.routes is not None:
        metrics = {**metrics, **_routing_metrics(s, own, r)}
    return loss, metrics


def _routing_metrics(s: Setup, own, r: Rows) -> dict:
    """moe/router_agreement: the share of (sampled token, layer) selections where the
    trainer's router picks the sampler's experts (1.0 whatever the replay: it compares the
    router's own top-k); moe/layer<i>/load_max: per layer, the busiest expert's share of
    the selections times E (1 = perfectly balanced, E = one expert takes all)."""
    P, E = r.prompt_mask.shape[1], s.model_cfg.num_experts
    recorded = r.routes[:, P:]
    recorded = jnp.where(own >= 0, recorded, -1)  # the last token, never fed, is skipped
    valid = r.loss_mask.astype(bool)
    metrics = {"moe/router_agreement": moe.router_agreement(own, recorded, valid)}
    load = moe.expert_load(own, valid & jnp.any(own >= 0, (-2, -1)), E)  # -1: dense layers
    for i, share in enumerate(jnp.max(load, axis=-1) * E):
        metrics[f"moe/layer{i}/load_max"] = share
    return metrics


def _value_loss(s: Setup, critic_params, r: Rows, den):
    v = critic_lib.values(
        s.model_cfg, critic_params, r.prompt_tokens, r.prompt_mask, r.tokens, r.mask
    )
    loss, metrics = value_objective(
        s.algo,
        v,
        r.old_values,
        r.returns,
        r.loss_mask,
        denominator=den,
        max_len=s.spec.max_new_tokens,
    )
    # Full-batch rollout-time statistics replace these (see _batch_metrics).
    metrics.pop("value/mean"), metrics.pop("value/explained_variance")
    return loss, metrics


def _zeros_f32(tree):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)


def _add(acc, grads):
    return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)


class _Sliced:
    """The parameters an unrolled model's gradient is taken with respect to: the stacked
    layer weights cut into each layer's slices once (`models.layer_params`), beside the
    other parameters. Every forward and backward of the mini-batch (the shared prompts',
    each micro-batch's) reads those slices. Differentiated through the stacks instead,
    XLA slices each layer's weights in each forward and keeps the slices to its
    backward: the prompts' slices through all the micro-batches, so every layer's
    weights were held twice at the update's peak. The gradients are summed per layer
    (each layer's into its own buffer as the backward makes it) and stacked once."""

    def __init__(self, params):
        self.stacked = _sg(params["layers"])  # for the model's structure; not read
        rest = {k: v for k, v in params.items() if k != "layers"}
        self.diff = (rest, models.layer_params(params))

    def view(self, diff):
        """-> (params for the model, each layer's slices) of the differentiated `diff`."""
        return {**diff[0], "layers": self.stacked}, diff[1]

    @staticmethod
    def stacked_grads(g):
        """The gradient of `diff` -> one shaped like the params (layer stacks)."""
        layers = {n: jnp.stack(rows) for n, rows in g[1].items()}
        return {**g[0], "layers": layers}


class _Whole:
    """The parameters as they are (scanned layers, remat, LoRA: base + adapters)."""

    def __init__(self, params, frozen):
        self.diff, self.frozen = params, frozen

    def view(self, diff):
        return lora.combine(self.frozen, diff), None

    @staticmethod
    def stacked_grads(g):
        return g


def gradients(s: Setup, carry: Carry, rows: Rows, frozen=None, dropout=None):
    """Summed float32 gradients of one mini-batch over its micro-batches, and metrics.

    With shared prompts the prompts run once, before the micro-batches; each micro-batch
    adds its rows' cotangent of the prompts' keys/values (and last hidden states), and
    one backward through the prompts' forward after the last adds their gradient.
    frozen: LoRA's base weights; the model reads base + carry.params (the adapters) and
    only the adapters are differentiated. dropout: the mini-batch's LoRA dropout key
    (the prompts fold in 0, micro-batch i folds in i + 1), or None."""
    den = loss_denominator(rows.loss_mask, s.algo.loss_agg, s.spec.max_new_tokens)
    use_critic = carry.critic_params is not None
    weights = _Sliced(carry.params) if s.slices_layers else _Whole(carry.params, frozen)
    fold = lambda i: None if dropout is None else jax.random.fold_in(dropout, i)  # noqa: E731
    prefix = None
    if rows.groups is not None:

        def run_prompts(d):
            params, layers = weights.view(d)
            tokens, mask, routes = rows.prompt_tokens, rows.prompt_mask, s.replayed(rows.routes)
            G = s.num_generations
            return prompt_prefix(
                s.model_cfg, params, tokens, mask, G, fold(0), routes, layers, recompute=True
            )

        prefix, prefix_vjp = jax.vjp(run_prompts, weights.diff)

    def micro(acc, xs):
        r, i = xs
        key = fold(i + 1)
        if prefix is None:

            def run(plan):  # packed (plan) or padded (None): one forward and backward
                def loss(d):
                    params, layers = weights.view(d)
                    return _policy_loss(s, params, r, den, None, key, plan, layers)

                return jax.value_and_grad(loss, has_aux=True)(weights.diff)

            (_, metrics), g = packed_or_padded(run, r.prompt_mask, r.mask, s.packing)
        else:

            def loss(d, pre):
                params, layers = weights.view(d)
                return _policy_loss(s, params, r, den, pre, key, layers=layers)

            pgrad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
            (_, metrics), (g, g_prefix) = pgrad(weights.diff, prefix)
            acc = dict(acc, prefix=_add(acc["prefix"], g_prefix))
        acc = dict(acc, policy=_add(acc["policy"], g))
        if use_critic:
            vgrad = jax.value_and_grad(functools.partial(_value_loss, s), has_aux=True)
            (_, vmetrics), cg = vgrad(carry.critic_params, r, den)
            acc["critic"] = _add(acc["critic"], cg)
            metrics = {**metrics, **vmetrics}
        return acc, metrics

    acc = {"policy": _zeros_f32(weights.diff)}  # each layer its own sum when sliced
    if use_critic:
        acc["critic"] = _zeros_f32(carry.critic_params)
    if prefix is not None:
        acc["prefix"] = _zeros_f32(prefix)
    xs = (split_rows(rows, s.micro_batches), jnp.arange(s.micro_batches))
    acc, metrics = jax.lax.scan(micro, acc, xs)
    if prefix is not None:
        g_prefix = jax.tree.map(lambda g, x: g.astype(x.dtype), acc.pop("prefix"), prefix)
        acc["policy"] = _add(acc["policy"], prefix_vjp(g_prefix)[0])
    acc["policy"] = weights.stacked_grads(acc["policy"])
    return acc, reduce_metrics(metrics, sum_losses=True)


def reduce_metrics(metrics: dict, sum_losses: bool) -> dict:
    """Stacked per-slice metrics [k] -> scalars: extremes by min / max, nonfinite by max,
    loss/* summed (micro-batches of one step) or averaged (steps), the rest averaged."""

    def one(name, x):
        if name.endswith(("_min", "/min")):
            return jnp.min(x)
        if name.endswith(("_max", "/max", "nonfinite")):
            return jnp.max(x)
        if sum_losses and name.startswith("loss/"):
            return jnp.sum(x)
        return jnp.mean(x)

    return {name: one(name, x) for name, x in metrics.items()}
