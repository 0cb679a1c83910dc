"""The run's rollout source, picked by the config: `rollout.mode` (sync, overlap, split),
with multi-turn environments or agents (env.name / agent.entry) and DAPO's dynamic
sampling around the rest.

    source = make_source(config, sampling, algo, env_rollout)   # -> a `sources` object

The sources themselves are `sources`' (sync, overlap, DAPO's refill), `thread`'s
(split, and overlap on an engine that does not dispatch ahead), `shared`'s (split with
rollout workers on a trainer of several processes) and `played`'s (environments); the
choice sits above them so that none imports the others. Adding a mode is an entry in
`SOURCES` (or a case in `make_source`); docs/step.md says how.
"""

from __future__ import annotations

import jax

from jaxrl_llm.rollout.played import Played
from jaxrl_llm.rollout.shared import Shared
from jaxrl_llm.rollout.sources import Refilled, Sampled, SampledAhead, Sampling
from jaxrl_llm.rollout.thread import Threaded

# rollout.mode -> its rollout source (`sources`); each takes (Sampling, config).
SOURCES = {"sync": Sampled, "overlap": SampledAhead, "split": Threaded}


def make_source(config, s: Sampling, algo, env_rollout=None):
    """The run's rollout source: the environments' or the agents' (env.name /
    agent.entry, an `EnvRollout` / `AgentRollout`: played in the step in 'sync', by the
    rollout thread in 'split', and in 'overlap' by the thread on the training mesh one
    version behind; on either engine), else the one of rollout.mode, with DAPO's dynamic
    sampling around it; 'overlap' on an engine whose `sample` runs on the host to the end
    (`dispatches_ahead` False: the paged one) is the rollout thread one version behind
    instead, its stream session kept across steps."""
    if env_rollout is not None:
        mode = config.rollout.mode
        if mode == "sync":
            return Played(s, env_rollout)
        if mode == "split":
            return Threaded(s, config, player=env_rollout)
        return Threaded(s, config, player=env_rollout, max_staleness=1, copy=True)
    if config.rollout.mode == "overlap" and not s.sampler.dispatches_ahead:
        return Threaded(s, config, max_staleness=1, copy=True)  # one session across steps
    if config.rollout.mode == "split" and s.workers is not None:  # rollout.workers
        if jax.process_count() > 1:  # process 0 draws for all (`shared`)
            return Shared(s, config)
        # The parameters stay on the training mesh, which the update donates: the thread
        # sends a copy.
        return Threaded(s, config, copy=True)
    source = SOURCES[config.rollout.mode](s, config)
    if algo.dynamic_sampling:
        source = Refilled(source, s, algo.max_resample_rounds)
    return source
