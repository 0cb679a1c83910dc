"""The trainer's multi-turn rollout: data rows -> resets -> prompts -> turns -> rewards.

    env_rollout = EnvRollout(config, tokenizer, sampler, spec, mesh)
    out, scored, versions = env_rollout(params, batch, step)  # SampleOutput, Scored, [N, T]
    metrics = env_rollout.evaluate(params, eval_batches, pass_k=8, temperature=1.0)

Each prompt's environment is reset once (in the pool) and its state copied to the G
trajectories, which share one prefill. The prompt is the reset's observation rendered
like a data prompt, or the row's own prompt when reset returns None (or fails: that
trajectory then scores 0). The reward of a trajectory is `Trajectory.reward`: the final
turn's plus the discounted earlier ones (`env.turn_reward_discount`).

Held-out evaluation plays whole trajectories too: greedy (one per prompt) for pass@1 and
pass_k sampled ones at `eval.temperature` for pass@k. A trajectory is correct when its
final turn's reward is above 0.5 (`evaluation.is_correct`; the built-in environments
score the answer 1 or 0).
"""

from __future__ import annotations

import numpy as np

from jaxrl_llm import config as config_lib
from jaxrl_llm import parallel, sampling
from jaxrl_llm.data import prompts as prompts_lib
from jaxrl_llm.envs.loop import TurnSettings, play
from jaxrl_llm.envs.pool import FAILED, EnvPool, replicate, score
from jaxrl_llm.envs.render import Renderer
from jaxrl_llm.envs.schedule import turns_at
from jaxrl_llm.rollout import evaluation, scoring
from jaxrl_llm.rollout.sources import Rollout, Sampling


class EnvRollout:
    """Environments, renderer and turn settings of a run (`config.env`). Training plays on
    `engine` (default `sampler`; rollout workers: their `workers.turns.Fleet`, whose
    `stats` the thread logs), evaluation on `sampler`."""

    def __init__(
        self, config, tokenizer, sampler, spec: sampling.RolloutSpec, mesh=None, engine=None
    ):
        e, d = config.env, config.data
        self.config, self.tokenizer, self.sampler, self.spec, self.mesh = (
            config,
            tokenizer,
            sampler,
            spec,
            mesh,
        )
        self.remote = engine  # None: training on `sampler` too
        self.stats = {} if engine is None else engine.stats
        self.pool = EnvPool(
            e.name,
            dict(e.options),
            workers=e.workers or None,
            step_timeout_s=e.step_timeout_s,
            trajectory_timeout_s=e.trajectory_timeout_s,
            memory_mb=e.memory_mb,
            lanes=e.lanes,
        )
        has_chat = bool(getattr(tokenizer, "chat_template", None))
        self.renderer = Renderer(
            tokenizer, has_chat and d.chat_template != "never", d.system_prompt
        )
        try:
            tool_stops = config_lib.stop_ids(tokenizer, tuple(e.stop_tokens))
        except config_lib.ConfigError as err:  # its message names rollout.stop_tokens
            raise config_lib.ConfigError(str(err).replace("rollout.", "env.", 1)) from None
        self.stop_ids = tuple(dict.fromkeys(spec.stop_ids + tool_stops))
        self.label = e.name.rpartition(":")[2].removesuffix(".py")

    def close(self) -> None:
        self.pool.close()
        if self.remote is not None:  # rollout workers: their connections
            self.remote.close()

    def settings(self, step: int) -> TurnSettings:
        e, r = self.config.env, self.config.rollout
        return TurnSettings(
            max_turns=turns_at(e.max_turns, step),
            turn_tokens=r.max_new_tokens,
            max_total_tokens=e.max_total_tokens,
            stop_ids=self.stop_ids,
            end_of_turn_ids=self.spec.stop_ids,
        )

    def _play(
        self,
        params,
        batch,
        spec,
        settings: TurnSettings,
        step: int,
        version=None,
        refresh=None,
        engine=None,
    ):
        """This process's prompts of `batch`, spec.num_generations trajectories each,
        played to the end on `engine` (default the sampler) -> (out, trajectories, turns,
        prompt ids, tokens, lengths). version: the parameters' (default: step); refresh:
        `envs.play`'s."""
        bound = self.renderer.max_chars(self.config.data.max_prompt_len)
        trajs, observations = self.pool.reset(batch.examples, bound)
        prompt_ids = [self._prompt(batch, i, obs, trajs[i]) for i, obs in enumerate(observations)]
        ids, mask = prompts_lib.collate(prompt_ids, self.sampler.pad_id, 1, 0)
        trajs, _ = replicate(trajs, observations, spec.num_generations)
        out, turns = play(
            engine or self.sampler,
            params,
            ids,
            mask,
            spec,
            settings,
            self.pool,
            trajs,
            self.renderer,
            self.tokenizer,
            step=step,
            version=step if version is None else version,
            mesh=self.mesh,
            refresh=refresh,
        )
        tokens, lengths = (np.asarray(x) for x in _local(out, self.mesh))
        return out, trajs, turns, prompt_ids, tokens, lengths

    def evaluate(self, params, batches, *, pass_k: int, temperature: float, step: int = 0):
        """`eval/*` over held-out batches (`evaluation.run`), trajectories played to the
        end: pass@1 (greedy), pass@k, and the greedy trajectories' mean reward (the
        training one, discounted), turns, tool calls and length. The turn limit is the
        schedule's value at `step`."""
        settings, discount = self.settings(step), self.config.env.turn_reward_discount

        def play(batch, spec, key):
            _, trajs, turns, _, _, lengths = self._play(params, batch, spec, settings, key)
            rows = {
                "reward_mean": [t.reward(discount) for t in trajs],
                "turns_mean": turns.model_turns,
                "tool_calls": [t.info.get("tool_calls", 0.0) for t in trajs],
                "tool_errors": [t.info.get("tool_errors", 0.0) for t in trajs],
                "length_mean": lengths,
            }
            return [t.reward(0.0) for t in trajs], rows

        return evaluation.run(
            play, batches, self.spec, pass_k=pass_k, temperature=temperature, step=step
        )

    def __call__(
        self,
        params,
        batch,
        step: int,
        *,
        settings: TurnSettings | None = None,
        version: int | None = None,
        refresh=None,
    ):
        """This process's prompts of `batch` played to the end by `params` (whose version is
        `version`, default step; `refresh` as in `envs.play`) -> (out, scored, the version
        that drew each completion token [N, max_total_tokens], -1 where none did)."""
        G = self.spec.num_generations
        settings = settings or self.settings(step)
        out, trajs, turns, prompt_ids, tokens, lengths = self._play(
            params, batch, self.spec, settings, step, version, refresh, self.remote
        )
        # Model turns as the environment read them; observations with the template's markers.
        texts = [
            [
                (kind, self.tokenizer.decode(tokens[i, a:b], skip_special_tokens=kind == "model"))
                for kind, a, b in turns.spans[i]
            ]
            for i in range(len(trajs))
        ]
        rewards, details = score(trajs, self.config.env.turn_reward_discount, self.label)
        for row, t in zip(texts, trajs, strict=True):  # samples.jsonl shows why it failed
            row += [("error", f"{t.end}: {t.error}")] if t.end in FAILED else []
        scored = scoring.Scored(
            rewards=rewards,
            metrics=self.metrics(trajs, turns, lengths),
            completions=["".join(text for k, text in row if k != "error") for row in texts],
            prompts=[self.tokenizer.decode(p) for p in prompt_ids for _ in range(G)],
            examples=[ex for ex in batch.examples for _ in range(G)],
            lengths=lengths,
            prompt_lengths=np.repeat([len(p) for p in prompt_ids], G),
            turns=[[{"role": k, "text": t} for k, t in row] for row in texts],
            details=details,
        )
        return out, scored, turns.versions

    def _prompt(self, batch, i: int, observation, traj) -> list[int]:
        """Row i's prompt ids: the reset's observation rendered, else the data prompt."""
        if observation is not None:
            try:
                ids = self.renderer.prompt(observation)
                if len(ids) <= self.config.data.max_prompt_len:
                    return ids
                traj.finish("error", f"reset: prompt of {len(ids)} tokens > data.max_prompt_len")
            except Exception as err:
                traj.finish("error", f"reset: {type(err).__name__}: {err}"[:500])
        row_ids, row_mask = np.asarray(batch.prompt_ids[i]), np.asarray(batch.prompt_mask[i])
        return row_ids[row_mask.astype(bool)].tolist()

    def metrics(self, trajs, turns, lengths) -> dict:
        """env/* means over this process's trajectories (see docs/envs.md)."""
        n = len(trajs)
        mean = lambda xs: float(np.mean(xs)) if n else 0.0  # noqa: E731
        info_keys = sorted({k for t in trajs for k in t.info})
        m = {
            "env/turns_mean": mean(turns.model_turns),
            "env/tool_calls": mean([t.info.get("tool_calls", 0.0) for t in trajs]),
            "env/tool_errors": mean([t.info.get("tool_errors", 0.0) for t in trajs]),
            "env/errors": float(sum(t.end == "error" for t in trajs)),
            "env/timeouts": float(sum(t.end == "timeout" for t in trajs)),
            "env/long_observations": float(sum(t.end == "long_observation" for t in trajs)),
            "env/info_dropped": float(sum(t.info_dropped for t in trajs)),
            "env/obs_tokens": mean(turns.obs_tokens),
            "env/done_frac": mean([t.end == "done" for t in trajs]),
            "env/seconds": mean([t.env_s for t in trajs]),
            "rollout/length_mean": mean(lengths),
            "rollout/length_max": float(np.max(lengths)) if n else 0.0,
        }
        for k in info_keys:
            if k not in ("tool_calls", "tool_errors"):
                m[f"env/{self.label}/{k}"] = mean([t.info.get(k, 0.0) for t in trajs])
        return m


def _local(out, mesh):
    return parallel.local_rows((out.tokens, out.lengths), mesh)


class Played:
    """Multi-turn rollouts (env.name, rollout.mode='sync') as a rollout source: the step's
    prompts played to the end by the current parameters, scored by their environments.
    In 'overlap' and 'split' a rollout thread plays them (`rollout.thread.Threaded` with
    `EnvRollout` as its player)."""

    def __init__(self, s: Sampling, env_rollout: EnvRollout):
        self.s, self.env_rollout = s, env_rollout

    def next(self, step: int, params, clock) -> Rollout:
        batch = next(self.s.data)
        with self.s.compile_log.program("sampler", "multi-turn", runs=True):
            out, scored, _ = self.env_rollout(params, batch, step)
        clock.mark("sample")
        clock.mark("score")
        return Rollout(
            out=out, batch=batch, version=step, position=self.s.data.state(), scored=scored
        )

    def close(self) -> None:
        self.env_rollout.close()
