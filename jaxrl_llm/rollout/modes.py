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

# rollout.mode -> its rollout source where the rollout thread does not serve it (`sources`)
SOURCES = {"sync": Sampled, "overlap": SampledAhead}


def make_source(config, s: Sampling, algo, env_rollout=None):
    """The run's rollout source. Environments or agents (env.name / agent.entry, an
    `EnvRollout` / `AgentRollout`) in 'sync' play in the step (`Played`). The rollout
    thread serves 'split', and 'overlap' where the step cannot sample ahead itself (a
    player, or an engine whose `sample` runs on the host to the end, `dispatches_ahead`
    False: the paged one): there it runs one version behind on the training mesh, on a
    copy of the parameters the update donates (as it does for rollout workers, which
    read the training mesh's). A trainer of several processes with rollout workers
    draws on process 0 for all (`Shared`). The rest is `SOURCES`' by mode, with DAPO's
    dynamic sampling around it."""
    mode = config.rollout.mode
    if mode == "sync" and env_rollout is not None:
        return Played(s, env_rollout)
    if mode == "split" and s.workers is not None and jax.process_count() > 1:
        return Shared(s, config)
    if mode == "split" or (
        mode == "overlap" and (env_rollout is not None or not s.sampler.dispatches_ahead)
    ):
        overlap = mode == "overlap"
        return Threaded(
            s,
            config,
            player=env_rollout,
            max_staleness=1 if overlap else None,
            copy=overlap or s.workers is not None,
        )
    source = SOURCES[mode](s, config)
    if algo.dynamic_sampling:
        source = Refilled(source, s, algo.max_resample_rounds)
    return source
