"""The rollout contract: what is sampled, read by the sampler, the reference log-probs and
the update alike.

    spec = RolloutSpec(num_generations=8, max_new_tokens=64, temperature=1.0, stop_ids=(eos,))
    out = sampler.sample(params, prompt_ids, prompt_mask, spec, step)   # [B * G] rows
    ref = make_logprob_fn(model_cfg, spec)(ref_params, out)             # same temperature
    update = make_update_fn(model_cfg, algo, opt, spec)                  # same G, same T

Log-probs are log softmax(logits / temperature): they are only comparable between the
sampler, the reference and the update when all three use the same temperature, so the
temperature exists once, here. G (`num_generations`) likewise: rows are prompt-major,
the G completions of prompt b are rows b * G ... b * G + G - 1, and the group estimators,
the shared-prompt forwards and the sampler's group prefill all read G from this spec.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """Static settings of a rollout (hashable: a jit static argument).

    Attributes:
      num_generations: G, completions per prompt (rows are prompt-major, B * G of them).
      max_new_tokens: T, the completion budget of one `Sampler.decode` call and the
        completion length of a single-turn rollout (L_max of Dr. GRPO's aggregation).
      temperature: sampling temperature; 0 = greedy. Log-probs are taken at this
        temperature (at 1 when greedy), by the sampler and by every recompute.
      top_k: keep the k most likely tokens (0 = off); only restricts the draw.
      top_p: nucleus mass (1 = off); only restricts the draw.
      stop_ids: token ids that end a row (the stop token is part of the completion).
    """

    num_generations: int = 1
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self):
        # Lists from a config become tuples, numpy scalars plain numbers: hashable, exact.
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("num_generations", int(self.num_generations))
        set_("max_new_tokens", int(self.max_new_tokens))
        set_("temperature", float(self.temperature))
        set_("top_k", int(self.top_k))
        set_("top_p", float(self.top_p))
        set_("stop_ids", tuple(int(s) for s in self.stop_ids))
        for error in _errors(self):
            raise ValueError(error)

    @property
    def logprob_temperature(self) -> float:
        """The temperature log-probs are taken at: the sampling one, or 1 when greedy."""
        return self.temperature or 1.0

    def replace(self, **changes) -> RolloutSpec:
        return dataclasses.replace(self, **changes)


def _errors(spec: RolloutSpec):
    checks = (
        (spec.num_generations >= 1, f"num_generations={spec.num_generations}: must be >= 1"),
        (spec.max_new_tokens >= 1, f"max_new_tokens={spec.max_new_tokens}: must be >= 1"),
        (spec.temperature >= 0, f"temperature={spec.temperature}: must be >= 0 (0 = greedy)"),
        (spec.top_k >= 0, f"top_k={spec.top_k}: must be >= 0 (0 = off)"),
        (0.0 < spec.top_p <= 1.0, f"top_p={spec.top_p}: must be in (0, 1]"),
        (all(s >= 0 for s in spec.stop_ids), f"stop_ids={spec.stop_ids}: must be >= 0"),
    )
    for ok, message in checks:
        if not ok:
            yield message
