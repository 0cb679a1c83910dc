"""Agents by name (`agent.entry`): an async function `run(client, example, **options)
-> float` that talks to the policy only through `client`, an `openai.AsyncOpenAI`.

    agent = load("path/to/file.py:run", {"tries": 3})   # -> agent(client, example)

A name is 'path/to/file.py:function' or 'package.module:function' (`registry.Registry`,
as for environments and verifiers); `agent.options` are its keywords, checked against its
signature before the run starts.
"""

from __future__ import annotations

import functools
import inspect

from jaxrl_llm.registry import Registry

AGENTS = Registry(
    "agent", builtins={}, kind="run", check=inspect.iscoroutinefunction,
    expected="an async function (async def run(client, example) -> float)",
    build=lambda fn, options: functools.partial(fn, **options), fixed_args=2,
    options_key="agent.options",
)  # fmt: skip


def load(entry: str, options: dict | None = None):
    """The agent `entry` with its `options` bound -> agent(client, example)."""
    return AGENTS.get(entry, **(options or {}))


def check(entry: str, options: dict | None = None) -> None:
    """ValueError naming the entry when it cannot be loaded or its options do not fit."""
    AGENTS.check_options(entry, options or {})
