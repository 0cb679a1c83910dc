"""Things picked by name: one `Registry` per kind (environments, verifiers).

A name is one of:

- a built-in (the registry's `builtins`: name -> 'package.module:attr');
- a name given to `register` by a top-level function or class of an importable module;
- 'path/to/file.py:attr' (a relative path is made absolute by `canonical`, since workers
  may start in another directory) or 'package.module:attr' (dotted attr allowed).

Names, not objects, travel to worker processes, which import the object themselves:
`canonical` turns a registered name into its 'module:attr' (a worker has not run the
registering module's decorators). This module imports nothing of the trainer's (nor JAX):
the workers import it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping


def load_file(path: str):
    """Imports the .py file at absolute `path` once per process, under a name derived from
    the path (pickles of its functions and classes refer to that name)."""
    module_name = "_jaxrl_llm_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if module_name not in sys.modules:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"file {path!r} does not exist")
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # before exec: pickling by reference needs it
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return sys.modules[module_name]


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target


def check_keywords(what: str, params, options: Mapping, where: str = "its options") -> None:
    """Raises ValueError naming `what` (e.g. "verifier 'format'") for an option that none
    of `params` (inspect.Parameter) takes, or for a parameter without a default that
    `options` lack (saying to set it in `where`); any option goes with a **kwargs."""
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    allowed = {p.name for p in params}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(
            f"{what} has no option {', '.join(map(repr, unknown))}; "
            f"its options: {', '.join(sorted(allowed)) or '(none)'}"
        )
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    missing = [
        p.name for p in params if p.kind in named and p.default is p.empty and p.name not in options
    ]
    if missing:
        raise ValueError(
            f"{what} needs option(s) {', '.join(map(repr, missing))}; set them in {where}"
        )


class Registry:
    """Names -> objects of one kind, and the checks of their keyword options.

    Args:
      what: the kind in messages ("environment": "unknown environment 'x'; ...").
      builtins: built-in name -> 'package.module:attr'.
      kind: what the attr of a reference names, in messages ('path/to/file.py:<kind>').
      check: whether a resolved object is one of this kind ...
      expected: ... and what it is when it is not ("a function").
      build: (object, options) -> the object with its options (`get`).
      fixed_args: leading parameters not given by options (a verifier's completion and
        example); the object's signature is read past them.
      elsewhere: names that are not of this kind -> where what they did lives.
      options_key: where a user sets the options, in messages ("env.options").
    """

    def __init__(
        self,
        what: str,
        *,
        builtins: Mapping[str, str],
        kind: str,
        check: Callable[[object], bool],
        expected: str,
        build: Callable[[object, dict], object],
        fixed_args: int = 0,
        elsewhere: Mapping[str, str] | None = None,
        options_key: str = "its options",
    ):
        self.what, self.kind, self.expected = what, kind, expected
        self.builtins = dict(builtins)
        self.elsewhere = dict(elsewhere or {})
        self.options_key = options_key
        self._check, self._build, self._fixed_args = check, build, fixed_args
        self._registered: dict[str, str] = {}
        self._resolved: dict[str, object] = {}

    def register(self, name: str):
        """Decorator: make a top-level function or class available as `name`.

        The module defining it must import in the pool's workers (not `__main__` or a
        notebook cell); for a one-off file name it as 'path/to/file.py:attr' instead.
        """

        def wrap(obj):
            if obj.__module__ == "__main__" or "<locals>" in obj.__qualname__:
                raise ValueError(
                    f"register({name!r}): {obj.__qualname__} must be defined at the top level "
                    f"of an importable module, or be named as 'path/to/file.py:{self.kind}'"
                )
            if name in self.builtins:
                raise ValueError(f"register({name!r}): that name is a built-in {self.what}")
            self._registered[name] = f"{obj.__module__}:{obj.__qualname__}"
            return obj

        return wrap

    def known(self) -> list[str]:
        """The built-in names, then the registered ones."""
        return sorted(self.builtins) + sorted(self._registered)

    def canonical(self, name: str) -> str:
        """`name` as a worker resolves it: a registered name as its 'module:attr', a
        relative 'file.py:attr' made absolute; built-ins and the rest as they are."""
        name = self._registered.get(name, name)
        target, sep, attr = name.rpartition(":")
        if sep and _is_file(target):
            return f"{os.path.abspath(target)}:{attr}"
        return name

    def resolve(self, name: str):
        """The object behind `name` (imported on first use, then kept); ValueError naming
        it when there is none."""
        if name in self.elsewhere:
            raise ValueError(f"{name!r} is not a {self.what}: {self.elsewhere[name]}")
        ref = self.builtins.get(name) or self.canonical(name)
        if ref not in self._resolved:
            self._resolved[ref] = self._load(name, ref)
        return self._resolved[ref]

    def _load(self, name: str, ref: str):
        target, sep, attr = ref.rpartition(":")
        if not sep or not target or not attr:
            raise ValueError(
                f"unknown {self.what} {name!r}; built-ins and registered: "
                f"{', '.join(self.known())}; or give 'path/to/file.py:{self.kind}' or "
                f"'package.module:{self.kind}'"
            )
        try:
            obj = load_file(target) if _is_file(target) else importlib.import_module(target)
        except (ImportError, OSError, SyntaxError) as err:
            raise ValueError(f"{self.what} {name!r}: {err}") from None
        for part in attr.split("."):
            obj = getattr(obj, part, None)
        if not self._check(obj):
            raise ValueError(f"{self.what} {name!r}: {attr!r} is not {self.expected} in {target!r}")
        return obj

    def check_options(self, name: str, options: Mapping) -> None:
        """Raises ValueError naming the entry when `options` do not fit its signature: an
        option it does not take, or a parameter without a default that they lack."""
        params = list(inspect.signature(self.resolve(name)).parameters.values())
        check_keywords(
            f"{self.what} {name!r}", params[self._fixed_args :], options, self.options_key
        )

    def get(self, name: str, **options):
        """The object `name` with its keyword `options` (checked first), e.g. a new
        environment instance, or a verifier with the options bound."""
        obj = self.resolve(name)
        self.check_options(name, options)
        return self._build(obj, options)
