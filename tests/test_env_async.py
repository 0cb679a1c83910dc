"""Multi-turn rollouts in rollout.mode='overlap' and 'split': the staleness bound, the
version of every sampled token (checked against teacher-forced log-probs under the
parameters of that version), and a kill -9 and resume that trains on the prompts of a
synchronous run."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from test_async import _load_config, _steps, data_order
from tiny_run import TOKENIZER, make_model_dir, tiny_config, tiny_model_config

from jaxrl_llm import envs, models, rl, sampling, train
from jaxrl_llm.models import builtin
from jaxrl_llm.rollout.thread import Handoff
from jaxrl_llm.trainer.metrics import read_metrics
from jaxrl_llm.trainer.run import Run

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
SCRIPTED = os.path.join(TESTS, "envs_for_tests.py") + ":Scripted"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("tiny_model")))


def env_config(model_dir, mode: str, steps: int, max_staleness: int = 1):
    """tiny_config with the scripted environment (2 turns), 4 prompts x 2, in `mode`."""
    c = tiny_config(model_dir)
    c.rewards = {}
    c.rollout.batch_size, c.rollout.num_generations, c.rollout.max_new_tokens = 4, 2, 4
    c.env.name, c.env.options = SCRIPTED, {"turns": 2}
    c.env.max_turns, c.env.max_total_tokens, c.env.workers = 2, 16, 1
    c.rollout.cache_segments, c.model.scan_layers = 1, True  # shorter compiles
    c.algo.beta = 0.0
    c.train.num_steps, c.train.log_every = steps, 1
    c.rollout.mode, c.rollout.max_staleness = mode, max_staleness
    if mode == "split":
        c.mesh.fsdp, c.mesh.tensor, c.mesh.rollout_devices = -1, 2, 4
    return c


def test_turns_drawn_by_newer_parameters_keep_their_versions():
    """envs.play with a refresh that hands newer parameters from the second turn on: each
    sampled token's version is the one that drew it, and its behaviour log-prob equals a
    teacher-forced forward of the whole trajectory under exactly those parameters."""
    cfg = tiny_model_config(vocab_size=33, max_position_embeddings=256)
    a, b = models.init_params(cfg, seed=0), models.init_params(cfg, seed=1)
    tok = builtin.load_tokenizer(TOKENIZER)
    settings = envs.TurnSettings(
        max_turns=3, turn_tokens=5, max_total_tokens=24, stop_ids=(18, 22), end_of_turn_ids=(18, 22)
    )
    spec = sampling.RolloutSpec(2, 24, 1.0, stop_ids=(18, 22))
    renderer = envs.Renderer(tok, use_chat=False)
    with envs.EnvPool(SCRIPTED, {"turns": 3}, workers=1) as pool:
        examples = [{"question": "1+2=", "turns": 2}, {"question": "12*3=", "turns": 3}]
        trajs, observations = pool.reset(examples)
        ids, mask = sampling.pad_prompts([renderer.prompt(o) for o in observations], 0)
        trajs, _ = envs.replicate(trajs, observations, 2)
        sampler = sampling.Sampler(cfg, None, seed=3, cache_segments=1)
        out, turns = envs.play(
            sampler,
            a,
            ids,
            mask,
            spec,
            settings,
            pool,
            trajs,
            renderer,
            tok,
            step=0,
            version=4,
            refresh=lambda: (b, 5),
        )
    loss_mask, logprobs = np.asarray(out.loss_mask), np.asarray(out.logprobs)
    np.testing.assert_array_equal(turns.versions >= 0, loss_mask)  # sampled tokens only
    for i, spans in enumerate(turns.spans):
        model = [(x, y) for kind, x, y in spans if kind == "model"]
        assert (turns.versions[i, model[0][0] : model[0][1]] == 4).all()
        for x, y in model[1:]:
            assert (turns.versions[i, x:y] == 5).all()
    assert (turns.versions == 5).any() and (turns.versions == 4).any()
    logprob_fn = rl.make_logprob_fn(cfg, spec, chunk_size=8)
    for params, version in ((a, 4), (b, 5)):
        forced = np.asarray(logprob_fn(params, out))
        where = turns.versions == version
        np.testing.assert_allclose(forced[where], logprobs[where], atol=1e-4)
    assert np.asarray(out.policy_version).tolist() == [4] * 4


def test_multi_turn_overlap_stays_within_the_bound(model_dir, tmp_path, monkeypatch):
    """Environment rollouts in 'overlap', played by the rollout thread on the training
    mesh: each step's staleness is at most 1 (reached while the learner is slow); each
    row's policy_version is the version the thread started it with, and each sampled
    token's recorded version lies between that and the step's."""
    steps, bound = 3, 1
    c = env_config(model_dir, "overlap", steps)
    take, step, seen = Handoff.take, Run.step, []

    def checked_take(self, t):
        item = take(self, t)
        assert np.all(np.asarray(item.out.policy_version) == item.version)
        v, lengths = item.token_versions, np.asarray(item.scored.lengths)
        assert v.shape == (8, 16) and ((v == -1) | ((v >= item.version) & (v <= t))).all()
        assert all(
            (row[:n] >= 0).any() and (row[n:] == -1).all()
            for row, n in zip(v, lengths, strict=True)
        )
        seen.append((t, item.version))
        return item

    def slow_learner(self, t):
        if t >= 1:
            time.sleep(0.5)  # the thread runs ahead to the bound
        return step(self, t)

    monkeypatch.setattr(Handoff, "take", checked_take)
    monkeypatch.setattr(Run, "step", slow_learner)
    train.train(c, str(tmp_path / "run"))
    logged = [m for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if "step" in m]
    lags = [m["rollout/staleness_max"] for m in logged]
    assert len(lags) == steps and max(lags) <= bound and lags[0] == 0
    assert [t - v for t, v in seen] == lags
    assert max(lags[1:]) == bound  # the slow learner let the thread run to the bound
    assert all(m["env/turns_mean"] >= 1 and np.isfinite(m["loss/total"]) for m in logged)
    assert all(0 <= m["rollout/token_staleness_mean"] <= m["rollout/staleness_max"] for m in logged)


KILLED_CONFIG = """
import sys
sys.path.insert(0, {tests!r})
from test_env_async import env_config


def get_config():
    c = env_config({model_dir!r}, "split", 5, max_staleness=2)
    c.rollout.partial = True  # newer parameters between turns
    c.train.print_samples_every = 1
    c.checkpoint.every, c.checkpoint.async_save = 1, False
    return c
"""


def test_multi_turn_split_kill_9_and_resume_consume_every_batch_once(model_dir, tmp_path):
    """A split multi-turn run (max_staleness 2, partial: newer parameters between turns)
    killed with SIGKILL after its second step resumes from its last checkpoint: the
    prompts of every step, and the steps logged, are those of a synchronous run (none
    twice, none skipped); every step's staleness is within the bound, and its tokens'
    mean staleness no more than its rows'."""
    config = tmp_path / "config.py"
    config.write_text(KILLED_CONFIG.format(tests=TESTS, model_dir=model_dir))
    workdir = tmp_path / "split"
    cmd = [sys.executable, "-m", "jaxrl_llm.train", f"--config={config}", f"--workdir={workdir}"]
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while len(_steps(workdir)) < 2:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the trainer did not log in time"
        time.sleep(0.05)
    proc.kill()
    proc.communicate()
    assert 2 <= len(_steps(workdir)) < 5  # killed mid-run
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed from" in rerun.stderr
    assert _steps(workdir) == list(range(1, 6))
    expected = data_order(_load_config(config), 5)
    with open(workdir / "samples.jsonl") as f:
        # The prompt is the row's question (Scripted's reset), not its "{question}=".
        got = {r["step"]: r["prompt"].removeprefix("<bos>") for r in map(json.loads, f)}
    assert got == {t + 1: p.removesuffix("=") for t, p in enumerate(expected)}
    logged = [m for m in read_metrics(workdir / "metrics.jsonl") if "step" in m]
    assert all(m["rollout/staleness_max"] <= 2 for m in logged)
    assert all(0 <= m["rollout/token_staleness_mean"] <= m["rollout/staleness_max"] for m in logged)
