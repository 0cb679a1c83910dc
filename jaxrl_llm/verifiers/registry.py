"""Verifiers by name: the built-ins, user functions, and the config's list of rewards.

A verifier is a plain top-level function `(completion: str, example: dict) -> float`, plus
keyword options. A name is one of:

- a built-in: `gsm8k`, `math`, `format`, `countdown`, `python_tests`;
- a name given to `register` in an importable module;
- `path/to/file.py:function` (relative paths are resolved against the current directory
  when the config is parsed) or `package.module:function`.

Names, not function objects, travel to the pool's workers, which import the function
themselves; options are bound with `functools.partial`, so everything stays picklable.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence

BUILTINS = {
    "gsm8k": "jaxrl_llm.verifiers.numeric:gsm8k",
    "math": "jaxrl_llm.verifiers.math:math_answer",
    "format": "jaxrl_llm.verifiers.fmt:format_match",
    "countdown": "jaxrl_llm.verifiers.countdown:countdown",
    "python_tests": "jaxrl_llm.verifiers.code:python_tests",
}
# Names that are not verifiers, and where what they did lives.
ELSEWHERE = {
    "overlong": "DAPO's overlong penalty is applied by the trainer to the sampled token "
    "counts: algo.overlong_penalty=True (buffer: algo.overlong_buffer_frac)",
}
_REGISTERED: dict[str, str] = {}


class VerifierTimeout(Exception):
    """Raised by a verifier whose own time limit ran out (the sandbox's `wall_s`): the
    sample scores 0 and counts in `verifier/timeouts`, and, unlike a verifier that hangs
    past the pool's timeout, never as a broken verifier."""


def register(name: str):
    """Decorator: make a top-level function available as verifier `name`.

    The module defining it must be importable in the pool's workers (not `__main__` or a
    notebook cell); for a one-off file use the `path/to/file.py:function` form instead.
    """

    def wrap(fn: Callable) -> Callable:
        if fn.__module__ == "__main__" or "<locals>" in fn.__qualname__:
            raise ValueError(
                f"register({name!r}): {fn.__qualname__} must be a top-level function of an "
                "importable module, or be named as 'path/to/file.py:function'"
            )
        if name in BUILTINS:
            raise ValueError(f"register({name!r}): that name is a built-in verifier")
        _REGISTERED[name] = f"{fn.__module__}:{fn.__qualname__}"
        return fn

    return wrap


def _load_file(path: str):
    """Imports a .py file once per process under a name derived from its absolute path."""
    module_name = "_jaxrl_llm_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if module_name not in sys.modules:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"verifier file {path!r} does not exist")
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # before exec: pickling by reference needs it
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return sys.modules[module_name]


def canonical(name: str) -> str:
    """`name` with a relative `file.py:function` path made absolute (workers may not share
    the caller's working directory)."""
    target, sep, attr = name.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target):
        return f"{os.path.abspath(target)}:{attr}"
    return name


@functools.lru_cache(maxsize=256)
def resolve(name: str) -> Callable:
    """The function behind a verifier name (see module docstring), imported on first use.

    Raises:
      ValueError: unknown name, or the target is not callable.
    """
    if name in ELSEWHERE:
        raise ValueError(f"{name!r} is not a verifier: {ELSEWHERE[name]}")
    ref = BUILTINS.get(name) or _REGISTERED.get(name) or name
    known = sorted(BUILTINS) + sorted(_REGISTERED)
    fn, target, attr = load_reference(ref, f"verifier {name!r}", known, "function")
    if not callable(fn):
        raise ValueError(f"verifier {name!r}: {attr!r} is not a function in {target!r}")
    return fn


def load_reference(ref: str, what: str, known, kind: str):
    """The object behind 'path/to/file.py:attr' or 'package.module:attr' (dotted attr
    allowed) -> (object or None, target, attr); ValueError naming `what` when `ref` is
    not of that form (listing the `known` names)."""
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(
            f"unknown {what}; built-ins and registered: {', '.join(known)}; or give "
            f"'path/to/file.py:{kind}' or 'package.module:{kind}'"
        )
    if target.endswith(".py") or "/" in target:
        module = _load_file(os.path.abspath(target))
    else:
        module = importlib.import_module(target)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    return obj, target, attr


def check_keywords(what: str, params, options: Mapping) -> None:
    """Raises ValueError naming `what` (e.g. "verifier 'format'") for an option that none
    of the parameters `params` (inspect.Parameter) takes; any goes with a **kwargs."""
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    allowed = {p.name for p in params}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(
            f"{what} has no option {', '.join(map(repr, unknown))}; "
            f"its options: {', '.join(sorted(allowed)) or '(none)'}"
        )


def check_options(name: str, options: Mapping) -> None:
    """Raises ValueError naming the verifier when `options` do not fit its signature."""
    params = list(inspect.signature(resolve(name)).parameters.values())[2:]
    check_keywords(f"verifier {name!r}", params, options)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    missing = [p.name for p in params if p.default is p.empty and p.name not in options]
    if missing:
        raise ValueError(f"verifier {name!r} needs option(s): {', '.join(missing)}")


def get(name: str, **options) -> Callable[[str, dict], float]:
    """The verifier `name` with `options` bound: `fn(completion, example) -> float`.

    Example:
      >>> fn = get("format", pattern=r"^<answer>.*</answer>$")
      >>> fn("<answer>4</answer>", {})
      1.0
    """
    name = canonical(name)
    check_options(name, options)
    fn = resolve(name)
    return functools.partial(fn, **options) if options else fn


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
        except (ValueError, ImportError, OSError, SyntaxError) as err:
            raise ValueError(f"{where}: {err}") from err
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            label = f"{label}_{seen[label]}"
        specs.append(VerifierSpec(str(label), canonical(name), float(weight), dict(options)))
    if not specs:
        raise ValueError("rewards: no verifier configured")
    return specs
