"""RL math: advantage estimators, policy / KL / value losses, chunked logprobs, presets.

The update step calls, per batch and micro-batch:

    adv = compute_advantages(cfg, rewards, loss_mask, old_logp=..., ref_logp=..., values=...)
    den = loss_denominator(loss_mask, cfg.loss_agg, cfg.max_completion_len)   # full batch
    logp, entropy = token_logprobs(hidden, unembed, targets, temperature=...)  # micro-batch
    loss, metrics = policy_objective(cfg, logp, old_logp, sampler_logp, ref_logp,
                                     adv.advantages, loss_mask, entropy, denominator=den)
"""

from jaxrl_llm.rl.advantages import (
    ADVANTAGE_KINDS,
    STD_SCALES,
    Advantages,
    compute_advantages,
    degenerate_groups,
    discounted_returns,
    gae,
    group_advantages,
    multi_reward_advantages,
    overlong_penalty,
    rloo_advantages,
    token_rewards,
    whiten,
)
from jaxrl_llm.rl.algos import PRESETS, AlgoConfig, preset
from jaxrl_llm.rl.logprobs import token_logprobs
from jaxrl_llm.rl.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    aggregate,
    aggregation_parts,
    cispo_loss,
    kl_penalty,
    log_ratio,
    loss_denominator,
    masked_mean,
    policy_objective,
    policy_term,
    ppo_clip_loss,
    sequence_log_ratio,
    tis_weight,
    value_loss,
    value_objective,
)

__all__ = [
    "ADVANTAGE_KINDS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "PRESETS",
    "STD_SCALES",
    "AlgoConfig",
    "Advantages",
    "aggregate",
    "aggregation_parts",
    "cispo_loss",
    "compute_advantages",
    "degenerate_groups",
    "discounted_returns",
    "gae",
    "group_advantages",
    "kl_penalty",
    "log_ratio",
    "loss_denominator",
    "masked_mean",
    "multi_reward_advantages",
    "overlong_penalty",
    "policy_objective",
    "policy_term",
    "ppo_clip_loss",
    "preset",
    "rloo_advantages",
    "sequence_log_ratio",
    "tis_weight",
    "token_logprobs",
    "token_rewards",
    "value_loss",
    "value_objective",
    "whiten",
]

# The update step (update.py), its optimizer (optim.py), the PPO critic (critic.py) and
# the rollout batch (batch.py); `from jaxrl_llm.rl import update as U` gives all of them.
from jaxrl_llm.rl import batch, critic, optim, update  # noqa: E402
from jaxrl_llm.rl.batch import Batch, batch_from_rollout, make_logprob_fn  # noqa: E402
from jaxrl_llm.rl.critic import init_critic  # noqa: E402
from jaxrl_llm.rl.optim import MasterWeights, Optimizer, make_optimizer  # noqa: E402
from jaxrl_llm.rl.update import TrainState, init_train_state, make_update_fn  # noqa: E402

__all__ += [
    "Batch",
    "Optimizer",
    "TrainState",
    "batch",
    "batch_from_rollout",
    "critic",
    "init_critic",
    "init_train_state",
    "make_logprob_fn",
    "MasterWeights",
    "make_optimizer",
    "make_update_fn",
    "optim",
    "update",
]
