"""Per-token policy, KL, entropy and value losses, and their aggregation over a batch.

Every objective J is maximised; every function here returns the quantity to MINIMISE. Shapes:
N rows, T completion tokens; mask [N, T] is the loss mask (1 = trained token). With
rho = pi_theta / pi_old per token (notation of ../../shared/ALGORITHMS.md):

- PPO clip (Schulman et al. 2017), clip-higher (Yu et al. 2025, "DAPO"):
  L = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A).
- Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"): for
  A < 0, J = max(min(rho A, clip(rho) A), c A) with c > 1, i.e. L = min(L_ppo, -c A): the
  loss of a token with a huge ratio and a negative advantage is capped at -c A.
- GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): s_i = exp((1/|o_i|)
  sum_t m log rho), used in the PPO clip in place of rho. The GSPO-token form
  s_{i,t} = sg(s_i) pi_theta / sg(pi_theta) equals s_i in value, and its gradient is that of
  the sequence-level objective (s_i A_i grad log s_i) spread over the tokens.
- CISPO (MiniMax 2025, "MiniMax-M1"): J = sg(clip(rho, 1 - eps_low, 1 + eps_high)) A log pi.
- SAPO, GMPO, Clip-Cov, KL-Cov, DPPO-TV, DPPO-KL: policy_losses.py (papers and formulas
  there).
- Off-policy correction (`OFF_POLICY`, `off_policy_weight`). Three policies: pi_behaviour
  sampled the tokens (its log-probs come with the rollout), pi_old = pi_prox is the policy
  at the start of the update (recomputed, or sg(pi_theta) for one optimizer step), pi_theta
  is trained. rho = pi_theta / pi_prox always (the clip is around pi_prox); each token's
  policy term is multiplied by sg(w(k)) with k = pi_prox / pi_behaviour:
    none       w = 1 (the behaviour policy is ignored)
    tis        w = min(k, C)  (Yao et al. 2025, "Your Efficient RL Framework Secretly
               Brings You Off-Policy RL Training"; C = tis_cap, None = w = 1)
    icepop     w = k for k in [low, high], else 0: out-of-band tokens get no gradient
               (Ling team 2025, "IcePop", Ring-1T report)
    decoupled  w = k for k <= C, else 0 (Fu et al. 2025, "AReaL", decoupled PPO: the
               behaviour weight, tokens beyond its cap masked)
- KL to the reference (Schulman 2020, "Approximating KL Divergence"), x = log pi_ref -
  log pi_theta: k1 = -x, k2 = x^2 / 2, k3 = exp(x) - 1 - x.
- Entropy bonus: -c_H H_t.
- Clipped value loss (PPO2 baselines): 1/2 max((V - R)^2, (clip(V, V_old +- eps_v) - R)^2).

Aggregation of a per-token loss L over the batch (`aggregation_parts` gives numerator and
denominator; the loss is their ratio):
  token-mean               sum_{i,t} m L / sum_{i,t} m
  seq-mean-token-mean      sum_i (sum_t m L / sum_t m) / #rows with a valid token
  seq-mean-token-sum       sum_{i,t} m L / #rows with a valid token
  seq-mean-token-sum-norm  sum_{i,t} m L / (N L_max)          (Dr. GRPO)

Where the code departs from the papers:
- CISPO's value is computed as -sg(w) A pi / sg(pi) = -w A rather than -w A log pi: the
  gradient is identical, and the logged loss is then comparable to PPO's surrogate.
- Log-ratios are set to 0 at masked positions before `exp`, so padding with arbitrary
  log-probs never overflows; masked tokens and fully masked rows contribute exactly zero
  value and gradient, and every denominator is guarded.
- The ratio's log is clamped to [-MAX_LOG_RATIO, MAX_LOG_RATIO] = [-20, 20] before `exp`
  (as verl does). Beyond it the clip has already taken over for every token whose
  advantage it applies to, and without the clamp a log-ratio above ~88 overflows exp in
  the branch `max` did not select: the loss stays finite while its gradient becomes NaN
  (0 * inf).
- The clipped value V_old + clip(V - V_old) is used only where the clip is active
  (|V - V_old| > eps_v); elsewhere it is V itself. Computed everywhere, it differs from V
  by one ulp on many tokens, which flipped the comparison behind `value/clipfrac`.
- The seq-mean modes count only rows with at least one valid token (a fully masked row
  does not dilute the mean); Dr. GRPO's N counts every row, as its constant should.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxrl_llm.rl import policy_losses as extra

if TYPE_CHECKING:
    from jaxrl_llm.rl.algos import AlgoConfig

POLICY_LOSSES = (
    "ppo",
    "gspo",
    "cispo",
    "sapo",
    "gmpo",
    "clip_cov",
    "kl_cov",
    "dppo_tv",
    "dppo_kl",
)
OFF_POLICY = ("none", "tis", "icepop", "decoupled")
KL_ESTIMATORS = ("k1", "k2", "k3")
MAX_LOG_RATIO = 20.0  # |log rho| above this is clamped before exp (see the module doc)
AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)

_sg = jax.lax.stop_gradient


def _f32(x: jax.Array) -> jax.Array:
    """x in float32, or wider when it already is (float64 inputs stay float64)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of x over mask (any shape, same as x); 0 when the mask is empty."""
    valid = mask.astype(bool)
    return jnp.sum(jnp.where(valid, x, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, mask: jax.Array, estimator: str):
    """Per-token KL(pi_theta || pi_ref) estimate. [N, T] each -> [N, T], 0 where masked."""
    diff = _f32(ref_logp) - _f32(logp)
    x = jnp.where(mask.astype(bool), diff, 0.0)
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * jnp.square(x)
    if estimator == "k3":
        return jnp.expm1(x) - x
    raise ValueError(f"estimator={estimator!r}: expected one of {KL_ESTIMATORS}")


def log_ratio(logp: jax.Array, old_logp: jax.Array, mask: jax.Array) -> jax.Array:
    """Token log rho = log pi_theta - log pi_old. [N, T] -> [N, T], 0 where masked."""
    diff = _f32(logp) - _f32(old_logp)
    return jnp.where(mask.astype(bool), diff, 0.0)


def sequence_log_ratio(logp: jax.Array, old_logp: jax.Array, mask: jax.Array) -> jax.Array:
    """GSPO-token log s_{i,t} = sg(log s_i) + log pi - sg(log pi). [N, T] -> [N, T].

    log s_i = sum_t m log rho / sum_t m; 0 where masked (and for fully masked rows).
    """
    valid = mask.astype(bool)
    lr = log_ratio(logp, old_logp, mask)
    count = jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 1)
    log_s = jnp.sum(lr, axis=-1, keepdims=True) / count
    token = _sg(log_s) + _f32(logp - _sg(logp))
    return jnp.where(valid, token, 0.0)


def clamp_log_ratio(x: jax.Array) -> jax.Array:
    """x clamped to [-MAX_LOG_RATIO, MAX_LOG_RATIO], as torch.clamp: the gradient is 1 up to
    and including the bounds, 0 beyond them. [N, T] -> [N, T]."""
    return jnp.where(jnp.abs(x) > MAX_LOG_RATIO, jnp.sign(x) * MAX_LOG_RATIO, x)


def ppo_clip_loss(ratio, advantages, eps_low: float, eps_high: float, dual_clip=None):
    """-min(rho A, clip(rho) A), with dual clip min(., -c A) for A < 0. [N, T] -> [N, T]."""
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = jnp.where(advantages < 0, jnp.minimum(loss, -dual_clip * advantages), loss)
    return loss


def cispo_loss(logp, ratio, advantages, eps_low: float, eps_high: float):
    """-sg(clip(rho)) A grad-carrying 1 (pi / sg(pi)). [N, T] -> [N, T]."""
    weight = _sg(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
    return -weight * advantages * _f32(jnp.exp(logp - _sg(logp)))


def value_loss(values, old_values, returns, mask, clip=None) -> jax.Array:
    """1/2 max((V - R)^2, (clip(V, V_old +- clip) - R)^2). [N, T] -> [N, T], 0 where masked."""
    v = values.astype(jnp.float32)
    r = returns.astype(jnp.float32)
    loss = jnp.square(v - r)
    if clip is not None:
        loss = jnp.maximum(loss, jnp.square(clipped_values(v, old_values, clip) - r))
    return jnp.where(mask.astype(bool), 0.5 * loss, 0.0)


def clipped_values(values, old_values, clip: float) -> jax.Array:
    """clip(V, V_old - eps_v, V_old + eps_v), exactly V where the clip is inactive. [N, T]."""
    v, v_old = values.astype(jnp.float32), old_values.astype(jnp.float32)
    active = jnp.abs(v - v_old) > clip
    return jnp.where(active, v_old + jnp.clip(v - v_old, -clip, clip), v)


def loss_denominator(mask: jax.Array, mode: str, max_len: int | None = None) -> jax.Array:
    """The denominator of `mode` for this mask [N, T] (scalar float32, no parameters used)."""
    valid = mask.astype(bool)
    if mode == "token-mean":
        return jnp.sum(valid).astype(jnp.float32)
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return jnp.sum(jnp.any(valid, axis=-1)).astype(jnp.float32)
    if mode == "seq-mean-token-sum-norm":
        return jnp.float32(mask.shape[0] * (max_len or mask.shape[-1]))
    raise ValueError(f"mode={mode!r}: expected one of {AGGREGATIONS}")


def aggregation_parts(loss, mask, mode: str, max_len: int | None = None):
    """(numerator, denominator) of the aggregated loss. loss, mask [N, T] -> two scalars.

    Both are sums over rows, so for a batch split into micro-batches by rows the full-batch
    loss is sum(numerators) / sum(denominators). max_len: L_max of seq-mean-token-sum-norm
    (default T).
    """
    valid = mask.astype(bool)
    per_row = jnp.sum(jnp.where(valid, loss, 0.0), axis=-1)
    if mode == "seq-mean-token-mean":
        per_row = per_row / jnp.maximum(jnp.sum(valid, axis=-1), 1)
    return jnp.sum(per_row), loss_denominator(mask, mode, max_len)


def aggregate(loss, mask, mode: str, max_len=None, denominator=None) -> jax.Array:
    """Aggregated scalar loss. With `denominator` (a global one), numerator / denominator."""
    num, den = aggregation_parts(loss, mask, mode, max_len)
    den = den if denominator is None else denominator
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def _extremes(x, valid):
    """(min, max) of x over valid; (1, 1) when nothing is valid."""
    any_valid = jnp.any(valid)
    lo = jnp.min(jnp.where(valid, x, jnp.inf))
    hi = jnp.max(jnp.where(valid, x, -jnp.inf))
    return jnp.where(any_valid, lo, 1.0), jnp.where(any_valid, hi, 1.0)


def _policy_metrics(cfg, logp, old_logp, ratio, adv, mask) -> dict:
    """Diagnostics of the policy term, all stop-gradient scalars (means over valid tokens)."""
    valid = mask.astype(bool)
    ratio, adv = _sg(ratio), _sg(adv)
    low, high = ratio < 1.0 - cfg.eps_low, ratio > 1.0 + cfg.eps_high
    if cfg.policy_loss != "cispo":
        low, high = low & (adv < 0), high & (adv > 0)
    x = _sg(log_ratio(old_logp, logp, mask))
    r_min, r_max = _extremes(ratio, valid)
    a_min, a_max = _extremes(adv, valid)
    a_mean = masked_mean(adv, valid)
    clipped = {}  # the ratio clip's fractions, for the losses that clip the ratio
    if cfg.policy_loss in ("ppo", "gspo", "cispo", "clip_cov"):
        clipped = {
            "policy/clipfrac_low": masked_mean(low, valid),
            "policy/clipfrac_high": masked_mean(high, valid),
        }
    metrics = clipped | {
        "policy/approx_kl": masked_mean(jnp.expm1(x) - x, valid),
        "policy/ratio_mean": masked_mean(ratio, valid),
        "policy/ratio_min": r_min,
        "policy/ratio_max": r_max,
        "adv/mean": a_mean,
        "adv/std": jnp.sqrt(masked_mean(jnp.square(adv - a_mean), valid)),
        "adv/min": a_min,
        "adv/max": a_max,
    }
    if cfg.dual_clip is not None and cfg.policy_loss in ("ppo", "gspo"):
        metrics["policy/clipfrac_dual"] = masked_mean((adv < 0) & (ratio > cfg.dual_clip), valid)
    metrics |= _extra_metrics(cfg, logp, old_logp, adv, valid)
    return metrics


def _extra_metrics(cfg, logp, old_logp, adv, valid) -> dict:
    """The token fractions the covariance and DPPO losses act on (verl's pg_clipfrac):
    `policy/masked_frac` (DPPO: outside the trust region; Clip-Cov: detached) and
    `policy/kl_cov_frac` (KL-Cov: penalised)."""
    kind = cfg.policy_loss
    lp, olp = _sg(_f32(logp)), _f32(old_logp)
    x = clamp_log_ratio(log_ratio(lp, olp, valid))
    if kind in ("dppo_tv", "dppo_kl"):
        keep = extra.dppo_keep(kind[5:], lp, olp, adv, valid, cfg.eps_low, cfg.eps_high)
        return {"policy/masked_frac": masked_mean(~keep, valid)}
    if kind == "clip_cov":
        selected = extra.clip_cov_selected(x, lp, olp, adv, valid, cfg)
        return {"policy/masked_frac": masked_mean(selected, valid)}
    if kind == "kl_cov":
        selected = extra.kl_cov_selected(lp, adv, valid, cfg.kl_cov_ratio)
        return {"policy/kl_cov_frac": masked_mean(selected, valid)}
    return {}


def policy_term(cfg: AlgoConfig, logp, old_logp, advantages, mask):
    """Per-token policy loss of `cfg.policy_loss` (before TIS and aggregation).

    logp, old_logp, advantages, mask [N, T] -> (loss [N, T], ratio [N, T]); the ratio is
    rho, or s_i on every token of row i for GSPO.
    """
    kind, valid = cfg.policy_loss, mask.astype(bool)
    if kind == "gspo":
        x = sequence_log_ratio(logp, old_logp, mask)
    else:
        x = log_ratio(logp, old_logp, mask)
    x = clamp_log_ratio(x)
    ratio = jnp.exp(x)
    lp = _f32(logp)
    if kind == "cispo":
        return cispo_loss(logp, ratio, advantages, cfg.eps_low, cfg.eps_high), ratio
    if kind == "sapo":
        return extra.sapo_loss(x, advantages, cfg.sapo_tau_pos, cfg.sapo_tau_neg), ratio
    if kind == "gmpo":
        s = extra.gmpo_ratio(x, advantages, valid, cfg.eps_low, cfg.eps_high)
        return extra.gmpo_loss(x, advantages, valid, cfg.eps_low, cfg.eps_high), s
    if kind == "clip_cov":
        return extra.clip_cov_loss(x, lp, _f32(old_logp), advantages, valid, cfg), ratio
    if kind == "kl_cov":
        loss = extra.kl_cov_loss(x, lp, advantages, valid, cfg.kl_cov_ratio, cfg.kl_cov_coef)
        return loss, ratio
    if kind in ("dppo_tv", "dppo_kl"):
        loss = extra.dppo_loss(kind[5:], x, lp, _f32(old_logp), advantages, valid, cfg)
        return loss, ratio
    return ppo_clip_loss(ratio, advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip), ratio


def off_policy_weight(cfg: AlgoConfig, prox_logp, behaviour_logp, mask) -> jax.Array:
    """sg(w(k)), k = pi_prox / pi_behaviour, of `cfg.off_policy` (module doc). [N, T] ->
    [N, T], 1 where masked."""
    return _weight(cfg, log_ratio(prox_logp, behaviour_logp, mask))


def _weight(cfg: AlgoConfig, x) -> jax.Array:
    """sg(w(k)) for the log-ratio x = log k [N, T] (0 where masked)."""
    k = _sg(jnp.exp(clamp_log_ratio(x)))
    mode = cfg.off_policy
    if mode == "none" or (mode == "tis" and cfg.tis_cap is None):
        return jnp.ones_like(k)
    if mode == "tis":
        return jnp.minimum(k, cfg.tis_cap)
    if mode == "icepop":
        return jnp.where((k >= cfg.icepop_low) & (k <= cfg.icepop_high), k, 0.0)
    if mode == "decoupled":
        return jnp.where(k <= cfg.tis_cap, k, 0.0)
    raise ValueError(f"off_policy={mode!r}: expected one of {OFF_POLICY}")


def _off_policy(cfg: AlgoConfig, pg, prox_logp, behaviour_logp, valid, metrics: dict):
    """pg times the off-policy weight; logs the behaviour / prox gap and the weights."""
    x = _sg(log_ratio(prox_logp, behaviour_logp, valid))
    metrics["rollout/logprob_gap"] = masked_mean(jnp.abs(x), valid)
    # k3 estimate of KL(pi_behaviour || pi_prox) from the behaviour's own samples.
    metrics["rollout/mismatch_k3"] = masked_mean(jnp.expm1(x) - x, valid)
    w = _weight(cfg, x)
    metrics["rollout/is_weight_mean"] = masked_mean(w, valid)
    metrics["rollout/is_weight_max"] = _extremes(w, valid)[1]
    metrics["rollout/is_masked_frac"] = masked_mean(w == 0.0, valid)
    if cfg.off_policy == "tis" and cfg.tis_cap is not None:
        metrics["rollout/tis_capped_frac"] = masked_mean(w >= cfg.tis_cap, valid)
    return pg * w


def policy_objective(
    cfg: AlgoConfig,
    logp: jax.Array,
    old_logp: jax.Array | None,
    sampler_logp: jax.Array | None,
    ref_logp: jax.Array | None,
    advantages: jax.Array,
    loss_mask: jax.Array,
    entropy: jax.Array | None = None,
    *,
    denominator: jax.Array | None = None,
    max_len: int | None = None,
) -> tuple[jax.Array, dict]:
    """The policy loss of one (micro-)batch: ratio, clip variant, off-policy weight, KL,
    entropy, aggregation.

    logp [N, T] (current policy, differentiable); old_logp [N, T] (pi_old; None = on-policy,
    sg(logp)); sampler_logp [N, T] the behaviour log-probs (None = no off-policy weight);
    ref_logp [N, T] (needed iff the KL is in the loss: beta > 0 and not kl_in_reward);
    advantages [N, T] or [N]; loss_mask [N, T]; entropy [N, T] (differentiable; None = no
    bonus). Returns (loss, metrics).

    max_len: L_max of seq-mean-token-sum-norm (the rollout's max_new_tokens; None = T).
    Micro-batching: pass `denominator = loss_denominator(full_mask, cfg.loss_agg,
    max_len)` computed on the FULL batch; each micro-batch's loss is then its
    numerator / that denominator, so losses and gradients summed over micro-batches equal
    the full-batch ones. The `loss/*` metrics add up the same way; the others are means over
    the micro-batch's valid tokens (average them; min / max for ratio_min / ratio_max).
    """
    valid = loss_mask.astype(bool)
    old_logp = _sg(logp) if old_logp is None else old_logp
    adv = _sg(_f32(advantages))
    adv = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, logp.shape)
    pg, ratio = policy_term(cfg, logp, old_logp, adv, valid)
    metrics = _policy_metrics(cfg, logp, old_logp, ratio, adv, valid)
    if sampler_logp is not None:
        pg = _off_policy(cfg, pg, old_logp, sampler_logp, valid, metrics)
    agg = functools.partial(
        aggregate,
        mask=valid,
        mode=cfg.loss_agg,
        max_len=max_len,
        denominator=denominator,
    )
    total = metrics["loss/policy"] = agg(pg)
    if ref_logp is not None:
        kl_tokens = kl_penalty(logp, ref_logp, valid, cfg.kl_estimator)
        metrics["policy/kl_ref"] = masked_mean(_sg(kl_tokens), valid)
    if cfg.beta > 0 and not cfg.kl_in_reward:
        if ref_logp is None:
            raise ValueError("algo.beta > 0 with the KL in the loss needs ref_logp")
        kl = metrics["loss/kl"] = agg(kl_tokens)
        total = total + cfg.beta * kl
    if entropy is not None:
        ent = metrics["loss/entropy"] = agg(_f32(entropy))
        metrics["policy/entropy"] = masked_mean(_sg(entropy), valid)
        if cfg.entropy_coef:
            total = total - cfg.entropy_coef * ent
    metrics["loss/total"] = total
    return total, jax.tree.map(_sg, metrics)


def value_objective(
    cfg: AlgoConfig,
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    loss_mask: jax.Array,
    *,
    denominator: jax.Array | None = None,
    max_len: int | None = None,
) -> tuple[jax.Array, dict]:
    """PPO's clipped value loss, aggregated with `cfg.loss_agg`. [N, T] each -> (loss, metrics).

    `denominator` and `max_len` play the same roles as in `policy_objective`.
    """
    valid = loss_mask.astype(bool)
    per_token = value_loss(values, old_values, returns, valid, cfg.value_clip)
    loss = aggregate(per_token, valid, cfg.loss_agg, max_len, denominator)
    v, r = _sg(values.astype(jnp.float32)), _sg(returns.astype(jnp.float32))
    r_var = masked_mean(jnp.square(r - masked_mean(r, valid)), valid)
    err = r - v
    err_var = masked_mean(jnp.square(err - masked_mean(err, valid)), valid)
    metrics = {
        "loss/value": _sg(loss),
        "value/mean": masked_mean(v, valid),
        "value/explained_variance": jnp.where(r_var > 0, 1.0 - err_var / r_var, 0.0),
    }
    if cfg.value_clip is not None:
        v_clipped = clipped_values(v, _sg(old_values), cfg.value_clip)
        clip_won = jnp.square(v_clipped - r) > jnp.square(v - r)
        metrics["value/clipfrac"] = masked_mean(clip_won, valid)
    return loss, metrics
