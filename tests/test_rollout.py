"""The host side of a step: scoring sampled completions (rewards, DAPO's overlong penalty
on the sampled token counts) and DAPO's dynamic sampling merge, against plain loops."""

import types

import jax
import numpy as np
import pytest
from tiny_run import TOKENIZER, tiny_model_config

from jaxrl_llm import parallel, sampling, verifiers
from jaxrl_llm.rollout import scoring

G, T = 2, 6


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def pool():
    with verifiers.VerifierPool(1, timeout_s=10.0) as p:
        yield p


def fake_output(tokenizer, completions, prompt_width=4, stop=None):
    """A SampleOutput holding `completions` (strings, one per row) as sampled tokens."""
    n = len(completions)
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    tokens = np.zeros((n, T), np.int32)
    mask = np.zeros((n, T), bool)
    for i, row in enumerate(ids):
        tokens[i, : len(row)], mask[i, : len(row)] = row, True
    lengths = mask.sum(1).astype(np.int32)
    stopped = np.zeros(n, bool) if stop is None else np.asarray(stop)
    finish = np.where(stopped, sampling.FINISH_STOP, sampling.FINISH_LENGTH).astype(np.int32)
    return sampling.SampleOutput(
        tokens=jax.numpy.asarray(tokens),
        mask=jax.numpy.asarray(mask),
        loss_mask=jax.numpy.asarray(mask),
        logprobs=jax.numpy.zeros((n, T)),
        lengths=jax.numpy.asarray(lengths),
        finish=jax.numpy.asarray(finish),
        prompt_tokens=jax.numpy.ones((n, prompt_width), np.int32),
        prompt_mask=jax.numpy.ones((n, prompt_width), bool),
        policy_version=jax.numpy.zeros(n, np.int32),
        num_generations=G,
    )


def fake_batch(answers, prompt_lengths):
    return types.SimpleNamespace(
        examples=[{"answer": str(a)} for a in answers],
        prompts=[f"p{i}" for i in range(len(answers))],
        prompt_mask=np.arange(8)[None] >= 8 - np.asarray(prompt_lengths)[:, None],
    )


def test_scorer_adds_the_overlong_penalty_of_the_sampled_token_counts(tokenizer, pool):
    """reward = gsm8k score + r_len(number of sampled tokens): counted in tokens, as the
    sampler counted them (DAPO eq. 13, L_max = T = 6, L_c = 3)."""
    completions = ["12", "1234", "12345", "7", "123456", "55"]  # 2 to 6 tokens
    out = fake_output(tokenizer, completions)
    batch = fake_batch([12, 7, 55], [3, 5, 8])
    spec = sampling.RolloutSpec(G, T, stop_ids=())
    scorer = scoring.Scorer(
        tokenizer, pool, verifiers.parse_specs({"gsm8k": 1.0}), spec, overlong_buffer=3
    )
    scored = scorer(out, batch)
    lengths = np.array([len(c) for c in completions])  # one token per digit
    np.testing.assert_array_equal(scored.lengths, lengths)
    correct = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]  # rows share their prompt's answer: 12, 7, 55
    penalty = [0.0 if n <= 3 else ((3 - n) / 3 if n <= 6 else -1.0) for n in lengths]
    np.testing.assert_allclose(scored.rewards, np.add(correct, penalty), atol=1e-6)
    assert scored.metrics["reward/overlong"] == pytest.approx(np.mean(penalty))
    assert scored.metrics["reward/gsm8k"] == pytest.approx(np.mean(correct))
    assert scored.metrics["rollout/length_max"] == 6.0
    assert scored.completions == completions
    assert scored.prompts == ["p0", "p0", "p1", "p1", "p2", "p2"]
    np.testing.assert_array_equal(scored.prompt_lengths, [3, 3, 5, 5, 8, 8])
    plain = scoring.Scorer(tokenizer, pool, scorer.specs, spec)(out, batch)
    np.testing.assert_allclose(plain.rewards, correct)
    assert "reward/overlong" not in plain.metrics


def test_merge_keeps_the_first_mixed_groups_of_all_rounds(tokenizer):
    """DAPO's dynamic sampling: the step's B groups are the mixed-reward groups in the
    order they were sampled, then degenerate ones to fill; rows, texts, rewards and
    lengths stay aligned, and prompts of different buckets are left-padded to one."""
    rng = np.random.default_rng(0)
    parts, rows = [], []
    patterns = [[1, 1, 0, 1, 1, 1], [0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 1, 1]]  # per row
    for p, rewards in enumerate(patterns):
        completions = [str(rng.integers(1, 99)) for _ in rewards]
        out = fake_output(tokenizer, completions, prompt_width=4 + 2 * p)
        scored = scoring.Scored(
            rewards=np.asarray(rewards, np.float32),
            metrics={"reward/x": float(p)},
            completions=completions,
            prompts=[f"{p}:{i // G}" for i in range(6)],
            examples=[{} for _ in range(6)],
            lengths=np.asarray(out.lengths),
            prompt_lengths=np.full(6, 4 + 2 * p),
        )
        parts.append((out, scored))
        rows += [(p, i) for i in range(6)]
    out, scored = scoring.merge_mixed_groups(parts, G, 3)
    # Naive: scan the groups in order, mixed first, then the degenerate ones.
    groups = [rows[i : i + G] for i in range(0, len(rows), G)]
    rewards = [[patterns[p][i] for p, i in g] for g in groups]
    order = [k for k, r in enumerate(rewards) if len(set(r)) > 1]
    order += [k for k, r in enumerate(rewards) if len(set(r)) == 1]
    picked = [rows[k * G + j] for k in order[:3] for j in range(G)]
    assert scored.rewards.tolist() == [patterns[p][i] for p, i in picked]
    assert scored.completions == [parts[p][1].completions[i] for p, i in picked]
    assert scored.prompts == [parts[p][1].prompts[i] for p, i in picked]
    assert scored.metrics["reward/x"] == pytest.approx(1.0)
    tokens = np.asarray(out.tokens)
    for r, (p, i) in enumerate(picked):
        np.testing.assert_array_equal(tokens[r], np.asarray(parts[p][0].tokens)[i])
        assert int(np.asarray(out.prompt_mask)[r].sum()) == 4 + 2 * p
    assert out.prompt_tokens.shape == (6, 8) and out.num_generations == G
    assert scoring.mixed_groups(scored, G) == 3
    # On a mesh the merged rows keep the sampler's layout, so the reference and the
    # update compiled for a rollout of these shapes serve them (no second compile).
    mesh = parallel.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    rows_on = sampling.Sampler(tiny_model_config(), mesh).row_sharding
    on_mesh = [(jax.device_put(o, rows_on), s) for o, s in parts]
    sharded, _ = scoring.merge_mixed_groups(on_mesh, G, 3, mesh)
    for name, x in vars(sharded).items():
        if isinstance(x, jax.Array):
            assert x.sharding.is_equivalent_to(rows_on, x.ndim), name
            np.testing.assert_array_equal(np.asarray(x), np.asarray(getattr(out, name)), name)
