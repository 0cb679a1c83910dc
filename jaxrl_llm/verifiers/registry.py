"""Verifiers by name: the built-ins, user functions, and the config's list of rewards.

A verifier is a plain top-level function `(completion: str, example: dict) -> float`, plus
keyword options. A name is one of:

- a built-in: `gsm8k`, `math`, `format`, `countdown`, `python_tests`; and `judge`, a
  model on the mesh that the trainer runs (judge.py), never the pool;
- a name given to `register` in an importable module;
- `path/to/file.py:function` (relative paths are resolved against the current directory
  when the config is parsed) or `package.module:function`.

Names, not function objects, travel to the pool's workers, which import the function
themselves; options are bound with `functools.partial`, so everything stays picklable.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

from jaxrl_llm.registry import Registry


class VerifierTimeout(Exception):
    """Raised by a verifier whose own time limit ran out (the sandbox's `wall_s`): the
    sample scores 0 and counts in `verifier/timeouts`, and, unlike a verifier that hangs
    past the pool's timeout, never as a broken verifier."""


def _bind(fn, options: dict):
    """`fn` with keyword `options` bound (a partial of a top-level function pickles)."""
    return functools.partial(fn, **options) if options else fn


VERIFIERS = Registry(
    "verifier",
    builtins={
        "gsm8k": "jaxrl_llm.verifiers.numeric:gsm8k",
        "math": "jaxrl_llm.verifiers.math:math_answer",
        "format": "jaxrl_llm.verifiers.fmt:format_match",
        "countdown": "jaxrl_llm.verifiers.countdown:countdown",
        "python_tests": "jaxrl_llm.verifiers.code:python_tests",
        # A model on the mesh, run by the trainer (verifiers/judge.py, trainer/judges.py).
        "judge": "jaxrl_llm.verifiers.judge:judge",
        "reasoning_gym": "jaxrl_llm.data.reasoning_gym:score",  # the task's own scorer
    },
    kind="function",
    check=callable,
    expected="a function",
    build=_bind,
    fixed_args=2,  # (completion, example)
    options_key="rewards.<label>.options",
    # Names that are not verifiers, and where what they did lives.
    elsewhere={
        "overlong": "DAPO's overlong penalty is applied by the trainer to the sampled token "
        "counts: algo.overlong_penalty=True (buffer: algo.overlong_buffer_frac)",
    },
)
BUILTINS = VERIFIERS.builtins
register = VERIFIERS.register
canonical = VERIFIERS.canonical
resolve = VERIFIERS.resolve
get = VERIFIERS.get
check_options = VERIFIERS.check_options


@dataclasses.dataclass(frozen=True)
class VerifierSpec:
    """One reward term: `weight * verifier(completion, example, **options)`.

    Attributes:
      label: unique name of the term in metrics (`reward/<label>`).
      name: verifier name (built-in, registered, or a file/module reference).
      weight: multiplier in the summed reward.
      options: keyword options bound to the verifier.
    """

    label: str
    name: str
    weight: float
    options: dict = dataclasses.field(default_factory=dict)


def _label(name) -> str:
    """Metric label of a verifier name: `my_rewards.py:brevity` logs as `brevity`."""
    return str(name).rpartition(":")[2]


def _spec_from_entry(entry, where: str) -> tuple[str, str, object, dict]:
    """(label, name, weight, options) from one config entry; see `parse_specs`."""
    if isinstance(entry, str):
        return _label(entry), entry, 1.0, {}
    if isinstance(entry, Sequence) and 2 <= len(entry) <= 3:
        name, weight, options = (*entry, {})[:3]
        return _label(name), name, weight, options
    if isinstance(entry, Mapping):
        entry = dict(entry)
        unknown = set(entry) - {"name", "weight", "options", "label"}
        if unknown or "name" not in entry:
            raise ValueError(
                f"{where}: expected keys name, weight, options (, label); got {sorted(entry)}"
            )
        label = entry.get("label") or _label(entry["name"])
        return label, entry["name"], entry.get("weight", 1.0), entry.get("options") or {}
    raise ValueError(f"{where}: expected (name, weight[, options]) or a dict, got {entry!r}")


def _entries(config) -> list[tuple[str, object]]:
    """[(where, entry)] from a sequence of entries or a mapping label -> weight / dict."""
    if isinstance(config, Mapping) or hasattr(config, "to_dict"):
        config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        out = []
        for label, value in config.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                value = {"name": label, "weight": value}
            elif isinstance(value, Mapping):
                value = {"name": label, "label": label, **dict(value)}
            out.append((f"rewards.{label}", value))
        return out
    if isinstance(config, str) or not isinstance(config, Sequence):
        raise ValueError(f"rewards: expected a list of verifiers or a mapping, got {config!r}")
    return [(f"rewards[{i}]", entry) for i, entry in enumerate(config)]


def parse_specs(config) -> list[VerifierSpec]:
    """Reward terms from a config, checked against each verifier's signature.

    Accepted shapes (mixable in a list):
      `[("gsm8k", 1.0), ("format", 0.1, {"pattern": "..."})]`, `["gsm8k"]`,
      `[{"name": "gsm8k", "weight": 1.0, "options": {...}, "label": "acc"}]`, or a mapping
      (ConfigDict-friendly, so `--config.rewards.format.weight=0.2` works):
      `{"gsm8k": 1.0, "format": {"weight": 0.1, "options": {"pattern": "..."}},
        "mine": {"name": "my_rewards.py:fn", "weight": 0.5}}`.
    A repeated label gets a suffix (`format`, `format_2`) so each term logs separately.

    Raises:
      ValueError: naming the entry (`rewards[1]`, `rewards.format.weight`) that is wrong.
    """
    if isinstance(config, Sequence) and config and all(isinstance(s, VerifierSpec) for s in config):
        return list(config)
    specs, seen = [], {}
    for where, entry in _entries(config):
        label, name, weight, options = _spec_from_entry(entry, where)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: verifier name must be a non-empty string, got {name!r}")
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not math.isfinite(weight)
        ):
            raise ValueError(f"{where}.weight: expected a finite number, got {weight!r}")
        if hasattr(options, "to_dict"):
            options = options.to_dict()
        if not isinstance(options, Mapping):
            raise ValueError(f"{where}.options: expected a mapping, got {options!r}")
        try:
            check_options(canonical(name), options)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            label = f"{label}_{seen[label]}"
        specs.append(
            VerifierSpec(
                label=str(label), name=canonical(name), weight=float(weight), options=dict(options)
            )
        )
    if not specs:
        raise ValueError("rewards: no verifier configured")
    return specs
