"""Throughput of an agent through the gateway (`agent.entry`) against the same task as a
native environment (`env.name`), same model, same rows, same turns.

    python benchmarks/agents.py                          # the quickstart model, CPU
    python benchmarks/agents.py --batch=32 --G=4 --turns=4 --repeats=5
    python benchmarks/agents.py --model=smollm2-135m-instruct --unrolled --batch=8

The task: a data row's question is the prompt; after each of the model's turns but the
last the other side says "7+1="; the reward is 1. As an environment (`Countdown`, played
by `EnvRollout`: the pool resets and steps it, observations are appended to the live KV
cache) and as an agent written against the `openai` client (`countdown`, played by
`AgentRollout`: HTTP requests to the gateway on localhost, batched into the sampler,
each request that extends its episode appended to its row's KV cache), and the same
agent through the gateway on the paged engine (`rollout.engine=paged`: each episode a
row of its `TurnSession`). All sample at temperature 1 with the same budget per turn and the
same stop ids, on one device. The fourth path is the floor of the gateway's: the same agent
through the gateway on an engine that answers every request at once (`gateway.Instant`,
`--turn_tokens` ids), so its time is the host's alone (the agent processes, their
`openai` clients, HTTP, the batcher), the model's left out.

Each repeat runs one rollout of each path, alternating (A, B, C, A, B, C, ...), after
`--warmup` untimed rollouts of each (compiles: the paged engine's prefill and decode
shapes depend on how many rows arrive together, so one rollout does not build them
all). Reported per path: the median trajectories/s and sampled tokens/s (tokens the model
drew, loss mask 1) with the spread, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_name, table, uptime  # noqa: E402
from gateway import Instant  # noqa: E402

from jaxrl_llm import assets, data, sampling  # noqa: E402
from jaxrl_llm import config as config_lib  # noqa: E402
from jaxrl_llm.models import builtin  # noqa: E402
from jaxrl_llm.rollout.agents import AgentRollout  # noqa: E402
from jaxrl_llm.rollout.played import EnvRollout  # noqa: E402

TASK = '''"""The benchmark's task as an environment and as an openai-client agent."""

from jaxrl_llm.envs.base import Env, Step

OBSERVATION = "7+1="


class Countdown(Env):
    def __init__(self, turns: int = 3):
        self.turns, self.done = turns, 0

    def reset(self, example):
        return example["question"] + "="

    def step(self, action):
        self.done += 1
        if self.done >= self.turns:
            return Step(observation="", reward=1.0, done=True)
        return Step(observation=OBSERVATION)


async def countdown(client, example, turns: int = 3) -> float:
    messages = [{"role": "user", "content": example["question"] + "="}]
    for t in range(turns):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        if t < turns - 1:
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": OBSERVATION}]
    return 1.0
'''


def run_config(task_file: str, a) -> config_lib.ConfigDict:
    c = config_lib.base_config()
    c.model.path = a.model
    c.mesh.data = c.mesh.fsdp = c.mesh.tensor = 1
    c.data.name, c.data.template, c.data.chat_template = (
        "arithmetic/digits_2",
        "{question}=",
        "never",
    )
    c.data.max_prompt_len = 32
    c.rollout.batch_size, c.rollout.num_generations = a.batch, a.G
    c.rollout.max_new_tokens = a.turn_tokens
    c.env.options = {"turns": a.turns}
    c.env.max_turns, c.env.workers = a.turns, 2
    c.env.max_total_tokens = c.agent.max_total_tokens = a.turns * (a.turn_tokens + 8) + 8
    c.agent.options = {"turns": a.turns}
    c.agent.batch_wait_s = 0.05
    c.rewards = {}
    c.env.name = f"{task_file}:Countdown"
    c.agent.entry = f"{task_file}:countdown"
    return c


def measure(rollout, params, batch, step: int) -> tuple:
    """-> (seconds, trajectories, sampled tokens, prefilled and cached context tokens)
    of one rollout of `batch`."""
    t0 = time.perf_counter()
    out, scored, _ = rollout(params, batch, step)
    loss = np.asarray(out.loss_mask)
    seconds = time.perf_counter() - t0
    assert np.all(scored.rewards == 1.0), scored.rewards  # every episode played to the end
    m = scored.metrics
    return (
        seconds,
        float(loss.shape[0]),
        float(loss.sum()),
        m.get("gateway/prefill_tokens", 0.0),
        m.get("gateway/cached_tokens", 0.0),
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=assets.QUICKSTART_MODEL, help="a model.path")
    p.add_argument("--unrolled", action="store_true", help="model.scan_layers=False")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--G", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn_tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3, help="untimed rollouts of each path")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        task_file = os.path.join(tmp, "countdown_task.py")
        with open(task_file, "w") as f:
            f.write(TASK)
        c = run_config(task_file, a)
        tok = builtin.load_tokenizer(c.model.path)
        runtime = {"scan_layers": False} if a.unrolled else {}
        cfg, params = builtin.load_model(c.model.path, None, "float32", **runtime)
        stop_ids = (tok.eos_token_id,) if tok.eos_token_id is not None else ()
        spec = sampling.RolloutSpec(a.G, a.turn_tokens, 1.0, stop_ids=stop_ids)
        batches = data.make_iterator(c.data, tok, a.batch)
        paths = {
            "env (EnvRollout)": EnvRollout(c, tok, sampling.Sampler(cfg, None, seed=0), spec),
            "gateway (AgentRollout)": AgentRollout(
                c, tok, sampling.Sampler(cfg, None, seed=0), spec
            ),
            "gateway, paged engine": AgentRollout(
                c, tok, sampling.PagedSampler(cfg, None, seed=0), spec
            ),
            "gateway, no model (floor)": AgentRollout(
                c, tok, Instant(tok.encode("1" * a.turn_tokens)[: a.turn_tokens]), spec
            ),
        }
        results = {name: [] for name in paths}
        try:
            for w in range(a.warmup):  # compiles (the engine's program shapes vary by rollout)
                batch = next(batches)
                for rollout in paths.values():
                    measure(rollout, params, batch, 1000 + w)
            for r in range(a.repeats):
                batch = next(batches)
                for name, rollout in paths.items():
                    results[name].append(measure(rollout, params, batch, r + 1))
        finally:
            for rollout in paths.values():
                rollout.close()
    rows, medians = [], {}
    for name, runs in results.items():
        runs = np.array(runs)
        trajs, toks = runs[:, 1] / runs[:, 0], runs[:, 2] / runs[:, 0]
        medians[name] = (np.median(trajs), np.median(toks))
        rows.append(
            {
                "path": name,
                "trajectories/s": f"{np.median(trajs):.1f} ({trajs.min():.1f}-{trajs.max():.1f})",
                "sampled tokens/s": f"{np.median(toks):.0f} ({toks.min():.0f}-{toks.max():.0f})",
                "s/rollout": f"{np.median(runs[:, 0]):.2f}",
                "prefilled / cached context tokens": f"{runs[-1, 3]:.0f} / {runs[-1, 4]:.0f}",
            }
        )
    env, gateway, engine, floor = medians.values()
    print(
        f"device: {device_name()}; model {a.model}; {a.batch} rows x G={a.G}, {a.turns} "
        f"turns of <= {a.turn_tokens} tokens; {a.repeats} interleaved repeats"
    )
    print(
        table(
            rows,
            [
                "path",
                "trajectories/s",
                "sampled tokens/s",
                "s/rollout",
                "prefilled / cached context tokens",
            ],
        )
    )
    print(
        f"gateway / env: trajectories/s x{gateway[0] / env[0]:.2f}, "
        f"tokens/s x{gateway[1] / env[1]:.2f}  (medians)"
    )
    print(
        f"gateway on the paged engine / on the static sampler: trajectories/s "
        f"x{engine[0] / gateway[0]:.2f}; / env x{engine[0] / env[0]:.2f}  (medians)"
    )
    print(
        f"gateway with no model / env: trajectories/s x{floor[0] / env[0]:.2f} (the most "
        f"the gateway path can reach on these agents' processes)"
    )
    print(uptime())


if __name__ == "__main__":
    main()
