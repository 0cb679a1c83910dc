"""The trainer layer: a run built from a config, its step, and the loop around it.

- `run`: `Run` (models, sampler, scorer, data, programs) and `Run.step` -> `StepResult`;
  `teachers`: on-policy distillation's teachers (loaded once each, each row's picked);
  `modes`: the config -> its rollout source.
- `sources`: where a step's rollout comes from, one object per way (sync, overlap, DAPO's
  refill); `rollout_thread` (split) and `played` (multi-turn environments) add theirs.
- `scoring`: completion ids -> text -> verifier rewards on the host.
- `evaluation`: held-out pass@k. `loop`: `train(config, workdir)` (lock, resume,
  checkpoints, metrics, progress). `checkpoint`, `metrics`, `workdir`, `perf`: what the
  loop keeps and reports.

The core (models, sampling, rl, envs, verifiers, data) imports nothing from here.
"""
