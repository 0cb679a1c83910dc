"""Model-FLOP accounting (`jaxrl_llm.trainer.perf`) against a count made by walking the matmuls."""

import numpy as np
import pytest
from tiny_run import tiny_model_config

from jaxrl_llm.rl import update as U
from jaxrl_llm.rl.algos import preset
from jaxrl_llm.sampling import RolloutSpec
from jaxrl_llm.startup import peak
from jaxrl_llm.trainer import perf


def count_forward(cfg, context_lens, projected: int) -> float:
    """FLOPs of a forward over tokens whose attention contexts are `context_lens`, walking
    each matmul: [1, in] x [in, out] = 2 * in * out; scores and values 2 * head_dim each
    per key per head; the output projection at `projected` tokens."""
    d, h = cfg.hidden_size, cfg.head_dim
    shapes = [
        (d, cfg.num_heads * h),  # q
        (d, cfg.num_kv_heads * h),  # k
        (d, cfg.num_kv_heads * h),  # v
        (cfg.num_heads * h, d),  # o
        (d, cfg.intermediate_size),  # gate
        (d, cfg.intermediate_size),  # up
        (cfg.intermediate_size, d),  # down
    ]
    total = 0.0
    for ctx in context_lens:
        for _ in range(cfg.num_layers):
            total += sum(2 * a * b for a, b in shapes)
            total += cfg.num_heads * ctx * 2 * h * 2  # q.k and p.v
    return total + projected * 2 * d * cfg.vocab_size


def test_step_flops_equal_a_walk_over_every_token():
    cfg = tiny_model_config()
    P, T, prompts, G = 5, 4, 3, 2
    rows = prompts * G
    got = perf.step_flops(
        cfg,
        rows=rows,
        prompts=prompts,
        prompt_len=P,
        new_tokens=T,
        reference=True,
        update_forwards=3,
    )
    prefill = count_forward(cfg, range(1, P + 1), 1)
    # Decode: T - 1 forwards (the first token comes from the prefill), at contexts P+1 ...
    decode = count_forward(cfg, range(P + 1, P + T), T - 1)
    # A sequence forward reads P + T - 1 tokens (the last completion token is never an
    # input) and projects the T completion positions.
    seq = count_forward(cfg, range(1, P + T), T)
    # Attention contexts are counted as their mean, so compare with a relative tolerance
    # of the (exactly linear) sums.
    np.testing.assert_allclose(got["sample"], prompts * prefill + rows * decode, rtol=1e-12)
    np.testing.assert_allclose(got["reference"], rows * seq, rtol=1e-12)
    np.testing.assert_allclose(got["update"], 3 * rows * seq, rtol=1e-12)
    no_ref = perf.step_flops(
        cfg,
        rows=rows,
        prompts=prompts,
        prompt_len=P,
        new_tokens=T,
        reference=False,
        update_forwards=3,
    )
    assert no_ref["reference"] == 0.0
    # A reference that reads each prompt once: the prompt per group (nothing projected),
    # then every row's completion inputs against it (contexts P + 1 ...), T projected.
    shared = perf.step_flops(
        cfg,
        rows=rows,
        prompts=prompts,
        prompt_len=P,
        new_tokens=T,
        reference=True,
        update_forwards=3,
        reference_shares_prompts=True,
    )
    expected = prompts * count_forward(cfg, range(1, P + 1), 0) + rows * count_forward(
        cfg, range(P + 1, P + T), T
    )
    np.testing.assert_allclose(shared["reference"], expected, rtol=1e-12)
    assert shared["update"] == got["update"] and shared["sample"] == got["sample"]
    # An update with 4 forwards (pi_old + forward and backward), 3 of them shared.
    mixed = perf.step_flops(
        cfg,
        rows=rows,
        prompts=prompts,
        prompt_len=P,
        new_tokens=T,
        reference=True,
        update_forwards=4,
        update_shared_forwards=3,
    )
    np.testing.assert_allclose(mixed["update"], rows * seq + 3 * expected, rtol=1e-12)


def test_untied_and_tied_models_both_count_the_output_projection():
    tied = tiny_model_config(tie_word_embeddings=True)
    untied = tiny_model_config(tie_word_embeddings=False)
    one = dict(positions=1, context=1, unembedded=1)
    assert perf.forward_flops(tied, **one) == perf.forward_flops(untied, **one)
    assert perf.forward_flops(tied, 1, 1, 1) - perf.forward_flops(tied, 1, 1, 0) == (
        2 * tied.vocab_size * tied.hidden_size
    )


@pytest.mark.parametrize(
    "iterations,mini,kl_in_reward,expected",
    [(1, 1, False, 3), (2, 1, False, 7), (1, 2, False, 4), (1, 1, True, 4)],
)
def test_update_forward_passes(iterations, mini, kl_in_reward, expected):
    """3 per forward + backward pass, +1 when pi_old is recomputed (off-policy passes,
    several mini-batches, or a KL folded into the reward)."""
    algo = preset("grpo", num_iterations=iterations, beta=0.1, kl_in_reward=kl_in_reward)
    opt = U.make_optimizer(learning_rate=1e-3)
    spec = RolloutSpec(num_generations=2)
    fn = U.make_update_fn(tiny_model_config(), algo, opt, spec, mini_batches=mini)
    assert fn.forward_passes == expected


def test_kept_matmul_peak_is_measured_once_and_read_back(tmp_path, monkeypatch):
    measured = []

    def measure(dtype, n):
        measured.append((dtype, n))
        return 1e9 * len(measured)

    monkeypatch.setattr(peak, "matmul_peak", measure)
    kept_matmul_peak = peak.kept_matmul_peak
    directory = str(tmp_path / "cache")
    assert kept_matmul_peak("float32", 64, directory) == 1e9
    assert kept_matmul_peak("float32", 64, directory) == 1e9  # read back, not measured
    assert kept_matmul_peak("bfloat16", 64, directory) == 2e9  # another key
    assert measured == [("float32", 64), ("bfloat16", 64)]
    with open(tmp_path / "cache" / "matmul_peak.json", "w") as f:
        f.write("{not json")  # damaged: measured again and the file replaced
    assert kept_matmul_peak("float32", 64, directory) == 3e9
    assert kept_matmul_peak("float32", 64, directory) == 3e9
    assert len(measured) == 3
