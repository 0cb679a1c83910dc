"""The paged engine as a streaming rollout source: a session kept across steps
(`PagedSampler.stream`, `paged_schedule.Session`) and the trainer's `PagedStream` in
overlap and split."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import tiny_model_config

from jaxrl_llm import models, sampling

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [11], [40, 41, 42, 43, 44]]
LATER = [[9, 8, 7, 6, 5, 4, 3, 2, 1, 20, 21, 22, 23], [33, 34], [17, 18, 19], [2, 4, 6, 8]]


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_model_config(max_position_embeddings=512)
    return cfg, models.init_params(cfg, seed=3), models.init_params(cfg, seed=4)


def engine(cfg):
    return sampling.PagedSampler(cfg, slots=5, page_size=4, chunk_steps=3, prefill_chunk=8)


def submit(session, paged, key, prompts, spec):
    ids, mask = paged.bucketed(*sampling.pad_prompts(prompts, 0))
    rows = ids.shape[0] * spec.num_generations
    session.submit(key, ids, mask, np.full(rows, spec.max_new_tokens), key_base=key * rows)


def teacher_forced(cfg, params, out, temperature):
    ids = jnp.concatenate([out.prompt_tokens, out.tokens], axis=1)
    mask = jnp.concatenate([out.prompt_mask, out.mask], axis=1)
    logits = models.logits(cfg, params, ids, mask)
    P = out.prompt_tokens.shape[1]
    logp = jax.nn.log_softmax(logits[:, P - 1 : -1] / temperature, axis=-1)
    return np.take_along_axis(np.asarray(logp), np.asarray(out.tokens)[..., None], -1)[..., 0]


def test_a_session_across_steps_equals_one_call_per_step(tiny):
    """Two steps' prompts queued in one session (step 1's rows take the slots step 0's
    short rows leave): at temperature 0 each step's rows equal the static sampler's, and
    sampled, step 0's rows equal `sample(step=0)`'s draw for draw (the same keys)."""
    cfg, params, _ = tiny
    spec = sampling.RolloutSpec(num_generations=3, max_new_tokens=14, temperature=0.0,
                                stop_ids=(7, 16))  # fmt: skip
    for temperature in (0.0, 1.0):
        spec = spec.replace(temperature=temperature)
        paged = engine(cfg)
        session = paged.stream(params, 2, spec, width=16, rows=12)
        submit(session, paged, 0, PROMPTS, spec)
        submit(session, paged, 1, LATER, spec)
        done, mixed = [], False
        while session.busy:
            done += session.run_chunk()
            steps = {session.owner[s].item.req for s in session.order}
            mixed |= steps == {0, 1}  # rows of both steps decode in one chunk
        assert done == [0, 1] and mixed
        outs = [session.output(k)[0] for k in done]
        assert all(np.all(np.asarray(o.policy_version) == 2) for o in outs)
        for prompts, out, step in zip((PROMPTS, LATER), outs, (0, 1), strict=True):
            ids, mask = sampling.pad_prompts(prompts, 0)
            if temperature == 0:
                ref = sampling.Sampler(cfg).sample(params, ids, mask, spec, step, version=2)
            elif step == 0:
                ref = engine(cfg).sample(params, ids, mask, spec, step=0, version=2)
            else:
                continue
            for name in ("tokens", "lengths", "finish", "prompt_tokens"):
                got, want = np.asarray(getattr(out, name)), np.asarray(getattr(ref, name))
                np.testing.assert_array_equal(got, want, err_msg=name)
            assert np.abs(np.asarray(out.logprobs) - np.asarray(ref.logprobs)).max() <= 1e-5


def test_a_swap_records_each_tokens_version(tiny):
    """Newer parameters swapped in between chunks (partial rollouts): rows in flight are
    recomputed by them and draw on; each token's log-prob equals the teacher-forced one
    under the parameters its recorded version names, rows have tokens of both versions,
    and a row's policy_version is the version that started it."""
    cfg, p0, p1 = tiny
    spec = sampling.RolloutSpec(num_generations=3, max_new_tokens=12, temperature=0.9)
    paged = engine(cfg)
    session = paged.stream(p0, 0, spec, width=16, rows=12)
    submit(session, paged, 0, PROMPTS, spec)
    submit(session, paged, 1, LATER, spec)
    results = {}
    for k in session.run_chunk() + session.run_chunk():
        results[k] = session.output(k)
    session.swap(p1, 1)
    while session.busy:
        for k in session.run_chunk():
            results[k] = session.output(k)
    assert session.stats["swaps"] == 1
    both = 0
    for out, versions in results.values():
        m = np.asarray(out.mask)
        assert np.all((versions >= 0) == m)
        ref = [teacher_forced(cfg, p, out, 0.9) for p in (p0, p1)]
        want = np.where(versions == 1, ref[1], ref[0])
        assert np.abs(np.asarray(out.logprobs) - want)[m].max() <= 1e-5
        started = np.asarray(out.policy_version)
        first = np.array([v[0] for v in versions])
        np.testing.assert_array_equal(started, first)  # the first token's version
        both += int(sum((v == 0).any() and (v == 1).any() for v in versions))
        assert np.all(np.diff(versions, axis=1)[m[:, 1:]] >= 0)  # versions only grow
    assert both > 0 and set(results) == {0, 1}
