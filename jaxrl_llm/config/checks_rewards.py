"""The checks of what scores and plays the rollouts: the algorithm (`algo`), the teacher,
the reward verifiers and their judges, multi-turn environments (`env`) and agents through
the gateway (`agent`), including what each of them does not combine with.

Part of the run config's checks (`checks.validate` runs them in order; the teacher before
the algorithm, which reads teacher.weight). The verifier, environment and agent modules
are imported inside each check, so a run that uses none of them does not load them.
"""

from __future__ import annotations

import math
import os

import jax

from jaxrl_llm.config.derived import ConfigError, algo_config, require, resolve_model_path


def check_algo(config):
    from jaxrl_llm import rl

    try:
        algo = algo_config(config)
        rl.check_num_generations(algo, config.rollout.num_generations)
    except ValueError as e:
        message = str(e)
        if message.startswith("num_generations"):
            message = "rollout." + message
        raise ConfigError(message) from None
    require(
        not (algo.dynamic_sampling and config.rollout.mode != "sync"),
        f"rollout.mode={config.rollout.mode!r} does not combine with dynamic sampling (algo "
        f"{algo.name!r}: its extra sampling rounds need this step's rewards); use mode='sync'",
    )
    return algo


def check_teacher(config) -> None:
    """teacher.path resolves (its tokenizer is compared with the student's when the run
    loads them: `trainer.teachers`); teacher.weight > 0."""
    t = config.teacher
    paths = dict(t.paths)
    require(
        bool(t.field) == bool(paths),
        f"teacher.field={t.field!r} and teacher.paths ({len(paths)} entries): several "
        "teachers need both (the row field that names a row's teacher, and name -> path)",
    )
    if not t.path and not paths:
        return
    if t.path:
        resolve_model_path(t.path, "teacher.path", download=False)
    for name, path in paths.items():
        require(isinstance(path, str) and bool(path), f"teacher.paths.{name}: expected a path")
        resolve_model_path(path, f"teacher.paths.{name}", download=False)
    w = t.weight
    require(
        isinstance(w, int | float) and math.isfinite(w) and w > 0,
        f"teacher.weight={w!r}: must be a finite number > 0",
    )


def check_rewards(config, algo) -> list[str]:
    """-> the reward labels."""
    from jaxrl_llm import verifiers

    if config.env.name:
        require(
            not config.rewards,
            "rewards: with env.name set the environment gives the reward (its verifier is "
            "an env.options entry); set config.rewards = {}",
        )
        return []
    if config.agent.entry:
        require(
            not config.rewards,
            "rewards: with agent.entry set the agent's return value is the reward; set "
            "config.rewards = {}",
        )
        return []
    try:
        labels = [s.label for s in verifiers.parse_specs(config.rewards)]
    except ValueError as e:
        raise ConfigError(str(e) if str(e).startswith("rewards") else f"rewards: {e}") from None
    require(bool(labels), "rewards: at least one verifier is needed")
    check_judges(config)
    if algo.decouple_rewards or algo.reward_weights:
        require(
            algo.reward_weights is None or len(algo.reward_weights) == len(labels),
            f"algo.reward_weights has {len(algo.reward_weights or ())} entries for "
            f"{len(labels)} rewards",
        )
    return labels


def check_judges(config) -> None:
    """Judge reward entries (verifiers/judge.py): their options and a model path that
    resolves."""
    from jaxrl_llm import verifiers
    from jaxrl_llm.verifiers import judge

    for spec in verifiers.parse_specs(config.rewards):
        if not judge.is_judge(spec):
            continue
        where = f"rewards.{spec.label}.options"
        try:
            judge.check_options(spec.options, where)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        path = resolve_model_path(spec.options["model"], f"{where}.model", download=False)
        width, budget = spec.options.get("prompt_len", 0), spec.options.get("max_new_tokens", 16)
        if path is not None and width:
            from jaxrl_llm.models import builtin

            limit = builtin.model_config(path).max_position_embeddings
            require(
                width + budget <= limit,
                f"{where}.prompt_len={width} + max_new_tokens={budget} exceeds the judge "
                f"model's max_position_embeddings {limit} ({spec.options['model']})",
            )


def check_env(config, algo) -> None:
    """Multi-turn settings (only read when env.name is set)."""
    from jaxrl_llm.envs import hubs, schedule

    e = config.env
    if not e.name:
        return
    try:
        hubs.check_options(e.name, dict(e.options))
        most = schedule.most(e.max_turns)
    except ValueError as err:
        message = str(err)
        raise ConfigError(
            message if message.startswith("env.") else f"env.name: {message}"
        ) from None
    turn = config.rollout.max_new_tokens
    require(
        most >= 1 and e.max_total_tokens >= turn,
        f"env.max_total_tokens={e.max_total_tokens} is below one turn "
        f"(rollout.max_new_tokens={turn})",
    )
    require(e.turn_reward_discount >= 0, f"env.turn_reward_discount={e.turn_reward_discount}: >= 0")
    require(e.step_timeout_s > 0, f"env.step_timeout_s={e.step_timeout_s}: must be > 0")
    require(e.trajectory_timeout_s > 0, f"env.trajectory_timeout_s={e.trajectory_timeout_s}: > 0")
    require(e.workers >= 0, f"env.workers={e.workers}: must be >= 0 (0 = CPU count)")
    workers = e.workers or os.cpu_count() or 1
    require(
        isinstance(e.lanes, int) and 1 <= e.lanes <= workers,
        f"env.lanes={e.lanes}: must be an integer between 1 and env.workers ({workers})",
    )
    require(e.memory_mb >= 0, f"env.memory_mb={e.memory_mb}: must be >= 0 (0 = no cap)")
    require(not algo.dynamic_sampling, "algo.dynamic_sampling: not available with env.name yet")
    require(
        config.rollout.mode != "overlap" or jax.process_count() == 1,
        "rollout.mode='overlap' with env.name runs on one host (its trajectories are played "
        "by a thread); use 'sync'",
    )


def check_agent(config, algo, process_count: int) -> None:
    """Agents through the gateway (only read when agent.entry is set)."""
    a = config.agent
    if not a.entry:
        return
    import importlib.util

    from jaxrl_llm.gateway import agents

    require(not config.env.name, "agent.entry and env.name: set one of them")
    missing = [p for p in ("aiohttp", "openai") if importlib.util.find_spec(p) is None]
    require(
        not missing,
        f"agent.entry: the gateway needs {' and '.join(missing)}: "
        "pip install -e . (the package's own requirements)",
    )
    try:
        agents.check(a.entry, dict(a.options))
    except ValueError as err:
        message = str(err)
        raise ConfigError(
            f"agent.options: {message}" if " option" in message else f"agent.entry: {message}"
        ) from None
    require(
        a.max_total_tokens >= config.rollout.max_new_tokens,
        f"agent.max_total_tokens={a.max_total_tokens} is below one response "
        f"(rollout.max_new_tokens={config.rollout.max_new_tokens})",
    )
    require(a.timeout_s > 0, f"agent.timeout_s={a.timeout_s}: must be > 0")
    require(a.batch_wait_s >= 0, f"agent.batch_wait_s={a.batch_wait_s}: must be >= 0")
    require(
        a.max_request_bytes >= 1024,
        f"agent.max_request_bytes={a.max_request_bytes}: must be >= 1024",
    )
    require(process_count == 1, "agent.entry: the gateway runs on one host")
    require(not algo.dynamic_sampling, "algo.dynamic_sampling: not available with agent.entry")
    require(
        algo.routing_replay in (None, "none"),
        "algo.routing_replay='rollout': the gateway (agent.entry) does not record the "
        "sampler's expert routes; use algo.routing_replay='none'",
    )
