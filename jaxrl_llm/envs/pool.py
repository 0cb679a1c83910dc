"""Environments on the host side: trajectories' bookkeeping, and the worker pool that runs
their `reset` and `step` calls in parallel.

    with EnvPool("calculator", step_timeout_s=5.0) as pool:
        trajs, observations = pool.reset(examples)            # one per example
        observations = pool.step(trajs, {i: action_text, ...}) # live ones, in parallel

Each call runs in a verifier-pool worker (`VerifierPool.call`, `remote.call`) with the
environment's pickled state. An exception, a crash (the worker dies), a step past
`step_timeout_s`, a trajectory whose calls together pass `trajectory_timeout_s`, or an
answer the trainer cannot use ends that trajectory with reward 0, counted in
`env/errors` or `env/timeouts`; the others go on.
"""

from __future__ import annotations

import copy
import dataclasses

from jaxrl_llm.envs import base
from jaxrl_llm.verifiers import VerifierPool
from jaxrl_llm.verifiers import worker as wire

_REMOTE = "jaxrl_llm.envs.remote:call"


@dataclasses.dataclass
class Trajectory:
    """One trajectory's host-side record (its environment's state travels as bytes)."""

    state: bytes | None = None
    live: bool = True
    rewards: list = dataclasses.field(default_factory=list)  # per stepped turn
    turns: int = 0  # actions the environment answered
    end: str = ""  # done | max_turns | max_total_tokens | context | error | timeout
    error: str = ""
    env_s: float = 0.0
    info: dict = dataclasses.field(default_factory=dict)  # summed over its steps

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
    """

    def __init__(self, name: str, options: dict | None = None, *, workers: int | None = None,
                 step_timeout_s: float = 10.0, trajectory_timeout_s: float = 60.0,
                 memory_mb: int = 2048):  # fmt: skip
        self.name, self.options = base.canonical(name), dict(options or {})
        base.check_options(name, self.options)  # also: the class resolves, here and now
        self.trajectory_timeout_s = trajectory_timeout_s
        self.pool = VerifierPool(workers, timeout_s=step_timeout_s, memory_mb=memory_mb)

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.pool.close()

    def _call(self, op: str, texts, requests):
        base_request = {"env": self.name, "options": self.options, "op": op}
        return self.pool.call(_REMOTE, texts, [base_request | r for r in requests])

    def reset(self, examples) -> tuple[list[Trajectory], list]:
        """One trajectory per example and its first observation (None: the row's prompt,
        also where reset failed, which ends that trajectory)."""
        results = self._call("reset", [""] * len(examples),
                             [{"state": None, "example": dict(ex)} for ex in examples])  # fmt: skip
        trajs, observations = [], []
        for value, status, message in results:
            traj = Trajectory()
            observations.append(self._absorb(traj, value, status, message, "reset"))
            trajs.append(traj)
        return trajs, observations

    def step(self, trajs: list[Trajectory], actions: dict[int, str]) -> dict[int, object]:
        """Steps trajectory i with actions[i] for every i, in parallel -> the observation
        of each one that goes on (the others are finished: done, failed or timed out)."""
        order = [i for i in actions if trajs[i].live]
        results = self._call(
            "step", [actions[i] for i in order], [{"state": trajs[i].state} for i in order]
        )
        observations = {}
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
        state, observation, reward, done, info, seconds = value
        traj.env_s += seconds
        if op == "step":
            traj.turns += 1
            traj.rewards.append(reward)
            for k, v in info.items():
                traj.info[k] = traj.info.get(k, 0.0) + v
        if traj.env_s > self.trajectory_timeout_s:
            traj.finish("timeout", f"{op}: over the trajectory's {self.trajectory_timeout_s:g} s")
        elif done:
            traj.finish("done")
        else:
            traj.state = state
        return observation


def replicate(trajs: list[Trajectory], observations: list, times: int):
    """Each trajectory (and observation) repeated `times` times, as independent copies:
    the G trajectories of a prompt start from its one reset."""
    out_t = [copy.deepcopy(t) for t in trajs for _ in range(times)]
    return out_t, [o for o in observations for _ in range(times)]
