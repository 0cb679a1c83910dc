"""Agents by name (`agent.entry`): an async function `run(client, example, **options)
-> float` that talks to the policy only through `client`, an `openai.AsyncOpenAI`.

    agent = load("path/to/file.py:run", {"tries": 3})   # -> agent(client, example)

A name is 'path/to/file.py:function' or 'package.module:function' (`registry.Registry`,
as for environments and verifiers); `agent.options` are its keywords, checked against its
signature before the run starts.
"""

from __future__ import annotations

import functools
import importlib
import inspect

from jaxrl_llm.registry import Registry

AGENTS = Registry(
    "agent",
    builtins={},
    kind="run",
    check=inspect.iscoroutinefunction,
    expected="an async function (async def run(client, example) -> float)",
    build=lambda fn, options: functools.partial(fn, **options),
    fixed_args=2,
    options_key="agent.options",
)


VERIFIERS = "verifiers:"
VERIFIERS_INSTALL = "pip install verifiers==0.4.0"


def _verifiers():
    """The `verifiers` adapter module (gateway/verifiers_env.py), or one line to install."""
    try:
        verifiers_env = importlib.import_module("jaxrl_llm.gateway.verifiers_env")
    except ImportError as err:
        raise ValueError(
            f"agent.entry='verifiers:...' needs verifiers ({err.name} is not "
            f"installed): {VERIFIERS_INSTALL}"
        ) from None
    return verifiers_env


def load(entry: str, options: dict | None = None):
    """The agent `entry` with its `options` bound -> agent(client, example);
    'verifiers:<taskset>' is a verifiers environment (gateway/verifiers_env.py)."""
    if entry.startswith(VERIFIERS):
        return _verifiers().load(entry, dict(options or {}))
    return AGENTS.get(entry, **(options or {}))


def check(entry: str, options: dict | None = None) -> None:
    """ValueError naming the entry when it cannot be loaded or its options do not fit
    (for 'verifiers:<taskset>': the taskset resolves and takes the options)."""
    if entry.startswith(VERIFIERS):
        _verifiers().check(entry, dict(options or {}))
        return
    AGENTS.check_options(entry, options or {})
