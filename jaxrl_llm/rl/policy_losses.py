"""The 2025-26 policy losses: SAPO, GMPO, Clip-Cov, KL-Cov, DPPO (TV and KL).

Each function returns the per-token loss to MINIMISE, [N, T] (0 where masked), to be
aggregated by `losses.aggregate` with `algo.loss_agg` like the PPO family. Inputs: x [N, T]
the token log-ratio log rho = log pi_theta - log pi_old (0 at masked positions, clamped to
[-20, 20] by the caller), logp [N, T] log pi_theta (differentiable), old_logp [N, T],
adv [N, T] (stop-gradient), valid [N, T] bool. sg = stop-gradient, m = mask, rho = e^x.

- SAPO (Qwen team 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347): the hard
  clip is replaced by a smooth gate, L = -f(rho; tau) A with
  f(r; tau) = (4 / tau) sigmoid(tau (r - 1)), tau = tau_pos where A > 0 else tau_neg
  (f(1) = 2 / tau, f'(1) = 1: on-policy it is the plain policy gradient).
- GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673): the
  sequence ratio is the geometric mean of token ratios clipped in log space,
  s_i = exp((1/|o_i|) sum_t m sgn(A) min(sgn(A) x, sgn(A) clip(x, -eps_low, eps_high))),
  and J_i = s_i Abar_i (Abar_i the mean advantage over the row's valid tokens). Every
  valid token of row i carries L = -Abar_i s_i (s_i differentiable through all of the
  row's tokens), so `seq-mean-token-mean` gives exactly the mean of the sequence losses.
- Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
  Reasoning Language Models", arXiv 2505.22617): the PPO clip loss, except that up to
  max(floor(r_c n), 1) tokens (n valid tokens in the batch, r_c = clip_cov_ratio, read
  as the decimal it is written as and computed exactly: 0.53 of 100 is 53), drawn
  at random among those the clip did not already clip whose centred covariance
  cov_t = (A_t - mean A) (log pi_t - mean log pi) lies in (lb, ub), get loss 0 (no
  gradient): the tokens that drive entropy collapse.
- KL-Cov (same paper): the UNCLIPPED surrogate -rho A, plus coef |x| on the
  max(floor(r_k n), 1) valid tokens of largest cov_t (r_k = kl_cov_ratio).
- DPPO (divergence PPO, arXiv 2602.04879, 2026): the
  ratio clip is replaced by a trust region on the probability itself, enforced by
  masking: L = -A sg(min(rho, C)) log pi * keep, keep = 0 for tokens that moved out of the
  region in the direction their advantage pushes.
    TV:  keep = (pi - pi_old <= eps_high) if A > 0 else (pi - pi_old >= -eps_low)
    KL:  with the binary KL D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p)),
         keep = (D <= eps_high or p <= p_old) if A > 0 else (D <= eps_low or p >= p_old)
  C = algo.ratio_cap (truncated importance weight; verl's `clip_ratio_c`).

Conventions, against verl 0.9.1 (`verl/trainer/ppo/core_algos.py`, the functions
`compute_policy_loss_{sapo,geo_mean,clip_cov,kl_cov,dppo_tv,dppo_kl}`):
- DPPO's value is -A sg(w) keep pi / sg(pi) rather than -A sg(w) keep log pi (as for
  CISPO in losses.py): the gradient is identical and the logged loss comparable to PPO's.
- Losses are aggregated with `algo.loss_agg`; verl forces seq-mean-token-mean for SAPO and
  a plain mean over all rows for GMPO (the `sapo` and `gmpo` presets set
  seq-mean-token-mean, which equals verl's except that a fully masked row does not count).
- The log-ratio is clamped to [-20, 20] for every loss (verl: SAPO and DPPO only).
- Clip-Cov's random draw is seeded by the batch (sum m old_logp to 12 significant bits),
  so a batch clips the same tokens on any machine; verl draws with torch.randperm. When
  the candidates are no more than the budget every one is clipped, and both agree exactly.
- The |x| of KL-Cov has gradient 0 at x = 0 (as torch.abs), so on-policy (x = 0) the
  penalty adds nothing.
"""

from __future__ import annotations

import fractions

import jax
import jax.numpy as jnp

_sg = jax.lax.stop_gradient


def _mean(x, valid):
    """Mean of x over valid; 0 when nothing is valid."""
    return jnp.sum(jnp.where(valid, x, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def _ppo(ratio, adv, eps_low, eps_high):
    """(-rho A, -clip(rho) A) of the PPO surrogate."""
    return -adv * ratio, -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)


def _rank(priority, candidates):
    """Rank of each candidate by descending priority (0 = first); non-candidates rank last."""
    flat = jnp.where(candidates, priority, -jnp.inf).ravel()
    order = jnp.argsort(-flat, stable=True)
    ranks = jnp.zeros(flat.shape, jnp.int32).at[order].set(jnp.arange(flat.size, dtype=jnp.int32))
    return ranks.reshape(priority.shape)


def ratio_fraction(frac: float) -> fractions.Fraction:
    """The ratio as the decimal it is written as (0.53 -> 53/100, 2e-4 -> 1/5000)."""
    return fractions.Fraction(repr(float(frac)))


def budget(valid, frac: float):
    """max(floor(r n), 1) with n = #valid and r = `ratio_fraction(frac)`, exactly: how many
    tokens a covariance loss touches (int32 scalar).

    float32 gets it wrong where r n is an integer (0.53 * 100 -> 52.999996 -> 52). Here
    k = floor(float32(r) n) is within `slack` of floor(r n); the remainder p n - k q
    (r = p / q) is then exact in int32 even though p n may wrap, because its true value
    is less than (slack + 1) q < 2^31 in magnitude; k + floor(rem / q) = floor(r n)."""
    r = ratio_fraction(frac)
    p, q = r.numerator, r.denominator
    slack = 2 + 3 * valid.size // 2**24  # float32's error on r n, in units, plus the floor
    if (slack + 1) * q >= 2**31:
        raise ValueError(f"covariance token ratio {frac!r}: too many decimal places")
    n = jnp.sum(valid, dtype=jnp.int32)
    k = jnp.floor(jnp.float32(p / q) * n.astype(jnp.float32)).astype(jnp.int32)
    rem = n * jnp.int32(p) - k * jnp.int32(q)
    return jnp.maximum(k + jnp.floor_divide(rem, jnp.int32(q)), 1)


def sapo_loss(x, adv, tau_pos: float, tau_neg: float):
    """-(4 / tau) sigmoid(tau (rho - 1)) A, tau = tau_pos for A > 0 else tau_neg. [N, T]."""
    ratio = jnp.exp(x)
    tau = jnp.where(adv > 0, tau_pos, tau_neg)
    return -jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv


def gmpo_ratio(x, adv, valid, eps_low: float, eps_high: float):
    """GMPO's sequence ratio s_i (module doc), broadcast over the row. [N, T] -> [N, T]."""
    sgn = jnp.sign(adv)
    clipped = jnp.clip(x, -eps_low, eps_high)
    x_min = sgn * jnp.minimum(sgn * x, sgn * clipped)
    count = jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 1)
    log_s = jnp.sum(jnp.where(valid, x_min, 0.0), axis=-1, keepdims=True) / count
    return jnp.broadcast_to(jnp.exp(log_s), x.shape)


def gmpo_loss(x, adv, valid, eps_low: float, eps_high: float):
    """-Abar_i s_i on every valid token of row i. [N, T] -> [N, T], 0 where masked."""
    count = jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 1)
    adv_bar = jnp.sum(jnp.where(valid, adv, 0.0), axis=-1, keepdims=True) / count
    loss = -adv_bar * gmpo_ratio(x, adv, valid, eps_low, eps_high)
    return jnp.where(valid, loss, 0.0)


def _covariance(logp, adv, valid):
    """cov_t = (A_t - mean A) (log pi_t - mean log pi), means over valid tokens (no grad)."""
    lp = _sg(jnp.where(valid, logp, 0.0))
    return (adv - _mean(adv, valid)) * (lp - _mean(lp, valid))


def clip_cov_selected(x, logp, old_logp, adv, valid, cfg):
    """The tokens Clip-Cov detaches (bool [N, T]): a seeded random draw of the budget among
    the unclipped valid tokens with lb < cov < ub."""
    pg1, pg2 = _ppo(jnp.exp(x), adv, cfg.eps_low, cfg.eps_high)
    cov = _covariance(logp, adv, valid)
    candidates = valid & ~(pg2 > pg1) & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    total = jnp.sum(jnp.where(valid, old_logp, 0.0)).astype(jnp.float32)
    # The sum rounded to 12 significant bits: its last bits vary with the order of the
    # summation (the CPU's vector width, the sharding), and every bit reseeds the draw.
    seed = (jax.lax.bitcast_convert_type(total, jnp.uint32) + 0x800) & ~jnp.uint32(0xFFF)
    priority = jax.random.uniform(jax.random.fold_in(jax.random.key(0), seed), x.shape)
    return candidates & (_rank(priority, candidates) < budget(valid, cfg.clip_cov_ratio))


def clip_cov_loss(x, logp, old_logp, adv, valid, cfg):
    """max(-rho A, -clip(rho) A), 0 on the tokens `clip_cov_selected` picks. [N, T]."""
    pg1, pg2 = _ppo(jnp.exp(x), adv, cfg.eps_low, cfg.eps_high)
    drop = _sg(clip_cov_selected(x, logp, old_logp, adv, valid, cfg))
    return jnp.where(drop, 0.0, jnp.maximum(pg1, pg2))


def kl_cov_selected(logp, adv, valid, ratio: float):
    """The max(floor(r n), 1) valid tokens of largest cov_t (bool [N, T]; none if n = 0)."""
    ranks = _rank(_covariance(logp, adv, valid), valid)
    return valid & (ranks < budget(valid, ratio))


def kl_cov_loss(x, logp, adv, valid, ratio: float, coef: float):
    """-rho A, plus coef |x| on `kl_cov_selected` tokens. [N, T]."""
    abs_x = x * _sg(jnp.sign(x))  # |x| with gradient 0 at x = 0 (as torch.abs)
    penalty = jnp.where(_sg(kl_cov_selected(logp, adv, valid, ratio)), coef * abs_x, 0.0)
    return -adv * jnp.exp(x) + penalty


def dppo_keep(kind: str, logp, old_logp, adv, valid, eps_low: float, eps_high: float):
    """DPPO's trust-region mask (1 = the token is trained), for kind tv | kl. [N, T]."""
    lp = _sg(jnp.where(valid, logp, 0.0))
    olp = jnp.where(valid, old_logp, 0.0)
    p, p_old = jnp.exp(lp), jnp.exp(olp)
    if kind == "tv":
        pos, neg = p - p_old <= eps_high, p - p_old >= -eps_low
    else:
        div = p_old * (olp - lp) + (1.0 - p_old) * jnp.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        pos = (div <= eps_high) | (p <= p_old)
        neg = (div <= eps_low) | (p >= p_old)
    return jnp.where(adv > 0, pos, neg)


def dppo_loss(kind: str, x, logp, old_logp, adv, valid, cfg):
    """-A sg(min(rho, C)) keep pi / sg(pi) (module doc). [N, T]."""
    weight = _sg(jnp.minimum(jnp.exp(x), cfg.ratio_cap))
    keep = dppo_keep(kind, logp, old_logp, adv, valid, cfg.eps_low, cfg.eps_high)
    grad_one = jnp.exp(jnp.where(valid, logp - _sg(logp), 0.0))
    return jnp.where(keep, -adv * weight * grad_one, 0.0)
