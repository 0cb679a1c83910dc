"""rollout.mode='overlap': the next step's rollout sampled with the parameters before this
step's update, exactly; staleness recorded; checkpoints consume every batch once."""

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import make_model_dir, signal_config

from jaxrl_llm import parallel, rl, train
from jaxrl_llm.run import Run
from jaxrl_llm.run_config import ConfigError, validate


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("tiny_model")))


def overlap_config(model_dir, steps=4):
    c = signal_config(model_dir)  # grpo, beta 0.04: a reference model too
    c.rollout.mode = "overlap"
    c.train.num_steps = steps
    return c


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def test_overlap_equals_a_loop_sampling_with_the_parameters_before_the_update(
    model_dir, tmp_path
):
    """Step t's rollout comes from the parameters before update t - 1 (step 0's from the
    initial ones): the run's parameters after 4 steps equal those of a plain loop that
    does exactly that, bit for bit, and the staleness metric says 0, 1, 1, 1."""
    run = Run(overlap_config(model_dir), str(tmp_path))
    initial, position = _copy(run.state), run.data_iter.state()
    staleness = [run.step(t)["rollout/staleness_max"] for t in range(4)]
    got = _copy(run.state.params)
    assert staleness == [0.0, 1.0, 1.0, 1.0]

    run.state, history = initial, [_copy(initial.params)]
    run.data_iter.restore(position)
    for t in range(4):
        batch = next(run.data_iter)
        version = max(t - 1, 0)
        out = run.sampler.sample(history[version], batch.prompt_ids, batch.prompt_mask,
                                 run.spec, t, version=version)  # fmt: skip
        ref = run.ref_logprobs(run.ref_params, out)
        rewards = parallel.shard_local_batch(run.scorer(out, batch).rewards, run.mesh)
        run.state, _ = run.update(run.state, rl.RolloutBatch.from_sample(out, rewards, ref))
        history.append(_copy(run.state.params))
        assert np.all(np.asarray(out.policy_version) == version)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(run.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # The version matters: the newest parameters would have sampled something else.
    newest = run.sampler.sample(history[3], batch.prompt_ids, batch.prompt_mask, run.spec, 3)
    assert not np.array_equal(np.asarray(newest.logprobs), np.asarray(out.logprobs))
    run.pool.close()


def test_sigterm_and_resume_consume_every_batch_once(model_dir, tmp_path, monkeypatch):
    """SIGTERM during step 2 of an overlap run: the save happens while step 3's rollout
    is in flight; the resumed run samples step 3's prompts again, so the prompts trained
    on, step by step, are those of a synchronous run (none twice, none skipped)."""
    seen: dict[str, list] = {"sync": [], "overlap": []}
    rollout, step = Run._rollout, Run.step
    where = ["sync"]

    def recording(self, t):
        batch, out, version = rollout(self, t)
        seen[where[0]].append((t, np.asarray(batch.prompt_ids).tobytes()))
        return batch, out, version

    monkeypatch.setattr(Run, "_rollout", recording)
    c = overlap_config(model_dir, steps=5)
    c.rollout.mode = "sync"
    train.train(c, str(tmp_path / "sync"))

    where[0] = "overlap"
    c.rollout.mode = "overlap"

    def step_then_sigterm(self, t):
        out = step(self, t)
        if t == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(Run, "step", step_then_sigterm)
    train.train(c, str(tmp_path / "overlap"))
    assert [t for t, _ in seen["overlap"]] == [0, 1, 2]
    monkeypatch.setattr(Run, "step", step)
    train.train(c, str(tmp_path / "overlap"))  # resumes at step 3
    assert seen["overlap"] == seen["sync"]


def test_overlap_refuses_dynamic_sampling(model_dir):
    c = overlap_config(model_dir)
    c.algo.name = "dapo"
    with pytest.raises(ConfigError, match="rollout.mode='overlap' does not combine"):
        validate(c)
    c.rollout.mode = "async"
    with pytest.raises(ConfigError, match="rollout.mode='async': expected one of sync, overlap"):
        validate(c)
