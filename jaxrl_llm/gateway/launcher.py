"""Agents run outside the trainer: a launcher process that forks one process per episode.

    launcher = Launcher(entry, options, on_started, on_exited)  # loads the agent there
    launcher.run(episode, url, key, result_url, example)
    launcher.kill(pid)      # the watchdog's: that episode's process and all below it
    launcher.close()        # the launcher and every process below it

An agent is user code: it may block its thread (`time.sleep`), call `sys.exit`, raise
`KeyboardInterrupt`, end its process (`os._exit`) or fork. None of it may reach the
trainer, so no agent runs in it. The launcher is a plain subprocess (started with
`python -c`, as the verifier workers are, so it does not re-import the trainer's
`__main__` and JAX with it) that imports the agent once and sends one request through
the `openai` client to a canned answer on a socket of its own (`warm_client`: the
client imports most of its modules and builds its pydantic models on first use, about
0.5 s of CPU that every episode's process would otherwise spend again); for each
episode it forks a
process that plays it on an event loop of its own, with an `openai.AsyncOpenAI` client
on the episode's URL and key, and POSTs what the agent returned to the gateway
(`result_url`): `{"reward": r}`, or `{"error": text}` for anything it raised,
`SystemExit` and `KeyboardInterrupt` included. The process's environment holds the
episode's key and URL too (`JAXRL_LLM_GATEWAY_KEY`, `OPENAI_API_KEY`, `OPENAI_BASE_URL`),
for a harness that makes clients of its own. A reward must be a real number
(`verifiers.worker.as_number`: the string "0.75" is not) that is finite in float32.

The episode process leads a process group of its own; when it ends, the launcher kills
that group (what the agent forked) and, being a child subreaper (`verifiers.reaper`),
every orphan below it that is no live episode's (what left the group with `setsid`).
It reports each episode process's start (its pid) and its end (its exit code) on its
stdout; the gateway fails an episode whose process ended without a result. The
trainer's side of it (`Launcher`) reads those reports in a thread.

Wire: `verifiers.worker.send` / `receive` (a length, then a pickle) on the launcher's
stdin and stdout: in ("agent", entry, options), ("run", episode, url, key, result_url,
example), ("exit",); out ("ready",) | ("failed", message), ("started",
episode, pid), ("exited", episode, code).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import select
import signal
import ssl
import subprocess
import sys
import threading

from jaxrl_llm.verifiers import reaper
from jaxrl_llm.verifiers import worker as wire

FLOAT32_MAX = 3.4028234663852886e38
KEY_VARIABLE = "JAXRL_LLM_GATEWAY_KEY"  # the episode's key, for harnesses that read it there
START_TIMEOUT_S = 120.0  # importing the agent (and openai) in the launcher
WARM_TIMEOUT_S = 30.0  # the launcher's one request to itself (`warm_client`)

# What `warm_client`'s server answers: a chat.completion with a tool call, so the
# response models an agent reads are built too.
_WARM_REPLY = {
    "id": "chatcmpl-warm",
    "object": "chat.completion",
    "created": 0,
    "model": "warm",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            "finish_reason": "tool_calls",
            "logprobs": None,
        }
    ],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}

_BOOTSTRAP = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from jaxrl_llm.gateway.launcher import main; main()"
)


def reward_of(value) -> float:
    """The agent's return value as a reward: a real number finite in float32 (the
    trainer's dtype), else ValueError naming it."""
    number = wire.as_number(value)
    if number is None:
        raise ValueError(f"the agent returned {type(value).__name__} {value!r:.80}, not a number")
    if not (math.isfinite(number) and abs(number) <= FLOAT32_MAX):
        raise ValueError(f"the agent returned {number!r}, not a finite float32 number")
    return number


class Launcher:
    """The trainer's handle on the launcher process; `on_started(episode, pid)` and
    `on_exited(episode, code)` are called from its reader thread (code None: the
    launcher itself is gone)."""

    def __init__(self, entry: str, options: dict, on_started, on_exited):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, json.dumps(sys.path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # Ctrl-C at the terminal is the trainer's to handle
        )
        self.on_started, self.on_exited = on_started, on_exited
        self.running: set[str] = set()
        self._lock = threading.Lock()
        self._send(("agent", entry, dict(options)))
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        try:
            answer = wire.receive(self.proc.stdout.fileno()) if ready else ("failed", "no answer")
        except EOFError:
            answer = ("failed", f"it exited with code {self.proc.wait()}")
        if answer[0] != "ready":
            self.close()
            raise RuntimeError(
                f"agent.entry={entry!r}: the agent process did not start: {answer[1]}"
            )
        self._reader = threading.Thread(target=self._read, daemon=True, name="agent-launcher")
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _send(self, message) -> bool:
        try:
            with self._lock:
                wire.send(self.proc.stdin.fileno(), message)
            return True
        except (OSError, ValueError):  # gone, or closed
            return False

    def run(self, episode: str, url: str, key: str, result_url: str, example) -> bool:
        """Starts the episode's process; False when the launcher is gone."""
        self.running.add(episode)
        return self._send(("run", episode, url, key, result_url, example))

    def _read(self) -> None:
        fd = self.proc.stdout.fileno()
        while True:
            try:
                message = wire.receive(fd)
            except (EOFError, OSError, ValueError):
                break
            if message[0] == "started":
                self.on_started(message[1], message[2])
            elif message[0] == "exited":
                self.running.discard(message[1])
                self.on_exited(message[1], message[2])
        for episode in list(self.running):  # the launcher died: its episodes with it
            self.on_exited(episode, None)
        self.running.clear()

    @staticmethod
    def kill(pid: int) -> None:
        """Kills an episode's process and everything below it; the launcher reaps it and
        reports its end."""
        reaper.kill_tree(pid)

    def close(self) -> None:
        """Stops the launcher, its episodes and everything below them."""
        if self.proc.poll() is None:
            reaper.kill_tree(self.proc.pid)
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()


# ---- the launcher process ----


def main() -> None:
    inp, out = sys.stdin.fileno(), sys.stdout.fileno()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer stops it
    reaper.become_subreaper()
    _, entry, options = wire.receive(inp)
    try:
        from jaxrl_llm.gateway import agents

        agent = agents.load(entry, options)
    except BaseException as err:  # noqa: BLE001  (told to the trainer)
        wire.send(out, ("failed", f"{type(err).__name__}: {err}"[:500]))
        return
    tls = ssl.create_default_context()  # one TLS context: each client's own loads the CAs
    # A failed warm-up costs speed only: each episode then builds what it did not.
    with contextlib.suppress(Exception):
        asyncio.run(asyncio.wait_for(warm_client(tls), WARM_TIMEOUT_S))
    wire.send(out, ("ready",))
    live: dict[int, str] = {}  # pid -> episode
    while True:
        readable, _, _ = select.select([inp], [], [], 0.05)
        if readable:
            try:
                message = wire.receive(inp)
            except EOFError:
                message = ("exit",)
            if message[0] == "exit":
                break
            pid = os.fork()
            if pid == 0:
                _episode_process(agent, tls, *message[1:])  # never returns
            live[pid] = message[1]
            wire.send(out, ("started", message[1], pid))
        _reap(live, out)
    reaper.kill_children()


async def warm_client(tls) -> None:
    """One `chat.completions.create` through an `openai.AsyncOpenAI` client on an
    `httpx.AsyncClient`, as `_play` makes them, to a server on 127.0.0.1 that answers
    `_WARM_REPLY`; in the launcher, before any fork, so each episode's process inherits
    the modules and models it built. Nothing of it (no thread, no socket) is left."""
    import httpx
    import openai

    body = json.dumps(_WARM_REPLY).encode()

    async def answer(reader, writer) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"content-length:\s*(\d+)", head, re.IGNORECASE)
        await reader.readexactly(int(length.group(1)) if length else 0)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    async with server, httpx.AsyncClient(timeout=WARM_TIMEOUT_S, verify=tls) as http:
        client = openai.AsyncOpenAI(base_url=url, api_key="warm", max_retries=0, http_client=http)
        await client.chat.completions.create(
            model="warm", messages=[{"role": "user", "content": "warm"}]
        )


def _reap(live: dict, out: int) -> None:
    """Reports each ended episode process and kills what it left behind."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid not in live:  # an orphan re-parented here, now reaped
            continue
        episode = live.pop(pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # what it forked in its group
        reaper.kill_children(keep=frozenset(live))  # orphans that left the group
        wire.send(out, ("exited", episode, os.waitstatus_to_exitcode(status)))


def _episode_process(agent, tls, episode, url, key, result_url, example) -> None:
    """A forked episode process: plays the episode, reports the result, exits."""
    try:
        os.setsid()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the launcher's pipes are not the agent's
        os.dup2(2, 1)
        os.environ.update({KEY_VARIABLE: key, "OPENAI_API_KEY": key, "OPENAI_BASE_URL": url})
        asyncio.run(_play(agent, tls, url, key, result_url, example))
    finally:
        os._exit(0)


async def _play(agent, tls, url, key, result_url, example) -> None:
    import httpx
    import openai

    # No time limit on a request here: the gateway's watchdog owns the episode's clock,
    # which leaves out the wait for the first compile.
    async with httpx.AsyncClient(timeout=None, verify=tls) as http:
        client = openai.AsyncOpenAI(
            base_url=url, api_key=key, max_retries=0, timeout=None, http_client=http
        )
        pid = os.getpid()
        try:
            result = {"reward": reward_of(await agent(client, example))}
        except BaseException as err:  # noqa: BLE001  (SystemExit too: the episode fails)
            result = {"error": f"{type(err).__name__}: {err}"[:500]}
        if os.getpid() != pid:  # a fork the agent made returned: not this episode's end
            os._exit(0)
        if hasattr(agent, "aclose"):
            with contextlib.suppress(Exception):
                await agent.aclose()
        await http.post(result_url, json=result, headers={"Authorization": f"Bearer {key}"})
