"""The paged engine as a streaming rollout source: a session kept across steps
(`PagedSampler.stream`, `paged_schedule.Session`) and the rollout thread over it
(`sampling.engine.PagedStream`) in overlap and split."""

import types

import jax
import numpy as np
import pytest
from tiny_run import teacher_forced_logprobs, tiny_model_config

from jaxrl_llm import models, sampling

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [11], [40, 41, 42, 43, 44]]
LATER = [[9, 8, 7, 6, 5, 4, 3, 2, 1, 20, 21, 22, 23], [33, 34], [17, 18, 19], [2, 4, 6, 8]]


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_model_config(max_position_embeddings=512)
    return cfg, models.init_params(cfg, seed=3), models.init_params(cfg, seed=4)


@pytest.fixture(scope="module")
def paged(tiny):
    """One engine for the module's tests (its programs compile once per shape)."""
    return sampling.PagedSampler(tiny[0], slots=5, page_size=4, chunk_steps=3, prefill_chunk=8)


def submit(session, paged, key, prompts, spec):
    ids, mask = paged.bucketed(*sampling.pad_prompts(prompts, 0))
    rows = ids.shape[0] * spec.num_generations
    session.submit(key, ids, mask, np.full(rows, spec.max_new_tokens), key_base=key * rows)


def same_rows(out, ref, rows):
    for name in ("tokens", "lengths", "finish", "prompt_tokens"):
        got, want = np.asarray(getattr(out, name))[rows], np.asarray(getattr(ref, name))[rows]
        np.testing.assert_array_equal(got, want, err_msg=name)
    gap = np.abs(np.asarray(out.logprobs) - np.asarray(ref.logprobs))[rows]
    assert gap.max() <= 1e-5


def test_greedy_across_steps_equals_the_static_sampler(tiny, paged):
    """Two steps' prompts queued in one session (step 1's rows take the slots step 0's
    short rows leave, and rows of both decode in one chunk; prompts admitted together
    prefilled in one program): at temperature 0 each step's rows equal the static
    sampler's."""
    cfg, params, _ = tiny
    spec = sampling.RolloutSpec(
        num_generations=3, max_new_tokens=12, temperature=0.0, stop_ids=(7, 16)
    )
    session = paged.stream(params, 2, spec, width=16, rows=12)
    submit(session, paged, 0, PROMPTS, spec)
    submit(session, paged, 1, LATER, spec)
    done, mixed = [], False
    while session.busy:
        done += session.run_chunk()
        pool = session.turns.pool
        mixed |= {pool.owner[s].row[0] for s in pool.order} == {0, 1}
    assert done == [0, 1] and mixed
    # Prompts admitted together were prefilled in one program (batched prefill).
    assert any(k[0] == "prefill" and k[1][0] > 1 for k in paged.traces), paged.traces
    for key, prompts in zip(done, (PROMPTS, LATER), strict=True):
        out = session.output(key)[0]
        assert np.all(np.asarray(out.policy_version) == 2)
        ids, mask = sampling.pad_prompts(prompts, 0)
        ref = sampling.Sampler(cfg).sample(params, ids, mask, spec, key, version=2)
        same_rows(out, ref, slice(None))


@pytest.mark.slow
def test_moe_routes_across_steps_equal_the_static_samplers():
    """An MoE model with a dense-MLP layer (GLM-style), two steps' prompts in one session
    (batched prefills of prompts of 1 and 2 chunks): each step's `output` routes equal
    the static sampler's at every real token but each row's last (never fed: -1), -1 in
    the dense layer and at padding."""
    cfg = tiny_model_config(
        architecture="Glm4MoeForCausalLM",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        initializer_range=0.2,
        router="sigmoid",
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        dense_layers=(0,),
        num_layers=3,
        max_position_embeddings=512,
        scan_layers=False,
    )
    params = models.init_params(cfg, seed=1)
    spec = sampling.RolloutSpec(num_generations=2, max_new_tokens=8, temperature=0.0, stop_ids=(7,))
    paged = sampling.PagedSampler(cfg, slots=4, page_size=4, chunk_steps=3, prefill_chunk=8)
    session = paged.stream(params, 0, spec, width=16, rows=8)
    submit(session, paged, 0, PROMPTS, spec)
    submit(session, paged, 1, LATER, spec)
    done = []
    while session.busy:
        for key in session.run_chunk():
            out = session.output(key)[0]
            ids, mask = sampling.pad_prompts((PROMPTS, LATER)[key], 0)
            ref = sampling.Sampler(cfg).sample(params, ids, mask, spec)
            np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
            routes, expected = np.asarray(out.routes), np.asarray(ref.routes)
            assert routes.shape == expected.shape and routes.dtype == expected.dtype
            real = np.concatenate([np.asarray(out.prompt_mask), np.asarray(out.mask)], 1)
            fed = real.copy()
            fed[np.arange(len(real)), ids.shape[1] + np.asarray(out.lengths) - 1] = False
            np.testing.assert_array_equal(routes[fed], expected[fed])
            assert (routes[fed][:, 0] == -1).all() and (routes[fed][:, 1:] >= 0).all()
            assert (routes[~fed] == -1).all()
            done.append(key)
    assert done == [0, 1]
    assert any(k[0] == "prefill" and k[1][0] > 1 for k in paged.traces), paged.traces


def test_a_swap_records_each_tokens_version(tiny, paged):
    """Sampled, two steps queued, newer parameters swapped in between chunks (partial
    rollouts): rows in flight are recomputed by them and draw on; each token's log-prob
    equals the teacher-forced one under the parameters its recorded version names, some
    rows have tokens of both versions, a row's policy_version is the version that
    started it, and step 0's rows drawn wholly before the swap are `sample(step=0)`'s
    draw for draw (the stream's step 0 has sample's keys)."""
    cfg, p0, p1 = tiny
    spec = sampling.RolloutSpec(num_generations=3, max_new_tokens=12, temperature=0.9)
    session = paged.stream(p0, 0, spec, width=16, rows=12)
    submit(session, paged, 0, PROMPTS, spec)
    submit(session, paged, 1, LATER, spec)
    results = {}
    for _ in range(5):  # the first 5 rows end (12 tokens), the next 5 are in flight
        assert not session.run_chunk()
    session.swap(p1, 1)
    while session.busy:
        for k in session.run_chunk():
            results[k] = session.output(k)
    assert session.stats["swaps"] == 1 and set(results) == {0, 1}
    both = 0
    for out, versions in results.values():
        m = np.asarray(out.mask)
        assert np.all((versions >= 0) == m)
        ref = [teacher_forced_logprobs(cfg, p, out, 0.9) for p in (p0, p1)]
        want = np.where(versions == 1, ref[1], ref[0])
        assert np.abs(np.asarray(out.logprobs) - want)[m].max() <= 1e-5
        first = np.array([v[0] for v in versions])
        np.testing.assert_array_equal(np.asarray(out.policy_version), first)
        both += int(sum((v == 0).any() and (v == 1).any() for v in versions))
        assert np.all(np.diff(versions, axis=1)[m[:, 1:]] >= 0)  # versions only grow
    assert both > 0
    out, versions = results[0]
    old = np.all(versions <= 0, axis=1)
    assert old.sum() == 5
    ids, mask = sampling.pad_prompts(PROMPTS, 0)
    same_rows(out, paged.sample(p0, ids, mask, spec, step=0), old)


def test_without_partial_every_row_keeps_its_version(tiny, paged):
    """The rollout thread (rollout.partial=False, max_staleness 1) over a stand-in for the
    trainer's `Sampling`, a learner publishing a version per step: step 1, queued with
    step 0 before version 1 exists, is drawn wholly by version 0; every step within the
    bound; all of a row's tokens drawn by the version that started it, with teacher-forced
    log-probs under it; the steps' prompts in data order."""
    import contextlib
    import types

    from jaxrl_llm.rollout.thread import Handoff, RolloutThread

    cfg, p0, p1 = tiny
    spec = sampling.RolloutSpec(num_generations=3, max_new_tokens=12, temperature=0.9)
    batches = [PROMPTS, LATER, PROMPTS[::-1], LATER[::-1]]

    class Data:
        position = 0

        def __next__(self):
            ids, mask = sampling.pad_prompts(batches[self.position], 0)
            self.position += 1
            return types.SimpleNamespace(prompt_ids=ids, prompt_mask=mask, position=self.position)

        def state(self):
            return self.position

    s = types.SimpleNamespace(
        sampler=paged,
        spec=spec,
        data=Data(),
        scorer=lambda out, batch: None,
        guard=contextlib.nullcontext,
        compile_log=types.SimpleNamespace(
            program=lambda *a, **k: contextlib.nullcontext(types.SimpleNamespace())
        ),
        rounds=1,
        workers=None,
    )
    config = types.SimpleNamespace(
        rollout=types.SimpleNamespace(max_staleness=1, partial=False),
        train=types.SimpleNamespace(num_steps=4),
    )
    versions = [p0, p1, p0, p1]  # version v: versions[v]
    stream = Handoff(p0, 0, s.data.state())
    RolloutThread(s, config, 0, stream)
    items = []
    try:
        for t in range(4):
            if t:
                stream.publish(versions[t], t)
            items.append(stream.take(t))
            assert stream.consumed == t + 1
    finally:
        stream.close()
    assert items[1].version == 0
    for t, item in enumerate(items):
        out, v = item.out, item.token_versions
        rows, m = np.asarray(out.policy_version), np.asarray(out.mask)
        assert item.batch.position == t + 1 and t - 1 <= item.version <= t
        assert np.all(rows == item.version) and np.all(v[m] == item.version)
        want = teacher_forced_logprobs(cfg, versions[item.version], out, 0.9)
        assert np.abs(np.asarray(out.logprobs) - want)[m].max() <= 1e-5


# ---------------------------------------------------------------- through the trainer
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_run import make_model_dir

    return make_model_dir(str(tmp_path_factory.mktemp("tiny_model")))


def paged_config(model_dir, mode, steps):
    """The tiny GRPO run with the paged engine: 4 slots for 16 rows, chunks of 2 steps;
    split: training mesh fsdp 2 x tensor 2, rollout mesh the other 4 devices."""
    from tiny_run import signal_config

    c = signal_config(model_dir)
    c.rollout.engine, c.rollout.mode, c.train.num_steps = "paged", mode, steps
    c.rollout.paged.slots, c.rollout.paged.page_size = 4, 8
    c.rollout.paged.chunk_steps, c.rollout.paged.prefill_chunk = 2, 16
    c.train.log_every = 1
    if mode == "split":
        c.mesh.fsdp, c.mesh.tensor, c.mesh.rollout_devices = -1, 2, 4
    return c


class Recorder:
    """Wraps `RolloutThread`: its engine, the parameters of every version it was given (on
    the host) and every step's item as the learner takes it."""

    def __init__(self, monkeypatch):
        from jaxrl_llm.rollout.thread import Handoff, RolloutThread

        self.params, self.items = {}, []
        init, publish, take = RolloutThread.__init__, Handoff.publish, Handoff.take

        def on_init(this, s, config, start, handoff, **kw):
            params, version = handoff.newest()
            self.params[version], self.sampler = jax.device_get(params), s.sampler
            init(this, s, config, start, handoff, **kw)

        def on_publish(this, params, version):
            self.params[version] = jax.device_get(params)
            publish(this, params, version)

        def on_take(this, step):
            item = take(this, step)
            self.items.append((step, jax.device_get(item.out), item))
            return item

        monkeypatch.setattr(RolloutThread, "__init__", on_init)
        monkeypatch.setattr(Handoff, "publish", on_publish)
        monkeypatch.setattr(Handoff, "take", on_take)


def check_items(rec, c, bound):
    """Every taken step: rows started by a version within the bound, tokens drawn by
    versions from the row's to the step's, log-probs teacher-forced under the version
    each token records; the steps' prompts in a synchronous run's data order."""
    from test_async import data_order

    cfg = models.load_hf(c.model.path)[0]
    partial = 0
    for step, out, item in rec.items:
        rows = np.asarray(out.policy_version)
        assert np.all((step - bound <= rows) & (rows <= step)) and item.version == rows.min()
        v, m = item.token_versions, np.asarray(out.mask)
        assert np.all((v >= 0) == m)
        assert np.all(((v >= rows[:, None]) & (v <= step))[m])
        lp = np.asarray(out.logprobs)
        for version in np.unique(v[m]):
            want = teacher_forced_logprobs(
                cfg, rec.params[int(version)], out, c.rollout.temperature
            )
            here = m & (v == version)
            assert np.abs(lp - want)[here].max() <= 1e-5, (step, version)
        partial += int(sum(len(set(r[r >= 0])) > 1 for r in v))
    order = data_order(c, c.train.num_steps)
    assert [(t, item.batch.prompts[0]) for t, _, item in rec.items] == list(enumerate(order))
    return partial


def test_split_with_partial_rollouts_and_a_resume(model_dir, tmp_path, monkeypatch):
    """rollout.mode='split', max_staleness 1, partial rollouts; the engine holds a step
    that runs ahead of the learner until the learner publishes the next version, so
    rows are in flight at the swap; SIGTERM after step 0, then a resume: staleness within
    the bound, each token's version recorded and its log-prob the teacher-forced one
    under that version, rows switched version mid-generation, and the steps' prompts
    (across the resume) those of a synchronous run."""
    import collections
    import os
    import signal
    import threading

    from jaxrl_llm import train
    from jaxrl_llm.rollout.thread import Handoff
    from jaxrl_llm.sampling.paged_schedule import Session
    from jaxrl_llm.trainer.metrics import read_metrics
    from jaxrl_llm.trainer.run import Run

    chunk, step = Session.run_chunk, Run.step
    rec = Recorder(monkeypatch)
    publish, close = Handoff.publish, Handoff.close
    published, held = collections.defaultdict(threading.Event), set()

    def on_publish(this, params, version):
        publish(this, params, version)
        published[version].set()

    def on_close(this):
        for event in list(published.values()):
            event.set()
        close(this)

    def holding_chunk(self):
        # Step s alone in the engine, ahead of the learner: its first chunk waits for
        # version s, so the swap finds its rows in flight.
        first = min(self.requests, default=0)
        if first >= 1 and self.version < first and first not in held:
            held.add(first)
            published[first].wait(timeout=60)
        return chunk(self)

    def step_then_sigterm(self, t):
        out = step(self, t)
        if t == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(Session, "run_chunk", holding_chunk)
    monkeypatch.setattr(Handoff, "publish", on_publish)
    monkeypatch.setattr(Handoff, "close", on_close)
    monkeypatch.setattr(Run, "step", step_then_sigterm)
    c = paged_config(model_dir, "split", 3)
    c.rollout.max_staleness, c.rollout.partial = 1, True
    train.train(c, str(tmp_path / "run"))
    assert [t for t, _, _ in rec.items] == [0]
    monkeypatch.setattr(Run, "step", step)
    train.train(c, str(tmp_path / "run"))  # resumes at step 1
    assert check_items(rec, c, 1) > 0
    # Step 0's rows drawn wholly by the initial parameters are `sample(step=0)`'s.
    from jaxrl_llm import config as config_lib
    from jaxrl_llm import data
    from jaxrl_llm.models import builtin

    tokenizer = builtin.load_tokenizer(builtin.resolve(c.model.path))
    batch = next(data.make_iterator(c.data, tokenizer, c.rollout.batch_size))
    spec = config_lib.rollout_spec(c, tokenizer)
    ref = rec.sampler.sample(rec.params[0], batch.prompt_ids, batch.prompt_mask, spec, 0)
    _, first, item = rec.items[0]
    old = np.all(item.token_versions <= 0, axis=1)
    assert old.any()
    same_rows(first, jax.device_get(ref), old)
    logged = [m for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if "step" in m]
    assert [m["step"] for m in logged] == [1, 2, 3]
    assert max(m["rollout/staleness_max"] for m in logged) <= 1.0
    assert any(m["rollout/partial_frac"] > 0 for m in logged)


def test_overlap_runs_the_stream_one_version_behind(model_dir):
    """rollout.mode='overlap' with the paged engine is the split stream's thread on the
    training mesh, bounded to one version, on its own copy of the parameters (the update
    donates the step's); the config check no longer refuses it."""
    from jaxrl_llm.config import algo_config, checks_rollout
    from jaxrl_llm.rollout.modes import make_source
    from jaxrl_llm.rollout.sources import SampledAhead
    from jaxrl_llm.rollout.thread import Threaded

    c = paged_config(model_dir, "overlap", 2)
    checks_rollout.check_engine(c, 1)
    paged = types.SimpleNamespace(sampler=sampling.PagedSampler(tiny_model_config()))
    source = make_source(c, paged, algo_config(c))
    assert type(source) is Threaded and source.max_staleness == 1 and source.copy
    static = types.SimpleNamespace(sampler=sampling.Sampler(tiny_model_config()))
    c.rollout.engine = "static"
    assert type(make_source(c, static, algo_config(c))) is SampledAhead
