"""Algorithm configuration and the named presets (grpo, dr_grpo, dapo, gspo, rloo, ...).

One frozen `AlgoConfig` drives `compute_advantages` (advantages.py) and `policy_objective` /
`value_objective` (losses.py); a preset is a set of defaults over those same functions:

  grpo          Shao et al. 2024, "DeepSeekMath": group-normalised advantages, PPO clip 0.2,
                k3 KL in the loss (beta = 0.04), seq-mean-token-mean.
  dr_grpo       Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
                Perspective": no std division, seq-mean-token-sum-norm, beta = 0.
  dapo          Yu et al. 2025, "DAPO": clip-higher 0.2 / 0.28, token-mean, beta = 0, dynamic
                sampling, overlong penalty.
  gspo          Zheng et al. 2025, "Group Sequence Policy Optimization": sequence-level ratio
                and clip (eps 3e-4 / 4e-4), seq-mean-token-mean, beta = 0.
  rloo          Ahmadian et al. 2024, "Back to Basics": leave-one-out baseline, PPO clip,
                token-mean, k1 KL folded into the reward (beta = 0.05).
  reinforce_pp  Hu 2025, "REINFORCE++": per-token k1 KL reward (beta = 0.01), returns-to-go,
                batch whitening, PPO clip, token-mean.
  ppo           Ouyang et al. 2022 / Schulman et al. 2017: critic + GAE (gamma = 1,
                lambda = 0.95), k1 KL in the reward, value clip 0.2, critic warmup.
  sapo          Qwen team 2025, "Soft Adaptive Policy Optimization": the clip replaced by
                a sigmoid gate (tau_pos = 1, tau_neg = 1.05), seq-mean-token-mean, beta = 0.
  gmpo          Zhao et al. 2025, "Geometric-Mean Policy Optimization": the geometric mean
                of token ratios clipped in log space (eps 0.4), seq-mean-token-mean, beta = 0.

The policy losses clip_cov, kl_cov (Cui et al. 2025), dppo_tv and dppo_kl (DPPO) are
`policy_loss` values over any preset (policy_losses.py).

    from jaxrl_llm.rl import algos
    cfg = algos.preset("dapo", entropy_coef=1e-3)

G (completions per prompt) and L_max (the completion budget) are not algorithm settings:
they come from the rollout (`sampling.RolloutSpec`: num_generations, max_new_tokens), which
the update reads; `check_num_generations` says whether an estimator can use a given G.
"""

from __future__ import annotations

import dataclasses
import math

from jaxrl_llm.rl.advantages import ADVANTAGE_KINDS, STD_SCALES
from jaxrl_llm.rl.losses import AGGREGATIONS, KL_ESTIMATORS, OFF_POLICY, POLICY_LOSSES
from jaxrl_llm.rl.policy_losses import ratio_fraction

GROUP_ESTIMATORS = ("grpo", "rloo")
ROUTING_REPLAY = ("none", "rollout")  # AlgoConfig.routing_replay


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
    """Every knob of the advantage estimator and the policy / value losses.

    Paper symbols: beta = beta, eps_low / eps_high = eps_low / eps_high,
    c = dual_clip, C = tis_cap, c_H = entropy_coef, gamma = gamma, lambda = lam,
    eps_v = value_clip, mu = num_iterations, L_c = overlong_buffer_frac * L_max (G and
    L_max are the rollout's: `sampling.RolloutSpec`). Frozen and hashable, so it can be a
    static argument of `jax.jit` or be closed over.

    Attributes:
      name: preset this config came from (informational).
      advantage: estimator, one of grpo | rloo | reinforce_pp | gae.
      adv_scale: GRPO std scaling: group | batch | none (none = Dr. GRPO).
      adv_eps: eps added to every std before dividing.
      decouple_rewards: with several reward functions ([N, K] rewards), GDPO's
        per-function group normalisation instead of normalising their weighted sum.
      reward_weights: K weights for [N, K] rewards (None = all 1).
      gamma, lam: discount and GAE lambda (token-level estimators).
      whiten_advantages: whiten token advantages over the batch (reinforce_pp, gae).
      policy_loss: ppo | gspo | cispo | sapo | gmpo | clip_cov | kl_cov | dppo_tv |
        dppo_kl (policy_losses.py for the last six).
      eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high] of rho (or of s_i for gspo);
        for gmpo the clip of log rho, [-eps_low, eps_high]; for dppo_tv / dppo_kl the
        trust region's TV / binary-KL thresholds.
      sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures for A > 0 and A <= 0.
      clip_cov_ratio, clip_cov_lb, clip_cov_ub: the fraction of tokens Clip-Cov may
        detach and the covariance band it draws them from.
      kl_cov_ratio, kl_cov_coef: the fraction of tokens (largest covariance) KL-Cov
        penalises and the penalty's coefficient.
      ratio_cap: C of DPPO's truncated weight sg(min(rho, C)).
      distill_coef: w of the on-policy distillation advantage w (log pi_T - log pi_S)
        added to every sampled token (advantages.py); 0 = no teacher. The trainer sets it
        from `teacher.weight` when `teacher.path` is set.
      dual_clip: c > 1 caps the loss of A < 0 tokens at -c A; None = off.
      off_policy: the weight of each token for the policy that sampled it (the behaviour
        policy) differing from pi_old: none | tis | icepop | decoupled (`losses` module doc;
        rho is always pi_theta / pi_old, pi_old the policy at the start of the update).
      tis_cap: C: tis truncates the weight pi_old / pi_behaviour at C (None = no weight);
        decoupled masks the tokens whose weight exceeds C.
      icepop_low, icepop_high: icepop's band; tokens with a weight outside get no gradient.
      beta: KL coefficient; 0 skips the reference model entirely.
      kl_estimator: k1 | k2 | k3.
      kl_in_reward: fold beta * KL into the reward instead of adding it to the loss.
      entropy_coef: c_H of the entropy bonus.
      loss_agg: token-mean | seq-mean-token-mean | seq-mean-token-sum |
        seq-mean-token-sum-norm.
      num_iterations: mu, optimisation passes over each batch of rollouts.
      value_clip: eps_v of the clipped value loss; None = unclipped.
      critic_warmup_steps: steps that train only the critic before the policy moves.
      dynamic_sampling: drop groups with all-equal rewards and resample (DAPO).
      max_resample_rounds: cap on extra sampling rounds for dynamic sampling.
      overlong_penalty: add DAPO's soft overlong penalty to the reward.
      overlong_buffer_frac: L_c / L_max (DAPO: 4096 / 20480 = 0.2).
    """

    name: str = "custom"
    advantage: str = "grpo"
    adv_scale: str = "group"
    adv_eps: float = 1e-6
    decouple_rewards: bool = False
    reward_weights: tuple[float, ...] | None = None
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    policy_loss: str = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    kl_cov_coef: float = 0.1
    ratio_cap: float = 20.0
    distill_coef: float = 0.0
    off_policy: str = "tis"
    tis_cap: float | None = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 2.0
    beta: float = 0.0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"
    num_iterations: int = 1
    value_clip: float | None = 0.2
    critic_warmup_steps: int = 0
    dynamic_sampling: bool = False
    max_resample_rounds: int = 4
    overlong_penalty: bool = False
    overlong_buffer_frac: float = 0.2
    # Mixture-of-experts models: "rollout" replays the experts the sampler routed each
    # token to in the reference, old-policy and update forwards (R3); "none" lets each
    # forward route by itself (docs/moe.md).
    routing_replay: str = "none"

    def __post_init__(self):
        if self.reward_weights is not None:  # lists from a command line become tuples
            object.__setattr__(self, "reward_weights", tuple(map(float, self.reward_weights)))
        for error in _errors(self):
            raise ValueError(f"algo.{error}")

    @property
    def needs_groups(self) -> bool:
        """Whether the advantage compares the G samples of a prompt (G >= 2 needed)."""
        return self.advantage in GROUP_ESTIMATORS or self.decouple_rewards

    @property
    def uses_critic(self) -> bool:
        return self.advantage == "gae"

    @property
    def needs_ref(self) -> bool:
        """Whether the reference model's logprobs are needed at all (beta > 0)."""
        return self.beta > 0


def _choice(cfg, field, options):
    value = getattr(cfg, field)
    if value not in options:
        return f"{field}={value!r}: expected one of {', '.join(options)}"
    return None


def _decouple_ok(cfg) -> bool:
    return not cfg.decouple_rewards or (cfg.advantage == "grpo" and not cfg.kl_in_reward)


def _few_decimals(ratio: float) -> bool:
    """The covariance losses' exact token budget (policy_losses.budget) needs the ratio's
    decimal denominator small enough for int32 arithmetic."""
    return math.isfinite(ratio) and ratio_fraction(ratio).denominator <= 10**6


def _errors(cfg: AlgoConfig):
    """Yield one line per invalid field, naming it (the first is raised)."""
    for field, options in (
        ("advantage", ADVANTAGE_KINDS),
        ("adv_scale", STD_SCALES),
        ("policy_loss", POLICY_LOSSES),
        ("kl_estimator", KL_ESTIMATORS),
        ("off_policy", OFF_POLICY),
        ("loss_agg", AGGREGATIONS),
        ("routing_replay", ROUTING_REPLAY),
    ):
        if (error := _choice(cfg, field, options)) is not None:
            yield error
    checks = (
        ("adv_eps", cfg.adv_eps >= 0, "must be >= 0"),
        ("decouple_rewards", _decouple_ok(cfg), "needs advantage='grpo', kl_in_reward=False"),
        ("gamma", 0 <= cfg.gamma <= 1, "must be in [0, 1]"),
        ("lam", 0 <= cfg.lam <= 1, "must be in [0, 1]"),
        ("eps_low", 0 <= cfg.eps_low < 1, "must be in [0, 1)"),
        ("eps_high", cfg.eps_high >= 0, "must be >= 0"),
        ("dual_clip", cfg.dual_clip is None or cfg.dual_clip > 1, "must be > 1 or None"),
        ("sapo_tau_pos", cfg.sapo_tau_pos > 0, "must be > 0"),
        ("sapo_tau_neg", cfg.sapo_tau_neg > 0, "must be > 0"),
        ("clip_cov_ratio", 0 < cfg.clip_cov_ratio <= 1, "must be in (0, 1]"),
        ("clip_cov_ratio", _few_decimals(cfg.clip_cov_ratio), "at most 6 decimal places"),
        ("clip_cov_ub", cfg.clip_cov_lb < cfg.clip_cov_ub, "must be > clip_cov_lb"),
        ("kl_cov_ratio", 0 < cfg.kl_cov_ratio <= 1, "must be in (0, 1]"),
        ("kl_cov_ratio", _few_decimals(cfg.kl_cov_ratio), "at most 6 decimal places"),
        ("kl_cov_coef", cfg.kl_cov_coef >= 0, "must be >= 0"),
        ("ratio_cap", cfg.ratio_cap > 0, "must be > 0"),
        ("distill_coef", cfg.distill_coef >= 0, "must be >= 0"),
        ("tis_cap", cfg.tis_cap is None or cfg.tis_cap > 0, "must be > 0 or None"),
        (
            "tis_cap",
            cfg.off_policy != "decoupled" or cfg.tis_cap is not None,
            "off_policy='decoupled' needs the cap (e.g. 2.0)",
        ),
        (
            "icepop_low",
            0 <= cfg.icepop_low <= 1 <= cfg.icepop_high,
            f"icepop needs icepop_low <= 1 <= icepop_high (got high={cfg.icepop_high!r})",
        ),
        ("beta", cfg.beta >= 0, "must be >= 0"),
        ("num_iterations", cfg.num_iterations >= 1, "must be >= 1"),
        ("value_clip", cfg.value_clip is None or cfg.value_clip > 0, "must be > 0 or None"),
        ("critic_warmup_steps", cfg.critic_warmup_steps >= 0, "must be >= 0"),
        ("max_resample_rounds", cfg.max_resample_rounds >= 0, "must be >= 0"),
        ("overlong_buffer_frac", 0 < cfg.overlong_buffer_frac <= 1, "must be in (0, 1]"),
    )
    for field, ok, why in checks:
        if not ok:
            yield f"{field}={getattr(cfg, field)!r}: {why}"


PRESETS: dict[str, dict] = {
    "grpo": dict(adv_scale="group", beta=0.04, kl_estimator="k3", loss_agg="seq-mean-token-mean"),
    "dr_grpo": dict(adv_scale="none", beta=0.0, loss_agg="seq-mean-token-sum-norm"),
    "dapo": dict(
        eps_low=0.2,
        eps_high=0.28,
        loss_agg="token-mean",
        beta=0.0,
        dynamic_sampling=True,
        overlong_penalty=True,
    ),
    "gspo": dict(policy_loss="gspo", eps_low=3e-4, eps_high=4e-4, loss_agg="seq-mean-token-mean"),
    "sapo": dict(policy_loss="sapo", loss_agg="seq-mean-token-mean", beta=0.0),
    "gmpo": dict(policy_loss="gmpo", eps_low=0.4, eps_high=0.4, loss_agg="seq-mean-token-mean"),
    "rloo": dict(advantage="rloo", beta=0.05, kl_estimator="k1", kl_in_reward=True),
    "reinforce_pp": dict(
        advantage="reinforce_pp",
        beta=0.01,
        kl_estimator="k1",
        kl_in_reward=True,
        whiten_advantages=True,
    ),
    "ppo": dict(
        advantage="gae",
        gamma=1.0,
        lam=0.95,
        beta=0.01,
        kl_estimator="k1",
        kl_in_reward=True,
        value_clip=0.2,
        critic_warmup_steps=5,
    ),
}


def preset(name: str, **overrides) -> AlgoConfig:
    """The named preset with `overrides` applied (validated like any AlgoConfig)."""
    if name not in PRESETS:
        raise ValueError(f"algo.name={name!r}: unknown preset; known: {', '.join(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(AlgoConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"algo.{unknown[0]}: unknown field of AlgoConfig")
    return AlgoConfig(**{"name": name, **PRESETS[name], **overrides})


def check_num_generations(cfg: AlgoConfig, num_generations: int) -> None:
    """Raises ValueError when the estimator cannot work with G = num_generations."""
    if num_generations < 1 or (cfg.needs_groups and num_generations < 2):
        raise ValueError(
            f"num_generations={num_generations}: algo.advantage={cfg.advantage!r} compares "
            "the samples of a prompt, so it needs >= 2"
        )
