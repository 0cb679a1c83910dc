"""Advantage estimators and outcome-reward shaping, as pure functions on device arrays.

Rows are ordered prompt-major: N = B * G rows, the G completions of one prompt consecutive.
Sequence-level estimators take rewards [N]; token-level ones take [N, T] with a mask
[N, T] (1 = a trained token). Formulas (notation of ../../shared/ALGORITHMS.md):

- GRPO (Shao et al. 2024, "DeepSeekMath"): A_i = (r_i - mean_g r) / (std r + eps), the std
  taken within the group (`group`), over the batch (`batch`) or not at all (`none`, Dr. GRPO:
  Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective").
- RLOO (Ahmadian et al. 2024, "Back to Basics"): A_i = r_i - (1 / (G - 1)) sum_{j != i} r_j.
- GDPO (Liu et al. 2026, "Group reward-Decoupled Normalization Policy Optimization"): each
  reward function is normalised within its group, the results are summed (optionally
  weighted), then the sum is divided by its batch std.
- REINFORCE++ (Hu 2025): token reward r_t = -beta * k1_t, plus the outcome reward at the last
  valid token; returns-to-go G_t = sum_{s >= t} gamma^(s - t) r_s; whitened over the batch.
- GAE (Schulman et al. 2016): delta_t = r_t + gamma V_{t+1} - V_t,
  A_t = sum_l (gamma lambda)^l delta_{t+l}, returns R_t = A_t + V_t (reverse `lax.scan`).
- On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models",
  GKD with the reverse KL on student samples): the student's sampled tokens are scored by a
  teacher, and each token's advantage gains w (log pi_T(o_t) - log pi_S(o_t)), the negated
  per-token reverse-KL estimate, w = `distill_coef` (`teacher.weight`). log pi_S is the
  behaviour log-prob (the policy that sampled the token). It is added AFTER the task
  estimator: A_t = A_task + w (log pi_T - log pi_S)_t, so group normalisation and
  whitening see the task reward alone, and the teacher term keeps its own scale.

Where the code departs from the papers:
- Every std is the sample std (ddof = 1), as the reference implementations' `torch.std`.
- A group whose rewards are all equal gets exactly 0 (not (r - mean) / eps, which rounding can
  make non-zero), and zero-variance stds are guarded so that neither values nor gradients
  are NaN.
- GDPO's final batch normalisation only divides by the std: the sum of group-centred terms
  has zero batch mean already, and not shifting it keeps equal-reward groups at exactly 0.
- Masked tokens inside a completion (tool or environment output) are skipped by the
  returns and GAE recursions: the carry passes through them unchanged, so gamma and lambda
  discount over trained tokens only. The token after the last valid one has value 0 (a
  finished completion is terminal; truncated ones are treated the same way).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxrl_llm.rl.losses import kl_penalty
from jaxrl_llm.rl.shaping import degenerate_groups

if TYPE_CHECKING:
    from jaxrl_llm.rl.algos import AlgoConfig

ADVANTAGE_KINDS = ("grpo", "rloo", "reinforce_pp", "gae")
STD_SCALES = ("group", "batch", "none")


def _replicated(x: jax.Array) -> jax.Array:
    """x itself, or replicated when an explicit mesh axis shards it.

    A group may straddle devices, and explicit sharding refuses a reshape that splits a
    sharded axis; sequence-level rewards are only N floats, so gathering them is free.
    """
    spec = getattr(jax.typeof(x).sharding, "spec", None)
    if spec is None or all(s is None for s in spec):
        return x
    return jax.sharding.reshard(x, PartitionSpec())


def _grouped(rewards: jax.Array, num_generations: int) -> jax.Array:
    """[N] -> [B, G] in float32; N must be a multiple of G >= 2 (static shapes)."""
    n, G = rewards.shape[0], num_generations
    if G < 2 or n % G:
        raise ValueError(f"num_generations={G}: need >= 2 and dividing N={n}")
    return _replicated(rewards.astype(jnp.float32)).reshape(n // G, G)


def _safe_std(x: jax.Array, axis=None, where=None, keepdims: bool = False) -> jax.Array:
    """Sample std (ddof=1) that is exactly 0, with a finite gradient, at zero variance."""
    count = jnp.sum(jnp.ones_like(x), axis=axis, where=where, keepdims=True)
    mean = jnp.sum(x, axis=axis, where=where, keepdims=True) / jnp.maximum(count, 1.0)
    sq = jnp.sum(jnp.square(x - mean), axis=axis, where=where, keepdims=True)
    var = sq / jnp.maximum(count - 1.0, 1.0)
    positive = var > 0
    std = jnp.where(positive, jnp.sqrt(jnp.where(positive, var, 1.0)), 0.0)
    return std if keepdims else jnp.squeeze(std, axis=axis)


def group_advantages(
    rewards: jax.Array, num_generations: int, scale: str = "group", eps: float = 1e-6
) -> jax.Array:
    """GRPO / Dr. GRPO advantages. rewards [N] -> [N] float32."""
    if scale not in STD_SCALES:
        raise ValueError(f"scale={scale!r}: expected one of {STD_SCALES}")
    r = _grouped(rewards, num_generations)
    adv = r - jnp.mean(r, axis=-1, keepdims=True)
    if scale == "group":
        adv = adv / (_safe_std(r, axis=-1, keepdims=True) + eps)
    elif scale == "batch":
        adv = adv / (_safe_std(r) + eps)
    return jnp.where(degenerate_groups(r, num_generations)[:, None], 0.0, adv).reshape(-1)


def rloo_advantages(rewards: jax.Array, num_generations: int) -> jax.Array:
    """RLOO leave-one-out baseline. rewards [N] -> [N] float32."""
    r = _grouped(rewards, num_generations)
    others = (jnp.sum(r, axis=-1, keepdims=True) - r) / (num_generations - 1)
    return jnp.where(degenerate_groups(r, num_generations)[:, None], 0.0, r - others).reshape(-1)


def multi_reward_advantages(
    rewards: jax.Array, num_generations: int, weights=None, eps: float = 1e-6
) -> jax.Array:
    """GDPO: per-function group normalisation, weighted sum, batch std scale.

    rewards [N, K] (one column per reward function), weights [K] or None (all 1) -> [N].
    """
    k = rewards.shape[-1]
    per_fn = [group_advantages(rewards[:, j], num_generations, "group", eps) for j in range(k)]
    w = jnp.ones((k,), jnp.float32) if weights is None else jnp.asarray(weights, jnp.float32)
    total = jnp.stack(per_fn, axis=-1) @ w
    return total / (_safe_std(total) + eps)


def whiten(x: jax.Array, mask: jax.Array, eps: float = 1e-6) -> jax.Array:
    """(x - mean) / (std + eps) over valid tokens; 0 where masked or when all are equal.

    x [N, T], mask [N, T] -> [N, T] float32.
    """
    x = x.astype(jnp.float32)
    valid = mask.astype(bool)
    count = jnp.maximum(jnp.sum(valid), 1)
    mean = jnp.sum(jnp.where(valid, x, 0.0)) / count
    all_equal = jnp.max(jnp.where(valid, x, -jnp.inf)) == jnp.min(jnp.where(valid, x, jnp.inf))
    out = (x - mean) / (_safe_std(x, where=valid) + eps)
    return jnp.where(valid & ~all_equal, out, 0.0)


def token_rewards(outcome: jax.Array, mask: jax.Array, kl=None, beta: float = 0.0) -> jax.Array:
    """Outcome reward at the last valid token minus beta * kl at every valid token.

    outcome [N], mask [N, T], kl [N, T] or None -> [N, T] float32 (0 where masked).
    """
    m = mask.astype(jnp.float32)
    t = mask.shape[-1]
    last = t - 1 - jnp.argmax(m[:, ::-1], axis=-1)
    is_last = (jnp.arange(t)[None, :] == last[:, None]) * m
    r = outcome.astype(jnp.float32)[:, None] * is_last
    if kl is not None:
        r = r - beta * kl.astype(jnp.float32) * m
    return r


def discounted_returns(rewards: jax.Array, mask: jax.Array, gamma: float = 1.0) -> jax.Array:
    """Returns-to-go G_t = r_t + gamma G_{t+1}, skipping masked tokens.

    rewards [N, T], mask [N, T] -> [N, T] float32 (0 where masked).
    """
    valid = mask.astype(bool).T

    def step(carry, x):
        r, v = x
        g = r + gamma * carry
        return jnp.where(v, g, carry), jnp.where(v, g, 0.0)

    init = jnp.zeros_like(rewards[:, 0], jnp.float32)  # zeros_like keeps the rows' sharding
    _, out = jax.lax.scan(step, init, (rewards.astype(jnp.float32).T, valid), reverse=True)
    return out.T


def gae(
    rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: float, lam: float
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation as a reverse `lax.scan` over T.

    rewards [N, T], values [N, T], mask [N, T] -> (advantages [N, T], returns [N, T]),
    float32, 0 where masked; returns = advantages + values.
    """
    valid = mask.astype(bool).T
    v_all = values.astype(jnp.float32).T

    def step(carry, x):
        next_v, next_a = carry
        r, v, ok = x
        a = r + gamma * next_v - v + gamma * lam * next_a
        carry = (jnp.where(ok, v, next_v), jnp.where(ok, a, next_a))
        return carry, jnp.where(ok, a, 0.0)

    zeros = jnp.zeros_like(rewards[:, 0], jnp.float32)
    xs = (rewards.astype(jnp.float32).T, v_all, valid)
    _, adv = jax.lax.scan(step, (zeros, zeros), xs, reverse=True)
    adv = adv.T
    return adv, jnp.where(mask.astype(bool), adv + values.astype(jnp.float32), 0.0)


class Advantages(NamedTuple):
    """Output of `compute_advantages`: advantages [N, T]; returns [N, T] for GAE else None."""

    advantages: jax.Array
    returns: jax.Array | None


def _outcome(cfg: AlgoConfig, rewards: jax.Array) -> jax.Array:
    """[N] or [N, K] rewards -> [N] for the non-decoupled estimators (weighted sum)."""
    if rewards.ndim == 1:
        return rewards.astype(jnp.float32)
    k = rewards.shape[-1]
    w = cfg.reward_weights if cfg.reward_weights is not None else (1.0,) * k
    if len(w) != k:
        raise ValueError(f"algo.reward_weights has {len(w)} entries for {k} reward columns")
    return rewards.astype(jnp.float32) @ jnp.asarray(w, jnp.float32)


def compute_advantages(
    cfg: AlgoConfig,
    rewards: jax.Array,
    mask: jax.Array,
    num_generations: int = 1,
    *,
    old_logp: jax.Array | None = None,
    ref_logp: jax.Array | None = None,
    values: jax.Array | None = None,
    teacher_logp: jax.Array | None = None,
    behaviour_logp: jax.Array | None = None,
) -> Advantages:
    """The advantage estimator selected by `cfg.advantage`, broadcast to tokens.

    rewards [N] or [N, K] (K reward functions), mask [N, T] (the loss mask); G =
    num_generations consecutive rows share a prompt (group estimators); old_logp /
    ref_logp [N, T] are needed when `cfg.kl_in_reward` and beta > 0 (k1 = old_logp -
    ref_logp per token); values [N, T] (rollout-time critic values) for GAE;
    teacher_logp / behaviour_logp [N, T] when `cfg.distill_coef` > 0 (the distillation
    term, module doc). No gradient flows into the result.
    """
    kl = None
    if cfg.kl_in_reward and cfg.beta > 0:
        if old_logp is None or ref_logp is None:
            raise ValueError("algo.kl_in_reward with beta > 0 needs old_logp and ref_logp")
        kl = kl_penalty(old_logp, ref_logp, mask, cfg.kl_estimator)
    m = mask.astype(jnp.float32)
    returns = None
    if cfg.advantage in ("grpo", "rloo"):
        if rewards.ndim == 2 and cfg.decouple_rewards:
            seq = multi_reward_advantages(rewards, num_generations, cfg.reward_weights, cfg.adv_eps)
        else:
            r = _outcome(cfg, rewards)
            if kl is not None:
                r = r - cfg.beta * jnp.sum(kl * m, axis=-1)
            if cfg.advantage == "grpo":
                seq = group_advantages(r, num_generations, cfg.adv_scale, cfg.adv_eps)
            else:
                seq = rloo_advantages(r, num_generations)
        adv = seq[:, None] * m
    else:
        token_r = token_rewards(_outcome(cfg, rewards), mask, kl, cfg.beta)
        if cfg.advantage == "reinforce_pp":
            adv = discounted_returns(token_r, mask, cfg.gamma)
        else:
            if values is None:
                raise ValueError("algo.advantage='gae' needs critic values")
            adv, returns = gae(token_r, values, mask, cfg.gamma, cfg.lam)
            returns = jax.lax.stop_gradient(returns)
        if cfg.whiten_advantages:
            adv = whiten(adv, mask, cfg.adv_eps)
    if cfg.distill_coef > 0:
        if teacher_logp is None or behaviour_logp is None:
            raise ValueError("algo.distill_coef > 0 needs teacher_logp and behaviour_logp")
        adv = adv + distillation_advantages(teacher_logp, behaviour_logp, mask, cfg.distill_coef)
    return Advantages(jax.lax.stop_gradient(adv), returns)


def distillation_advantages(teacher_logp, student_logp, mask, coef: float) -> jax.Array:
    """coef (log pi_T - log pi_S) per sampled token: [N, T] each -> [N, T] float32, 0 where
    masked (module doc: on-policy distillation)."""
    diff = teacher_logp.astype(jnp.float32) - student_logp.astype(jnp.float32)
    return jnp.where(mask.astype(bool), coef * diff, 0.0)


def distillation_metrics(batch, mask) -> dict:
    """`distill/reverse_kl`: the mean over trained tokens of log pi_S - log pi_T (the k1
    estimate of KL(pi_S || pi_T) on the student's samples); batch: a `RolloutBatch` with
    teacher log-probs."""
    valid = mask.astype(bool)
    diff = batch.behaviour_logprobs.astype(jnp.float32) - batch.teacher_logprobs
    kl = jnp.sum(jnp.where(valid, diff, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
    return {"distill/reverse_kl": jax.lax.stop_gradient(kl)}
