"""The turn loop: decode a turn, step the environments, append their observations.

    out, turns = play(sampler, params, prompt_ids, prompt_mask, spec, settings, pool,
                      trajs, renderer, tokenizer, step=step)

Every turn: `Sampler.decode` draws until each live row has stopped (an end-of-turn or
tool-call stop id) or spent `settings.turn_tokens`; the host reads the new tokens of each
live row, decodes them as the action, steps all live environments in parallel
(`EnvPool.step`), renders each observation as the next turn's ids (`Renderer.turn`: the
new turn only) and `Sampler.append`s them to the KV cache (the cache's bound on slots
rounded up to a bucket, `sampling.append_end`, so that the observations' varying widths
compile a few programs, not one per sum of widths). A trajectory ends when its
environment says done, fails, or would pass `max_turns` or `max_total_tokens` (an
observation longer than the tokens left, bounded in characters before it leaves the
worker, ends it as `long_observation`); its row
gets nothing appended and is marked stopped (`Sampler.stop`), so the next turn's decode
draws nothing for it and ends as soon as the live rows have stopped.

The completion of a row is its sampled turns and the observations between them, as the
sampler saw them (loss mask 1 and a behaviour log-prob on sampled tokens only); the
output has exactly `max_total_tokens` columns, so the reference and the update compile
once whatever the number of turns.

Partial rollouts (`refresh`, the rollout thread of the async modes): before each turn
after the first, `refresh()` gives the newest parameters and their version; when they are
newer than the ones the trajectories were drawn with, the KV cache is recomputed with
them (`Sampler.refresh`) and the turn is drawn by them. `Turns.versions` records the
version that drew each sampled token (-1 on prompt-side and observation tokens).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import parallel, sampling


@dataclasses.dataclass(frozen=True)
class TurnSettings:
    """max_turns: model turns per trajectory; turn_tokens: decode budget of one turn;
    max_total_tokens: completion tokens of a trajectory (its turns and observations);
    stop_ids: ids that end a turn; end_of_turn_ids: those after which a chat template
    does not close the turn again."""

    max_turns: int
    turn_tokens: int
    max_total_tokens: int
    stop_ids: tuple[int, ...]
    end_of_turn_ids: tuple[int, ...] = ()


@dataclasses.dataclass
class Turns:
    """Per row: [(kind, start, end)] spans of its completion, kind "model" or "env"."""

    spans: list
    obs_tokens: np.ndarray  # [n] observation tokens appended per row
    model_turns: np.ndarray  # [n] decoded turns per row
    versions: np.ndarray  # [n, max_total_tokens] version that drew each token, else -1


def play(sampler, params, prompt_ids, prompt_mask, spec, settings: TurnSettings, pool, trajs,
         renderer, tokenizer, *, step=None, version: int = 0, mesh=None,
         refresh=None):  # fmt: skip
    """Plays every trajectory to its end -> (SampleOutput [n, max_total_tokens], Turns).
    step: the random key's (`Sampler.start`; None draws as step 0); version: the
    parameters'; refresh: None, or a function -> (newest params, their version), read
    before every turn after the first."""
    n, s = len(trajs), settings
    state = sampler.start(params, prompt_ids, prompt_mask, spec, step, version=version)
    state = sampler.stop(state, [not t.live for t in trajs])  # reset failed: no turn
    lengths = np.zeros(n, np.int64)
    turns = Turns([[] for _ in range(n)], np.zeros(n, np.int64), np.zeros(n, np.int64),
                  np.full((n, s.max_total_tokens), -1, np.int64))  # fmt: skip
    for turn in range(s.max_turns):
        live = [i for i in range(n) if trajs[i].live]
        if refresh is not None and turn:
            newest, newest_version = refresh()
            if newest_version != version:  # the cache as the newer parameters compute it
                state, params, version = sampler.refresh(newest, state), newest, newest_version
        state = sampler.decode(params, state, s.turn_tokens, s.stop_ids)
        tokens, new_lengths = _fetch(sampler.result(state), mesh)
        actions = {}
        for i in live:
            ids = tokens[i, lengths[i] : new_lengths[i]]
            turns.spans[i].append(("model", int(lengths[i]), int(new_lengths[i])))
            turns.versions[i, lengths[i] : new_lengths[i]] = version
            turns.model_turns[i] += 1
            actions[i] = tokenizer.decode(ids, skip_special_tokens=True)
        lengths = new_lengths
        # Tokens left for the observation; its text may have as many characters as that
        # many tokens can cover (more stays in the worker, `long_observation`).
        room = {i: s.max_total_tokens - int(lengths[i]) - s.turn_tokens for i in actions}
        last = turn == s.max_turns - 1
        bounds = {i: -1 if last or r < 1 else renderer.max_chars(r) for i, r in room.items()}
        observations = pool.step(trajs, actions, bounds)
        if last:
            for i in observations:
                trajs[i].finish("max_turns")
            break
        for i in [i for i in observations if room[i] < 1]:  # no room whatever it says
            trajs[i].finish("max_total_tokens")
            del observations[i]
        appended = _render(observations, trajs, tokens, lengths, renderer, s)
        # Every process appends the same width (or none): the programs are collective.
        width = parallel.host_max(-(-max(map(len, appended.values()), default=0) // 8) * 8)
        if state.end + width + s.turn_tokens > sampler.cfg.max_position_embeddings:
            for i in appended:  # the shared cache slots would pass the model's context
                trajs[i].finish("context")
            appended, width = {}, 0
        state = sampler.stop(state, [i not in appended for i in range(n)])
        if not width:
            break
        ids, mask = _rows(appended, n, width, sampler.pad_id)
        limit = sampler.cfg.max_position_embeddings - s.turn_tokens
        end = sampling.append_end(state.end + width, limit)
        state = sampler.append(params, state, ids, mask, end)
        for i, obs in appended.items():
            turns.spans[i].append(("env", int(lengths[i]), int(lengths[i] + len(obs))))
            turns.obs_tokens[i] += len(obs)
            lengths[i] += len(obs)
    return fit(sampler.result(state), s.max_total_tokens, sampler.pad_id), turns


def _render(observations, trajs, tokens, lengths, renderer, s: TurnSettings) -> dict:
    """The ids of each observation that goes on (`render_observation`)."""
    out = {}
    for i, obs in observations.items():
        last = int(tokens[i, lengths[i] - 1]) if lengths[i] else None
        ids = render_observation(obs, trajs[i], last, int(lengths[i]), renderer, s)
        if ids is not None:
            out[i] = ids
    return out


def render_observation(obs, traj, last, length: int, renderer, s: TurnSettings):
    """The ids of a trajectory's observation after a model turn that ended on token
    `last` at completion length `length` -> ids, or None where the trajectory ends here:
    its observation and next turn would pass max_total_tokens (`long_observation`: no
    observation is cut, the policy never sees half a tool output), or the observation
    cannot be rendered (it fails)."""
    try:
        ids = renderer.turn(obs, last if last in s.end_of_turn_ids else None)
    except Exception as err:  # a template that refuses the message: that trajectory
        traj.finish("error", f"render: {type(err).__name__}: {err}"[:500])
        return None
    if not ids:
        traj.finish("error", "render: the observation has no tokens")
    elif length + len(ids) + s.turn_tokens > s.max_total_tokens:
        traj.finish("long_observation")
    else:
        return ids
    return None


def _fetch(out, mesh):
    tokens, lengths = parallel.local_rows((out.tokens, out.lengths), mesh)
    return np.asarray(tokens), np.asarray(lengths).astype(np.int64)


def _rows(appended: dict, n: int, width: int, pad_id: int):
    """[n, width] ids and mask. The width is rounded up to a multiple of 8, so the append
    program (and the decodes after it, whose cache layout follows) compiles for fewer
    widths; the masked columns are holes that `result` compacts away."""
    ids = np.full((n, width), pad_id, np.int32)
    mask = np.zeros((n, width), bool)
    for i, row in appended.items():
        ids[i, : len(row)], mask[i, : len(row)] = row, True
    return ids, mask


@functools.partial(jax.jit, static_argnums=(1, 2))
def fit(out: sampling.SampleOutput, width: int, pad_id: int) -> sampling.SampleOutput:
    """The completion columns cut or padded to `width` (rows are compacted to the left
    and no longer than `width`, so nothing real is cut)."""

    P = out.prompt_tokens.shape[1]

    def fix(x, fill):
        x = x[:, :width]
        return jnp.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=fill)

    return out.replace(
        tokens=fix(out.tokens, pad_id),
        mask=fix(out.mask, False),
        loss_mask=fix(out.loss_mask, False),
        logprobs=fix(out.logprobs, 0.0),
        routes=sampling.fit_routes(out.routes, P, P, width),
    )
