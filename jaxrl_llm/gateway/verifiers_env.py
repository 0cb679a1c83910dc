"""`verifiers` environments (0.4.0, its `verifiers.v1` stack) as agents of the gateway:
`agent.entry=verifiers:<taskset id>`.

    config.agent.entry = "verifiers:my_taskset"      # pip install verifiers==0.4.0
    config.agent.options = {"game": "Wordle-v0"}     # the taskset's config fields

The environment is what `verifiers.load_environment` builds for that taskset (its own
`Env` subclass when its package exports one, else `SingleAgentEnv`), with every agent
seat's program pinned to `ChatHarness` (below) in the local subprocess runtime. An
episode of the gateway is one verifiers episode: `Env.run_episode(task, ctx)`, with the
model context's OpenAI-compatible endpoint the episode's gateway URL, so every model call
of the environment's rollout (through verifiers' interception server) is a request to
the gateway; its reward is the episode's reward as the environment's rubric scored it
(the sum over its traces of each trace's weighted `@vf.reward`s). An episode verifiers
marks failed (an error or a timeout in its harness, task hooks or scoring) raises, so
the gateway scores it 0 and counts it (`gateway/errors`).

The task of a data row: the row's `task` field (an index into the taskset) when it has
one, else a hash of the row, modulo the taskset's size when it is finite; the G episodes
of a row play the same task.

`ChatHarness` is the harness of these episodes: verifiers' own harnesses (`null`,
`bash`, ...) are programs installed with `uv` in a runtime, which needs the network;
this one runs its chat loop in-process (as `Harness.launch` allows: every model call
goes through the interception endpoint), one assistant reply per segment. A multi-turn
environment (a user, a game engine) continues the exchange through verifiers' default
`resume`, which relaunches it on the conversation so far; the gateway sees the same
conversation extended, so the episode's tokens stay exact. Tools from MCP servers are
not offered to the model (`SUPPORTS_MCP = False`: verifiers refuses such tasks).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import ssl
import sys

import httpx
import openai
import verifiers.v1 as vf
from verifiers.v1.clients import ModelContext
from verifiers.v1.configs.agent import agent_config_fields
from verifiers.v1.runtimes import ProgramResult, SubprocessConfig

from jaxrl_llm.gateway.launcher import KEY_VARIABLE

PREFIX = "verifiers:"
# verifiers imports a harness by module name (`harness.id`); this module is registered
# under a plain name so that its lookup in `verifiers.v1.harnesses` fails cleanly.
HARNESS_ID = "jaxrl_llm_verifiers_harness"
sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])


_TLS: list = []  # one TLS context for every segment's client


def _tls():
    """The TLS context of the harness's clients, made once: a client that makes its own
    loads the certificate bundle, tens of milliseconds per segment."""
    if not _TLS:
        import certifi

        _TLS.append(ssl.create_default_context(cafile=certifi.where()))
    return _TLS[0]


class ChatHarnessConfig(vf.HarnessConfig):
    """`ChatHarness` has no options of its own."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """One chat completion per segment, in-process, through the interception endpoint."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None
    ):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [m.model_dump(mode="json", exclude_none=True) for m in prompt]
        http = httpx.AsyncClient(verify=_tls())
        client = openai.AsyncOpenAI(
            base_url=endpoint, api_key=secret, max_retries=0, http_client=http
        )
        try:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        except openai.APIError as err:
            return ProgramResult(1, "", f"{type(err).__name__}: {err}")
        finally:
            await client.close()
        return ProgramResult(0, "", "")


__all__ = ["ChatHarness"]  # what verifiers' harness loader reads


def env_config(taskset: str, options: dict):
    """The verifiers env config for `taskset` (its config fields from `options`), every
    agent seat on `ChatHarness` in the subprocess runtime -> EnvConfig. ValueError
    naming agent.entry / agent.options when verifiers refuses them."""
    try:
        config = vf.resolve_env_config({"taskset": {"id": taskset, **dict(options)}})
    except ModuleNotFoundError:
        raise ValueError(
            f"agent.entry='verifiers:{taskset}': no verifiers taskset {taskset!r} (an "
            "installed package or module exporting a vf.Taskset subclass, or one of "
            "verifiers' own: textarena, openenv, nemo_gym, harbor)"
        ) from None
    except Exception as err:  # pydantic's ValidationError and verifiers' own
        first = " ".join(str(err).split(" For further information")[0].split())[:300]
        raise ValueError(f"agent.options for verifiers:{taskset}: {first}") from None
    harness = ChatHarnessConfig(id=HARNESS_ID)
    for name, seat in agent_config_fields(config).items():
        setattr(
            config,
            name,
            seat.model_copy(update={"harness": harness, "runtime": SubprocessConfig()}),
        )
    return config


INFINITE_TASKS = 10_000  # an infinite taskset's first tasks that rows pick from


class VerifiersAgent:
    """`agent(client, example) -> reward`: one verifiers episode against the client's
    base URL (the gateway's episode endpoint).

    verifiers keeps an env's serving resources (its interception server, shared tool
    servers) on the env object while `Env.serving()` is entered, so episodes of one event
    loop share one env inside one `serving()`, entered at its first episode and left by
    `aclose` (the gateway's `Server.close`); each event loop (the training rollout's
    server, the evaluation's) has an env of its own."""

    def __init__(self, taskset: str, options: dict):
        self.taskset_id, self.options = taskset, dict(options)
        self._served: dict = {}  # event loop -> {"lock", "env", "tasks", "more", "stack"}

    def build(self):
        """-> a new env (verifiers.load_environment); its errors as one-line ValueErrors."""
        config = env_config(self.taskset_id, self.options)
        try:
            return vf.load_environment(config)
        except Exception as err:  # the taskset's own loading
            first = " ".join(str(err).split())[:300]
            raise ValueError(
                f"agent.entry='verifiers:{self.taskset_id}': {type(err).__name__}: {first}"
            ) from None

    def task(self, served: dict, example):
        """The task a data row plays (module docstring); an infinite taskset's tasks are
        read as far as a row asks and kept."""
        index = example.get("task") if isinstance(example, dict) else None
        if not isinstance(index, int):
            row = json.dumps(example, sort_keys=True, default=str).encode()
            index = int.from_bytes(hashlib.sha256(row).digest()[:4], "little")
        tasks = served["tasks"]
        if served["more"] is None:
            return tasks[index % len(tasks)]
        index %= INFINITE_TASKS
        tasks.extend(itertools.islice(served["more"], max(index + 1 - len(tasks), 0)))
        return tasks[index]

    async def _serving(self) -> dict:
        """This event loop's env, inside its `serving()` (entered on first use)."""
        loop = asyncio.get_running_loop()
        served = self._served.setdefault(loop, {"lock": asyncio.Lock(), "env": None})
        async with served["lock"]:
            if served["env"] is None:
                env = await asyncio.to_thread(self.build)
                taskset = env.taskset
                more = iter(taskset) if taskset.INFINITE else None
                tasks = [] if more is not None else await asyncio.to_thread(list, taskset)
                if more is None and not tasks:
                    raise ValueError(f"agent.entry='verifiers:{self.taskset_id}': no tasks")
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(env.serving())
                served.update(env=env, tasks=tasks, more=more, stack=stack)
        return served

    async def aclose(self) -> None:
        """Leaves this event loop's `serving()` (its interception server, tool servers)."""
        served = self._served.pop(asyncio.get_running_loop(), None)
        if served is not None and served["env"] is not None:
            await served["stack"].aclose()

    async def __call__(self, client, example) -> float:
        served = await self._serving()
        async with served["lock"]:  # one reader of an infinite taskset at a time
            task = await asyncio.to_thread(self.task, served, example)
        endpoint = vf.EvalClientConfig(
            base_url=str(client.base_url).rstrip("/"), api_key_var=KEY_VARIABLE
        )
        episode = await served["env"].run_episode(
            task, ModelContext(model="policy", client=endpoint)
        )
        if not episode.ok:
            errors = [e for t in episode.traces for e in t.errors] + list(episode.errors)
            first = f"{errors[0].type}: {errors[0].message}" if errors else "not ok"
            raise RuntimeError(f"verifiers episode failed: {first}"[:500])
        return float(sum(trace.reward for trace in episode.traces))


def _taskset(entry: str) -> str:
    taskset = entry[len(PREFIX) :].strip()
    if not taskset:
        raise ValueError("agent.entry='verifiers:': name a taskset, e.g. verifiers:textarena")
    return taskset


def load(entry: str, options: dict) -> VerifiersAgent:
    """The agent for `agent.entry='verifiers:<taskset>'`."""
    return VerifiersAgent(_taskset(entry), options)


def check(entry: str, options: dict) -> None:
    """ValueError (one line) when the taskset does not resolve or refuses `options`;
    its tasks are not loaded here."""
    env_config(_taskset(entry), options)
