"""RL math and the update step: advantages, losses, chunked log-probs, presets, shaping.

    update = make_update_fn(model_cfg, algo, opt, spec)           # jitted, state donated
    state, metrics = update(state, RolloutBatch.from_sample(out, rewards, ref_logprobs))

The update step calls, per batch and micro-batch (G and L_max from the rollout spec):

    adv = compute_advantages(cfg, rewards, loss_mask, G, old_logp=, ref_logp=, values=)
    den = loss_denominator(loss_mask, cfg.loss_agg, L_max)                     # full batch
    logp, entropy = token_logprobs(hidden, unembed, targets, temperature=...)  # micro-batch
    loss, metrics = policy_objective(cfg, logp, old_logp, behaviour_logp, ref_logp,
                                     adv.advantages, loss_mask, entropy, denominator=den)
"""

from jaxrl_llm.rl import batch, critic, optim, prefix, shaping, update
from jaxrl_llm.rl.advantages import (
    ADVANTAGE_KINDS,
    STD_SCALES,
    Advantages,
    compute_advantages,
    discounted_returns,
    distillation_advantages,
    gae,
    group_advantages,
    multi_reward_advantages,
    rloo_advantages,
    token_rewards,
    whiten,
)
from jaxrl_llm.rl.algos import PRESETS, AlgoConfig, check_num_generations, preset
from jaxrl_llm.rl.batch import RolloutBatch, make_logprob_fn
from jaxrl_llm.rl.critic import init_critic
from jaxrl_llm.rl.logprobs import token_logprobs
from jaxrl_llm.rl.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    MAX_LOG_RATIO,
    POLICY_LOSSES,
    aggregate,
    aggregation_parts,
    cispo_loss,
    clipped_values,
    kl_penalty,
    log_ratio,
    loss_denominator,
    masked_mean,
    off_policy_weight,
    policy_objective,
    policy_term,
    ppo_clip_loss,
    sequence_log_ratio,
    value_loss,
    value_objective,
)
from jaxrl_llm.rl.optim import MasterWeights, Optimizer, make_optimizer, optimizer_from_config
from jaxrl_llm.rl.shaping import degenerate_groups, overlong_penalty
from jaxrl_llm.rl.state import TrainState, checkpointed, init_train_state, owned
from jaxrl_llm.rl.update import make_update_fn

__all__ = [
    "ADVANTAGE_KINDS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "MAX_LOG_RATIO",
    "POLICY_LOSSES",
    "PRESETS",
    "STD_SCALES",
    "AlgoConfig",
    "Advantages",
    "MasterWeights",
    "Optimizer",
    "RolloutBatch",
    "TrainState",
    "aggregate",
    "aggregation_parts",
    "batch",
    "check_num_generations",
    "cispo_loss",
    "clipped_values",
    "compute_advantages",
    "distillation_advantages",
    "critic",
    "degenerate_groups",
    "discounted_returns",
    "gae",
    "group_advantages",
    "init_critic",
    "checkpointed",
    "init_train_state",
    "owned",
    "kl_penalty",
    "log_ratio",
    "loss_denominator",
    "make_logprob_fn",
    "make_optimizer",
    "make_update_fn",
    "masked_mean",
    "multi_reward_advantages",
    "optim",
    "optimizer_from_config",
    "overlong_penalty",
    "policy_objective",
    "policy_term",
    "ppo_clip_loss",
    "prefix",
    "preset",
    "rloo_advantages",
    "sequence_log_ratio",
    "shaping",
    "off_policy_weight",
    "token_logprobs",
    "token_rewards",
    "update",
    "value_loss",
    "value_objective",
    "whiten",
]
