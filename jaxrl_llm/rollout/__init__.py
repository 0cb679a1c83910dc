"""The rollout wing: where a step's rollout comes from, between the engines (`sampling`)
and the step (`trainer.run`).

- `sources`: the rollout sources by schedule (`Sampled`: now; `SampledAhead`: overlap;
  `Refilled`: DAPO's dynamic sampling), the sampler factory (`make_sampler`) and the
  `Sampling` bundle they share; `thread`: the rollout thread (over the engine's 'stream'
  session, `sampling.engine`) and its `Handoff` with the learner (split, and overlap with
  players or the paged engine); `modes`: the config -> its source, the one place that
  picks.
- Players by content: `played` (multi-turn environments, `EnvRollout`), `agents` (agents
  through the OpenAI-compatible gateway, `AgentRollout`).
- `scoring`: completion ids -> text -> verifier rewards on the host; `evaluation`:
  held-out pass@k.

It imports the engines, envs and the gateway; the trainer imports it; nothing here
imports the trainer.
"""
