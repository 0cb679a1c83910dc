"""The run's rollout source, picked by the config: `rollout.mode` (sync, overlap, split),
with multi-turn environments or agents (env.name / agent.entry), the paged engine's
single-turn stream (rollout.engine='paged') and DAPO's dynamic sampling around the rest.

    source = make_source(config, sampling, algo, env_rollout)   # -> a `sources` object

The sources themselves are `sources`' (sync, overlap, DAPO's refill), `thread`'s
(split), `played`'s (environments) and `paged_stream`'s (the paged engine's thread); the
choice sits above them so that none imports the others. Adding a mode is an entry in
`SOURCES` (or a case in `make_source`); docs/step.md says how.
"""

from __future__ import annotations

from jaxrl_llm.rollout.paged_stream import PagedStream
from jaxrl_llm.rollout.played import Played
from jaxrl_llm.rollout.sources import Refilled, Sampled, SampledAhead, Sampling
from jaxrl_llm.rollout.thread import Threaded

# rollout.mode -> its rollout source (`sources`); each takes (Sampling, config).
SOURCES = {"sync": Sampled, "overlap": SampledAhead, "split": Threaded}


def make_source(config, s: Sampling, algo, env_rollout=None):
    """The run's rollout source: the environments' or the agents' (env.name /
    agent.entry, an `EnvRollout` / `AgentRollout`: played in the step in 'sync', by the
    rollout thread in 'split', and in 'overlap' by the thread on the training mesh one
    version behind; on either engine, the paged one holding one `TurnSession` per step),
    the paged engine's single-turn stream in 'overlap' and 'split' (the same, with a
    `paged_stream.PagedStream` thread), else the one of rollout.mode, with DAPO's dynamic
    sampling around it."""
    if env_rollout is not None:
        mode = config.rollout.mode
        if mode == "sync":
            return Played(s, env_rollout)
        if mode == "split":
            return Threaded(s, config, player=env_rollout)
        return Threaded(s, config, player=env_rollout, max_staleness=1, copy=True)
    if config.rollout.engine == "paged" and config.rollout.mode != "sync":  # one session
        if config.rollout.mode == "split":
            return Threaded(s, config, thread=PagedStream)
        return Threaded(s, config, max_staleness=1, copy=True, thread=PagedStream)
    source = SOURCES[config.rollout.mode](s, config)
    if algo.dynamic_sampling:
        source = Refilled(source, s, algo.max_resample_rounds)
    return source
