"""The trainer layer: a run built from a config, its step, and the loop around it.

- `run`: `Run` (models, sampler, scorer, data, programs) and `Run.step` -> `StepResult`;
  `teachers`: on-policy distillation's teachers (loaded once each, each row's picked);
  `judges`: judge-model rewards.
- `loop`: `train(config, workdir)` (lock, resume, checkpoints, metrics, progress).
  `checkpoint`, `metrics`, `workdir`, `perf`, `console`: what the loop keeps and reports.

Where a step's rollout comes from (sources, players, scoring, evaluation) is the
`rollout` wing. The core (models, sampling, rl, envs, verifiers, data) imports nothing
from here.
"""
