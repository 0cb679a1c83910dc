"""rollout.mode='overlap': the next step's rollout sampled with the parameters before this
step's update, exactly; staleness recorded; checkpoints consume every batch once."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import make_model_dir, signal_config

from jaxrl_llm import data, parallel, rl, sampling, train
from jaxrl_llm.config import ConfigError, validate
from jaxrl_llm.rollout.sources import SampledAhead
from jaxrl_llm.rollout.thread import Handoff
from jaxrl_llm.startup import compilation
from jaxrl_llm.trainer import checkpoint
from jaxrl_llm.trainer.metrics import read_metrics
from jaxrl_llm.trainer.run import Run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("tiny_model")))


def overlap_config(model_dir, steps=4):
    c = signal_config(model_dir)  # grpo, beta 0.04: a reference model too
    c.rollout.mode = "overlap"
    c.train.num_steps = steps
    return c


def split_config(model_dir, steps=4, max_staleness=1):
    """Training mesh: 4 devices (fsdp 2 x tensor 2); rollout mesh: the other 4 (fsdp 4)."""
    c = overlap_config(model_dir, steps)
    c.rollout.mode, c.rollout.max_staleness = "split", max_staleness
    c.mesh.fsdp, c.mesh.tensor, c.mesh.rollout_devices = -1, 2, 4
    c.train.log_every = 1
    return c


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def test_overlap_equals_a_loop_sampling_with_the_parameters_before_the_update(model_dir, tmp_path):
    """Step t's rollout comes from the parameters before update t - 1 (step 0's from the
    initial ones): the run's parameters after 4 steps equal those of a plain loop that
    does exactly that, bit for bit, and the staleness metric says 0, 1, 1, 1."""
    run = Run.build(overlap_config(model_dir), str(tmp_path))
    s = run.sampling
    initial, position = _copy(run.state), s.data.state()
    staleness = [run.step(t).host["rollout/staleness_max"] for t in range(4)]
    got = _copy(run.state.params)
    assert staleness == [0.0, 1.0, 1.0, 1.0]

    run.state, history = initial, [_copy(initial.params)]
    s.data.restore(position)
    for t in range(4):
        batch = next(s.data)
        version = max(t - 1, 0)
        out = s.sampler.sample(
            history[version], batch.prompt_ids, batch.prompt_mask, run.spec, t, version=version
        )
        # The reference is the initial policy: step 0's update reads the rollout's
        # behaviour log-probs in its place (`Run.reads_reference`), later ones its forward.
        ref = out.logprobs if t == 0 else run.ref_logprobs(run.ref_params, out)
        rewards = parallel.shard_local_batch(s.scorer(out, batch).rewards, run.mesh)
        run.state, _ = run.update(run.state, rl.RolloutBatch.from_sample(out, rewards, ref))
        history.append(_copy(run.state.params))
        assert np.all(np.asarray(out.policy_version) == version)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(run.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # The version matters: the newest parameters would have sampled something else.
    newest = s.sampler.sample(history[3], batch.prompt_ids, batch.prompt_mask, run.spec, 3)
    assert not np.array_equal(np.asarray(newest.logprobs), np.asarray(out.logprobs))
    run.pool.close()


def data_order(config, steps: int) -> list[str]:
    """The first prompt of each step's batch in data order: what a synchronous run trains
    on at steps 0 .. steps - 1."""
    from jaxrl_llm.models import builtin

    tokenizer = builtin.load_tokenizer(builtin.resolve(config.model.path))
    it = data.make_iterator(config.data, tokenizer, config.rollout.batch_size)
    return [next(it).prompts[0] for _ in range(steps)]


@pytest.mark.parametrize("mode", [pytest.param("overlap", marks=pytest.mark.slow), "split"])
def test_sigterm_and_resume_consume_every_batch_once(model_dir, tmp_path, monkeypatch, mode):
    """SIGTERM during step 2 of an overlap / split run: the save happens while later
    rollouts are in flight; the resumed run samples their prompts again, so the prompts
    trained on, step by step, are those of a synchronous run (none twice, none skipped)."""
    seen = []
    rollout, take, step = SampledAhead.next, Handoff.take, Run.step

    def recording(self, t, params, clock):
        ro = rollout(self, t, params, clock)
        seen.append((t, ro.batch.prompts[0]))
        return ro

    def taking(self, t):
        item = take(self, t)
        seen.append((t, item.batch.prompts[0]))
        return item

    def step_then_sigterm(self, t):
        out = step(self, t)
        if t == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(SampledAhead, "next", recording)
    monkeypatch.setattr(Handoff, "take", taking)
    monkeypatch.setattr(Run, "step", step_then_sigterm)
    c = overlap_config(model_dir, steps=5) if mode == "overlap" else split_config(model_dir, 5, 2)
    train.train(c, str(tmp_path / "run"))
    assert [t for t, _ in seen] == [0, 1, 2]
    monkeypatch.setattr(Run, "step", step)
    train.train(c, str(tmp_path / "run"))  # resumes at step 3
    assert seen == list(enumerate(data_order(c, 5)))


def test_overlap_refuses_dynamic_sampling(model_dir):
    c = overlap_config(model_dir)
    c.algo.name = "dapo"
    with pytest.raises(ConfigError, match="rollout.mode='overlap' does not combine"):
        validate(c)
    c.rollout.mode = "async"
    with pytest.raises(ConfigError, match="rollout.mode='async': expected one of sync, overlap"):
        validate(c)


def _final_params(workdir):
    with checkpoint.Checkpointer(str(workdir / "checkpoints"), read_only=True) as ck:
        return ck.restore(ck.latest_step())[0]["params"]


def test_split_with_max_staleness_0_reproduces_sync(model_dir, tmp_path):
    """A rollout mesh of its own that waits for each update (max_staleness 0) trains like
    the one-mesh synchronous run: the same parameters after 4 steps, to 2e-5 where a step
    moves a weight by up to the learning rate, 1e-3. The two runs' programs are
    partitioned over different meshes, so their sums round differently, and Adam's
    normalized step turns that rounding in a near-zero gradient into up to a few 1e-6 on
    some CPUs (AVX-512); a rollout one update stale would be off by ~1e-3."""
    c = split_config(model_dir, steps=4, max_staleness=0)
    split = train.train(c, str(tmp_path / "split"))
    s = signal_config(model_dir)
    s.train.num_steps = 4
    train.train(s, str(tmp_path / "sync"))
    assert split["rollout/staleness_max"] == 0.0 and "perf/rollout_wait_s" in split
    a, b = _final_params(tmp_path / "split"), _final_params(tmp_path / "sync")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-5, rtol=0)


def test_split_staleness_stays_within_the_bound(model_dir, tmp_path, monkeypatch):
    """A slow verifier (the thread is behind) then a slow learner (the thread runs ahead
    until the bound stops it): every step's staleness <= max_staleness = 2, and the bound
    is reached; each row's policy_version is the version the thread sampled with."""
    slow = tmp_path / "slow_reward.py"
    slow.write_text(
        "import time\n"
        "def slow(completion, example):\n"
        "    time.sleep(0.02)\n"
        "    return float(completion[:1].isdigit())\n"
    )
    c = split_config(model_dir, steps=8, max_staleness=2)
    c.rewards = {"slow": {"name": f"{slow}:slow", "weight": 1.0}}
    step, versions = Run.step, []

    def slow_learner(self, t):
        if t >= 3:
            time.sleep(1.0)  # several of the thread's rollouts per learner step
        return step(self, t)

    def checked_take(self, t):
        item = take(self, t)
        rows = np.asarray(item.out.policy_version)
        assert np.all(rows == item.version)
        versions.append((t, item.version))
        return item

    take = Handoff.take
    monkeypatch.setattr(Run, "step", slow_learner)
    monkeypatch.setattr(Handoff, "take", checked_take)
    train.train(c, str(tmp_path / "run"))
    logged = [m for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if "step" in m]
    lags = [m["rollout/staleness_max"] for m in logged if "rollout/staleness_max" in m]
    assert len(lags) == 8 and max(lags) <= 2.0
    assert max(lags[3:]) == 2.0  # the slow learner let the thread run to the bound
    assert [t - v for t, v in versions] == lags
    assert all(
        m["perf/rollout_wait_s"] >= 0 and m["perf/learner_wait_s"] >= 0
        for m in logged
        if "perf/rollout_wait_s" in m
    )


KILLED_CONFIG = """
import sys
sys.path.insert(0, {tests!r})
from tiny_run import signal_config


def get_config():
    c = signal_config({model_dir!r})
    c.rewards = {{"slow": {{"name": {reward!r}, "weight": 1.0}}}}
    c.train.num_steps, c.train.print_samples_every = {steps}, 1
    c.checkpoint.every, c.checkpoint.async_save = 1, False
    c.rollout.mode, c.rollout.max_staleness = "split", 2
    c.rollout.engine = {engine!r}
    c.mesh.fsdp, c.mesh.tensor, c.mesh.rollout_devices = -1, 2, 4
    return c
"""


def _first_prompts(workdir) -> dict[int, str]:
    """Step -> its first prompt, from samples.jsonl (the last record of a step rerun)."""
    with open(workdir / "samples.jsonl") as f:
        return {r["step"]: r["prompt"] for r in map(json.loads, f)}


@pytest.mark.parametrize(
    "engine, steps", [("static", 12), pytest.param("paged", 6, marks=pytest.mark.slow)]
)
def test_kill_9_and_resume_consume_every_batch_once(model_dir, tmp_path, engine, steps):
    """A split run killed with SIGKILL after its third step resumes from its last
    checkpoint: the prompts of every step, and the steps logged, are those of a
    synchronous run (none twice, none skipped). With the paged engine the rollout thread
    is its stream (one session across steps, rows of the next steps in flight)."""
    reward = tmp_path / "slow_reward.py"
    reward.write_text(
        "import time\n"
        "def slow(completion, example):\n"
        "    time.sleep(0.02)\n"
        "    return float(completion[:1].isdigit())\n"
    )
    config = tmp_path / "config.py"
    config.write_text(
        KILLED_CONFIG.format(
            tests=os.path.dirname(__file__),
            model_dir=model_dir,
            reward=f"{reward}:slow",
            engine=engine,
            steps=steps,
        )
    )
    workdir = tmp_path / "split"
    cmd = [sys.executable, "-m", "jaxrl_llm.train", f"--config={config}", f"--workdir={workdir}"]
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while len(_steps(workdir)) < 3:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the trainer did not log in time"
        time.sleep(0.05)
    proc.kill()
    proc.communicate()
    assert 3 <= len(_steps(workdir)) < steps  # killed mid-run
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed from" in rerun.stderr
    assert _steps(workdir) == list(range(1, steps + 1))
    expected = data_order(_load_config(config), steps)
    assert _first_prompts(workdir) == {t + 1: p for t, p in enumerate(expected)}


def _steps(workdir) -> list[int]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.endswith("\n")]


def _load_config(path):
    spec = importlib.util.spec_from_file_location("killed_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.mark.slow
def test_partial_rollouts_switch_to_newer_parameters(model_dir, tmp_path, monkeypatch, capfd):
    """rollout.partial with a slow sampler (each decode call of 1 token sleeps): newer
    parameters arrive while a generation is in flight, it goes on with them, and the
    metrics see it (rows with tokens of a newer version, token staleness below the rows')."""
    decode = sampling.Sampler.decode

    def slow_decode(self, *args, **kwargs):
        time.sleep(0.3)  # the learner publishes while a generation is in flight
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(sampling.Sampler, "decode", slow_decode)
    c = split_config(model_dir, steps=5, max_staleness=1)
    c.rollout.partial, c.rollout.partial_chunk = True, 1
    # Compiled, not loaded from the session's cache: the chunk compiles count below.
    c.train.compilation_cache_dir = ""
    session_cache = jax.config.jax_compilation_cache_dir
    try:
        train.train(c, str(tmp_path / "run"))
    finally:
        compilation.use_cache(session_cache or "")
    logged = [
        m for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if "rollout/partial_frac" in m
    ]
    assert len(logged) == 5
    assert max(m["rollout/staleness_max"] for m in logged) <= 1.0
    assert any(m["rollout/partial_frac"] > 0 for m in logged)
    assert any(m["rollout/token_staleness_mean"] < m["rollout/staleness_mean"] for m in logged)
    # Each chunk's decode program says it compiles, with its time (6 chunks of 1 token).
    err = capfd.readouterr().err.replace("\r", "\n").splitlines()
    lines = [x for x in err if "partial tokens" in x and "compiling sampler" in x]
    lines = [x for x in lines if not x.endswith("...")]  # announced while compiling
    chunks = {x.split("partial tokens ")[1].split(")")[0] for x in lines}
    assert 1 <= len(chunks) <= 6 and all(x.endswith(" s") for x in lines), lines


def test_static_stream_is_the_samplers_own_calls():
    """The static engine's stream session (`sampling.engine.StaticStream`) draws what the
    sampler's own calls draw: a step in one program is `Sampler.sample(step)`; partial,
    with newer parameters swapped in after chunk k, it is start, decode per chunk and
    `Sampler.refresh` before chunk k + 1, each column recording its version."""
    from tiny_run import tiny_model_config

    from jaxrl_llm import models
    from jaxrl_llm.sampling.engine import open_session

    cfg = tiny_model_config(max_position_embeddings=512)
    p0, p1 = models.init_params(cfg, seed=3), models.init_params(cfg, seed=4)
    sampler = sampling.Sampler(cfg, seed=7)
    spec = sampling.RolloutSpec(num_generations=3, max_new_tokens=12, temperature=0.9)
    ids, mask = sampling.pad_prompts([[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [11], [4]], 0)

    def streamed(chunk, swap_after):
        stream = open_session(sampler, "stream", p0, 0, spec, chunk=chunk)
        stream.submit(5, ids, mask, 5)
        for i in range(spec.max_new_tokens):
            if i == swap_after:
                stream.swap(p1, 1)
            if stream.run_chunk() == [5]:
                return jax.device_get(stream.output(5))
        raise AssertionError("the step never finished")

    def same(a, b):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(jax.device_get(b)), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    out, columns = streamed(0, 99)
    same(out, sampler.sample(p0, ids, mask, spec, 5))
    assert (columns == 0).all()
    for chunk, swap_after in ((4, 1), (5, 2)):
        state, params = sampler.start(p0, ids, mask, spec, 5), p0
        for i, first in enumerate(range(0, spec.max_new_tokens, chunk)):
            if i == swap_after:
                state, params = sampler.refresh(p1, state), p1
            state = sampler.decode(params, state, min(chunk, spec.max_new_tokens - first))
        out, columns = streamed(chunk, swap_after)
        same(out, sampler.result(state))
        want = np.arange(spec.max_new_tokens) >= swap_after * chunk
        np.testing.assert_array_equal(columns, want.astype(int))
        assert out.policy_version.tolist() == [0] * 12
