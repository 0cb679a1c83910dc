"""Environments on the host side: trajectories' bookkeeping, and the worker pool that runs
their `reset` and `step` calls in parallel.

    with EnvPool("calculator", step_timeout_s=5.0) as pool:
        trajs, observations = pool.reset(examples)            # one per example
        observations = pool.step(trajs, {i: action_text, ...}) # live ones, in parallel

Each call runs in a verifier-pool worker (`VerifierPool.call`, `remote.call`) with the
environment's pickled state. An exception, a crash (the worker dies), a step past
`step_timeout_s`, a trajectory whose calls together pass `trajectory_timeout_s`, or an
answer the trainer cannot use ends that trajectory with reward 0, counted in
`env/errors` or `env/timeouts`; the others go on. Calls that time out or kill their
worker `BREAKER_AFTER` times in a row, across calls, trip the breaker of that operation
(reset or step): each later call sends one probe, and the rest of the batch fails at
once, until a probe answers. An observation longer than the trajectory's room in
characters (`max_chars`) stays in the worker and ends the trajectory
(`long_observation`). At most `MAX_INFO_KEYS` distinct `info` keys are kept over the
pool's life; values under other keys are dropped and counted (`Trajectory.info_dropped`).
With `lanes` > 1 the workers form that many pools, and calls from several threads run at
once, each on the free lanes its rows need.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from jaxrl_llm.envs import base, hubs
from jaxrl_llm.verifiers import ScoreDetails, VerifierPool
from jaxrl_llm.verifiers import worker as wire

_REMOTE = "jaxrl_llm.envs.remote:call"
BREAKER_AFTER = 5
MAX_INFO_KEYS, MAX_KEY_CHARS = 32, 64


@dataclasses.dataclass
class Trajectory:
    """One trajectory's host-side record (its environment's state travels as bytes)."""

    state: bytes | None = None
    live: bool = True
    rewards: list = dataclasses.field(default_factory=list)  # per stepped turn
    turns: int = 0  # actions the environment answered
    # done | max_turns | max_total_tokens | long_observation | context | error | timeout
    end: str = ""
    error: str = ""
    env_s: float = 0.0
    info: dict = dataclasses.field(default_factory=dict)  # summed over its steps
    info_dropped: int = 0  # info values past the pool's MAX_INFO_KEYS keys

    def finish(self, why: str, error: str = "") -> None:
        self.live, self.state = False, None
        self.end = self.end or why
        if error:
            self.error, self.rewards = error, []  # a failed trajectory scores 0

    def reward(self, discount: float) -> float:
        """The final turn's reward plus the earlier ones, each discounted by its distance
        from the end: R = r_T + sum_{t<T} discount^(T-t) r_t (discount 0: r_T only)."""
        if not self.rewards:
            return 0.0
        *earlier, last = self.rewards
        T = len(self.rewards)
        return last + sum(discount ** (T - t) * r for t, r in enumerate(earlier, 1))


class EnvPool:
    """Runs one environment class's `reset` / `step` in worker processes.

    Args:
      name: environment name (`base.resolve`); options: its __init__ keywords.
      workers: worker processes (default: CPU count).
      step_timeout_s: wall-clock limit of one call; past it the worker is killed.
      trajectory_timeout_s: limit on the summed time of a trajectory's calls.
      memory_mb: address space a worker may add for an environment (0: no cap).
      lanes: the workers split into this many pools (`VerifierPool`s) that run calls
        at the same time: a call takes as many free lanes as its rows need (all of them
        for a batch of every row) and waits while none is free, so a caller that steps
        rows as their turns end (`play` on the paged engine) starts a step while another still runs.
        1: one call at a time.
    """

    def __init__(
        self,
        name: str,
        options: dict | None = None,
        *,
        workers: int | None = None,
        step_timeout_s: float = 10.0,
        trajectory_timeout_s: float = 60.0,
        memory_mb: int = 2048,
        lanes: int = 1,
    ):
        name, options = hubs.hub(name, dict(options or {}))  # textarena/<game> -> its class
        self.name, self.options = base.canonical(name), options
        base.check_options(name, self.options)  # also: the class resolves, here and now
        self.trajectory_timeout_s = trajectory_timeout_s
        workers = workers or os.cpu_count() or 1
        if not 1 <= lanes <= workers:
            raise ValueError(f"lanes={lanes}: must be between 1 and workers={workers}")
        sizes = [workers // lanes + (k < workers % lanes) for k in range(lanes)]
        self.lanes = [VerifierPool(n, timeout_s=step_timeout_s, memory_mb=memory_mb) for n in sizes]
        self._free = list(self.lanes)
        self._size = {id(lane): n for lane, n in zip(self.lanes, sizes, strict=True)}
        self._cv = threading.Condition()
        self._threads = ThreadPoolExecutor(lanes, "env-lane") if lanes > 1 else None
        self.info_keys: set[str] = set()
        self.costly_in_a_row = {"reset": 0, "step": 0}  # the breaker, per operation

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=True)
        for lane in self.lanes:
            lane.close()

    @property
    def restarts(self) -> int:
        """Workers replaced after a crash or timeout, over every lane's life."""
        return sum(lane.restarts for lane in self.lanes)

    def _call(self, op: str, texts, requests):
        base_request = {"env": self.name, "options": self.options, "op": op}
        requests = [base_request | r for r in requests]
        with self._cv:
            breaker = max(1, BREAKER_AFTER - self.costly_in_a_row[op])  # tripped: one probe
            lanes = self._take(len(texts))
        try:
            if len(lanes) == 1:
                results = lanes[0].call(_REMOTE, texts, requests, breaker)
            else:  # the rows split over the lanes taken, in order, each in a thread
                cuts = np.linspace(0, len(texts), len(lanes) + 1).astype(int)
                parts = [
                    self._threads.submit(lane.call, _REMOTE, texts[a:b], requests[a:b], breaker)
                    for lane, a, b in zip(lanes, cuts[:-1], cuts[1:], strict=True)
                ]
                wait(parts)  # every lane's part ends before its lane is free again
                results = [r for part in parts for r in part.result()]
        finally:
            with self._cv:
                self._free += lanes
                self._cv.notify_all()
        with self._cv:
            for _, status, message in results:
                if message.startswith("not called:"):
                    continue  # skipped by the breaker: says nothing new
                costly = status == wire.TIMEOUT or message.startswith("worker died")
                self.costly_in_a_row[op] = self.costly_in_a_row[op] + 1 if costly else 0
        return results

    def _take(self, rows: int) -> list:
        """Free lanes for a call of `rows` rows (under the lock): at least one (waits for
        it), and more while free ones are left and the rows outnumber their workers."""
        while not self._free:
            self._cv.wait()
        lanes = [self._free.pop(0)]
        while self._free and rows > sum(self._size[id(lane)] for lane in lanes):
            lanes.append(self._free.pop(0))
        return lanes

    def reset(self, examples, max_chars: int | None = None) -> tuple[list[Trajectory], list]:
        """One trajectory per example and its first observation (None: the row's prompt,
        also where reset failed, which ends that trajectory). A prompt longer than
        `max_chars` characters fails its trajectory (it is never sent back)."""
        results = self._call(
            "reset",
            [""] * len(examples),
            [{"state": None, "example": dict(ex), "max_chars": max_chars} for ex in examples],
        )
        trajs, observations = [], []
        with self._cv:
            for value, status, message in results:
                traj = Trajectory()
                observations.append(self._absorb(traj, value, status, message, "reset"))
                trajs.append(traj)
        return trajs, observations

    def step(
        self,
        trajs: list[Trajectory],
        actions: dict[int, str],
        max_chars: dict[int, int] | None = None,
    ) -> dict[int, object]:
        """Steps trajectory i with actions[i] for every i, in parallel -> the observation
        of each one that goes on (the others are finished: done, failed, timed out, or
        its observation was longer than `max_chars[i]` characters; -1: not wanted)."""
        order = [i for i in actions if trajs[i].live]
        bounds = max_chars or {}
        results = self._call(
            "step",
            [actions[i] for i in order],
            [{"state": trajs[i].state, "max_chars": bounds.get(i)} for i in order],
        )
        observations = {}
        with self._cv:  # the pool's info keys are shared by concurrent calls
            for i, (value, status, message) in zip(order, results, strict=True):
                observation = self._absorb(trajs[i], value, status, message, "step")
                if trajs[i].live:
                    observations[i] = observation
        return observations

    def _absorb(self, traj: Trajectory, value, status, message, op: str):
        """Records one call's answer in `traj` -> its observation."""
        if status == wire.TIMEOUT:
            traj.finish("timeout", f"{op}: {message}")
            return None
        if status != wire.OK:
            traj.finish("error", f"{op}: {message}")
            return None
        state, observation, reward, done, info, seconds, refused = value
        traj.env_s += seconds
        if op == "step":
            traj.turns += 1
            traj.rewards.append(reward)
            self._add_info(traj, info)
        if traj.env_s > self.trajectory_timeout_s:
            traj.finish("timeout", f"{op}: over the trajectory's {self.trajectory_timeout_s:g} s")
        elif done:
            traj.finish("done")
        elif refused:  # the text stayed in the worker; a limit, not a failure
            traj.finish("long_observation")
        else:
            traj.state = state
        return observation

    def _add_info(self, traj: Trajectory, info: dict) -> None:
        """Sums `info` into the trajectory's; keys past the first MAX_INFO_KEYS the pool
        has seen (or longer than MAX_KEY_CHARS) are dropped and counted."""
        for k, v in info.items():
            if k not in self.info_keys:
                if len(self.info_keys) >= MAX_INFO_KEYS or len(k) > MAX_KEY_CHARS:
                    traj.info_dropped += 1
                    continue
                self.info_keys.add(k)
            traj.info[k] = traj.info.get(k, 0.0) + v


def replicate(trajs: list[Trajectory], observations: list, times: int):
    """Each trajectory (and observation) repeated `times` times, as independent copies:
    the G trajectories of a prompt start from its one reset."""
    out_t = [copy.deepcopy(t) for t in trajs for _ in range(times)]
    return out_t, [o for o in observations for _ in range(times)]


FAILED = ("error", "timeout")  # the ends that count against the run's error budget


def score(trajs: list[Trajectory], discount: float, name: str) -> tuple[np.ndarray, ScoreDetails]:
    """[n] float32 rewards of finished trajectories, and their failures as the verifiers'
    `ScoreDetails` (label `name`, key `env.name`), which `verifiers.ErrorBudget` judges: a
    step where most trajectories failed warns with the first error, `train.max_failed_steps`
    such steps in a row stop the run. A reward that overflows float32 fails its trajectory."""
    rewards = np.zeros(len(trajs), np.float32)
    for i, t in enumerate(trajs):
        r = t.reward(discount)
        if abs(r) > 3.4028234663852886e38:  # finite in float64, inf as the trainer's float32
            t.end, t.error, t.rewards = "error", f"reward {r:g} overflows float32", []
            r = 0.0
        rewards[i] = r
    failed = [i for i, t in enumerate(trajs) if t.end in FAILED]
    first = f"{name} trajectory {failed[0]}: {trajs[failed[0]].error}" if failed else None
    return rewards, ScoreDetails(
        per_verifier={name: rewards.astype(np.float64)},
        weights={name: 1.0},
        errors={name: sum(t.end == "error" for t in trajs)},
        timeouts={name: sum(t.end == "timeout" for t in trajs)},
        messages=[f"trajectory {i}: {trajs[i].error}" for i in failed[:8]],
        failed={name: len(failed)},
        num_samples=len(trajs),
        first_error=first,
        key="env.name",
        unit="trajectories",
        fix="fix the environment (its failures end their trajectories with reward 0)",
    )
