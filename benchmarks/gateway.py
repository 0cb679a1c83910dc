"""The gateway's host cost per request, the model's work taken out: requests/s and ms per
request of `openai`-client agents through `AgentRollout` on an engine that answers at
once, against an echo server of the same request and response size (the floor).

    python benchmarks/gateway.py                                 # 16 and 64 episodes
    python benchmarks/gateway.py --episodes=64 --turns=16 --repeats=5
    py-spy record -o gateway.svg -- python benchmarks/gateway.py --episodes=64   # where

The agent (`chat`, each episode one process, as `agent.entry` runs them) sends a user
message of `--user_chars` characters, then `--turns` requests, each adding the reply and
a new user message, a chat history that grows by a turn each time. The engine
(`Instant`) answers every request with the same `--reply_tokens` ids at once, so what is
timed is the host path: the agent's `openai` client, HTTP on localhost, the server's
authentication and JSON, the batcher (the queue, `Episode` records, the chat template's
rendering and tokenization of the new messages, the reply's decoding) and the thread
hops between the server's loop and the trainer's thread. The echo server has the same
URLs and answers each request (read whole) with a canned response of the gateway's
size, on the same client processes: what HTTP and the client cost alone.

ms/request: the time between the first and the last answer of a rollout over the
answers between them (start-up, the forks and the first requests, left out); requests/s
its inverse. CPU ms/request: the CPU time of the trainer's process (the server's thread
and the batcher's; the agents' processes not counted) over the rollout's requests, what
the gateway itself costs, which other jobs on the cores change less than the wall time;
agent CPU ms/request: an agent process's own (its `openai` client's) after its first
request, the mean over the episodes (the agent returns it as its reward).
Each repeat runs both servers at each episode count, interleaved.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import table, uptime  # noqa: E402

from jaxrl_llm import assets, sampling  # noqa: E402
from jaxrl_llm import config as config_lib  # noqa: E402
from jaxrl_llm.gateway import completions  # noqa: E402
from jaxrl_llm.gateway.launcher import Launcher  # noqa: E402
from jaxrl_llm.models import builtin  # noqa: E402
from jaxrl_llm.rollout.agents import AgentRollout  # noqa: E402
from jaxrl_llm.sampling import engine  # noqa: E402

AGENT = '''"""The benchmark's agent: a chat that grows by one turn per request. Its
reward is the CPU time its process spent per request after the first (ms): what the
client costs."""

import time


async def chat(client, example, turns: int = 8, user_chars: int = 200) -> float:
    text = (example["question"] + " ") * user_chars
    messages = [{"role": "user", "content": text[:user_chars]}]
    for t in range(turns):
        if t == 1:  # the first request builds the client's machinery
            cpu = time.process_time()
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": text[:user_chars]}]
    return (time.process_time() - cpu) * 1e3 / (turns - 1)
'''

# A ChatML-like template: each request renders its new messages through it.
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


class Instant:
    """An engine that answers every request at once with the same ids."""

    pad_id = 0

    def __init__(self, reply: list):
        self.reply = list(reply)


class InstantRequests:
    """`sampling.serve`'s requests session on `Instant`: each request answered in the
    next chunk; `times` holds when each chunk answered and how many."""

    def __init__(self, instant, params, version, spec, **_):
        self.reply, self.version = instant.reply, version
        self.asked: list = []
        self.answers: dict = {}
        self.stats = dict.fromkeys(sampling.serve.COUNTERS.split(), 0)
        self.times: list = []
        instant.session = self

    @property
    def busy(self) -> bool:
        return bool(self.asked)

    def ask(self, episode, ids, max_tokens, n=1, rewrite=False) -> None:
        self.asked.append((episode, n))

    def run_chunk(self) -> list:
        asked, self.asked = self.asked, []
        drawn = (self.reply, [-0.5] * len(self.reply), [self.version] * len(self.reply), False)
        for episode, n in asked:
            self.answers[episode] = [drawn] * n
        self.stats["calls"] += 1
        self.times.append((time.perf_counter(), len(asked)))
        return [episode for episode, _ in asked]

    def answer(self, episode) -> list:
        return self.answers.pop(episode)

    def forget(self, episode) -> None:
        pass

    def swap(self, params, version) -> None:
        self.version = version


engine.SESSIONS[Instant] = {"requests": InstantRequests}


def per_request(times: list) -> float:
    """Seconds per answer between the first answer and the last."""
    stamps = np.array([t for t, _ in times])
    answered = sum(n for _, n in times[1:])
    return (stamps[-1] - stamps[0]) / max(answered, 1)


def gateway_config(agent_file: str, a, episodes: int):
    c = config_lib.base_config()
    c.agent.entry = f"{agent_file}:chat"
    c.agent.options = {"turns": a.turns, "user_chars": a.user_chars}
    c.agent.max_total_tokens = a.turns * (a.reply_tokens + a.user_chars + 32)
    c.agent.batch_wait_s = 0.05
    c.rollout.batch_size, c.rollout.num_generations = episodes, 1
    c.rollout.max_new_tokens = a.reply_tokens
    c.data.max_prompt_len = a.user_chars + 32
    return c


def run_gateway(rollout, instant, episodes: int, step: int) -> tuple:
    """-> (seconds per request, the trainer process's CPU seconds per request, an agent
    process's)."""
    batch = types.SimpleNamespace(examples=[{"question": f"{i}+{i}="} for i in range(episodes)])
    cpu = time.process_time()
    _, scored, _ = rollout(None, batch, step)
    cpu = time.process_time() - cpu
    assert np.all(scored.rewards > 0), scored.metrics
    requests = scored.metrics["gateway/requests"]
    return per_request(instant.session.times), cpu / requests, np.mean(scored.rewards) / 1e3


class Echo:
    """The floor: the gateway's URLs on aiohttp in a thread, each request answered with
    `body` (bytes) once read whole; an episode's result ends it."""

    def __init__(self, body: bytes):
        from aiohttp import web

        self.body, self.times, self.ended, self.client = body, [], {}, []
        self.loop = asyncio.new_event_loop()
        app = web.Application(client_max_size=2**22)
        app.router.add_post("/e/{episode}/v1/chat/completions", self._completions)
        app.router.add_post("/e/{episode}/result", self._result)
        self.runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = self.runner.addresses[0][1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def _completions(self, request):
        from aiohttp import web

        await request.read()
        self.times.append((time.perf_counter(), 1))
        return web.Response(body=self.body, content_type="application/json")

    async def _result(self, request):
        from aiohttp import web

        self.client.append(json.loads(await request.read())["reward"] / 1e3)
        self.ended[request.match_info["episode"]].set()
        return web.json_response({})

    def run(self, launcher: Launcher, episodes: int, step: int) -> tuple:
        """-> (seconds per request, the process's CPU seconds per request, an agent's)."""
        self.times, self.client, cpu = [], [], time.process_time()
        url = f"http://127.0.0.1:{self.port}/e"
        for i in range(episodes):
            e = f"{step}-{i}"
            self.ended[e] = threading.Event()
            example = {"question": f"{i}+{i}="}
            launcher.run(e, f"{url}/{e}/v1", "key", f"{url}/{e}/result", example)
        for i in range(episodes):
            assert self.ended[f"{step}-{i}"].wait(600)
        self.ended.clear()
        cpu = (time.process_time() - cpu) / len(self.times)
        return per_request(self.times), cpu, np.mean(self.client)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def canned_response(tok, reply: list, a) -> bytes:
    """A gateway response of the benchmark's size (its last turn's usage)."""
    message = {"role": "assistant", "content": tok.decode(reply, skip_special_tokens=True)}
    choice = {"index": 0, "message": message, "finish_reason": "length", "logprobs": None}
    sampled = {"temperature": 1.0, "policy_version": 0, "requested_temperature": None}
    body = completions.response("0", a.turns, [choice], 1000, len(reply), sampled)
    return json.dumps(body).encode()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--episodes", default="16,64", help="concurrent episodes, comma-separated")
    p.add_argument("--turns", type=int, default=8, help="requests per episode")
    p.add_argument("--user_chars", type=int, default=200, help="characters per user message")
    p.add_argument("--reply_tokens", type=int, default=48, help="ids of each answer")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    counts = [int(x) for x in a.episodes.split(",")]
    tok = builtin.load_tokenizer(assets.QUICKSTART_MODEL)
    tok.chat_template = TEMPLATE
    reply = tok("the sum is 12+34=46, so the answer is 46.", add_special_tokens=False)
    reply = (reply["input_ids"] * a.reply_tokens)[: a.reply_tokens]
    instant = Instant(reply)
    spec = sampling.RolloutSpec(1, a.reply_tokens, 1.0, stop_ids=())
    results = {(path, e): [] for e in counts for path in ("gateway", "echo")}
    with tempfile.TemporaryDirectory() as tmp:
        agent_file = os.path.join(tmp, "chat_agent.py")
        with open(agent_file, "w") as f:
            f.write(AGENT)
        rollouts = {
            e: AgentRollout(gateway_config(agent_file, a, e), tok, instant, spec) for e in counts
        }
        options = {"turns": a.turns, "user_chars": a.user_chars}
        launcher = Launcher(f"{agent_file}:chat", options, lambda *_: None, lambda *_: None)
        echo = Echo(canned_response(tok, reply, a))
        try:
            for e in counts:  # warm-up: the servers' first requests and the launchers
                run_gateway(rollouts[e], instant, e, 0)
                echo.run(launcher, e, 0)
            for r in range(a.repeats):
                for e in counts:
                    results["gateway", e].append(run_gateway(rollouts[e], instant, e, r + 1))
                    results["echo", e].append(echo.run(launcher, e, r + 1))
        finally:
            for rollout in rollouts.values():
                rollout.close()
            launcher.close()
            echo.close()
    rows = []
    for (path, e), runs in results.items():
        ms, cpu, client = (np.array(runs) * 1e3).T
        rate = 1e3 / ms
        rows.append(
            {
                "path": path,
                "episodes": e,
                "ms/request": f"{np.median(ms):.2f} ({ms.min():.2f}-{ms.max():.2f})",
                "requests/s": f"{np.median(rate):.0f} ({rate.min():.0f}-{rate.max():.0f})",
                "CPU ms/request": f"{np.median(cpu):.2f} ({cpu.min():.2f}-{cpu.max():.2f})",
                "agent CPU ms/request": f"{np.median(client):.2f}",
            }
        )
    print(
        f"{a.turns} requests per episode, user messages of {a.user_chars} characters, "
        f"answers of {a.reply_tokens} ids; {a.repeats} interleaved repeats; {os.cpu_count()} CPUs"
    )
    print(
        table(
            rows,
            [
                "path",
                "episodes",
                "ms/request",
                "requests/s",
                "CPU ms/request",
                "agent CPU ms/request",
            ],
        )
    )
    print(uptime())


if __name__ == "__main__":
    main()
