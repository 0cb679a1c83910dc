"""The paged engine (`sampling.PagedSampler`) against the static sampler, teacher-forced
log-probs and exact probabilities."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import teacher_forced_logprobs, tiny_model_config

from jaxrl_llm import models, parallel, sampling

PROMPTS = [
    [5, 6, 7],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    [11],
    [40, 41, 42, 43, 44],
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 20, 21, 22, 23, 24, 25, 26, 27, 28],
    [33, 34],
]


def paged_greedy_equals_static(cfg, params):
    """Asserts the paged engine (4 slots for the 6 prompts x 2 rows, 14 pages of 4 so rows
    are preempted, prefill in chunks of 8) gives the static sampler's greedy tokens ->
    (a factory of that engine, its other arguments default, the padded prompts, mask)."""
    ids, mask = sampling.pad_prompts(PROMPTS, 0)
    engine = functools.partial(
        sampling.PagedSampler, cfg, slots=4, page_size=4, chunk_steps=3, prefill_chunk=8
    )
    greedy = sampling.RolloutSpec(num_generations=2, max_new_tokens=12, temperature=0.0)
    ref = sampling.Sampler(cfg).sample(params, ids, mask, greedy)
    paged = engine(pages=14)
    out = paged.sample(params, ids, mask, greedy)
    assert paged.stats["preempted"] > 0
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    return engine, ids, mask


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_model_config(max_position_embeddings=512)
    return cfg, models.init_params(cfg, seed=3)


def test_greedy_equals_the_static_sampler(tiny):
    """Temperature 0: each row's tokens, lengths and finish reasons equal the static
    sampler's, and its log-probs within 1e-5, however rows enter, leave, share prompt pages
    or are preempted and recomputed: every row in a slot with room to spare (each prompt
    prefilled once for its G rows), then 5 slots for 18 rows over a pool that forces
    preemptions."""
    cfg, params = tiny
    ids, mask = sampling.pad_prompts(PROMPTS, 0)
    spec = sampling.RolloutSpec(
        num_generations=3, max_new_tokens=20, temperature=0.0, stop_ids=(7, 16)
    )
    ref = sampling.Sampler(cfg).sample(params, ids, mask, spec, version=4)
    lengths = np.asarray(ref.lengths)
    assert len(set(lengths.tolist())) > 2, lengths  # rows end at different steps
    for slots, pages in ((0, 0), (5, 16)):
        paged = sampling.PagedSampler(
            cfg, slots=slots, pages=pages, page_size=4, chunk_steps=3, prefill_chunk=8
        )
        out = paged.sample(params, ids, mask, spec, version=4)
        for name in (
            "tokens",
            "mask",
            "loss_mask",
            "lengths",
            "finish",
            "prompt_tokens",
            "prompt_mask",
            "policy_version",
        ):
            np.testing.assert_array_equal(
                np.asarray(getattr(out, name)), np.asarray(getattr(ref, name)), err_msg=name
            )
        assert np.abs(np.asarray(out.logprobs) - np.asarray(ref.logprobs)).max() <= 1e-5
        if slots == 0:
            assert paged.stats["prefills"] == len(PROMPTS)  # one per prompt, for G rows
            assert paged.stats["preempted"] == 0
        else:
            assert paged.stats["preempted"] > 0
            assert paged.stats["peak_pages"] <= pages - 1


@pytest.mark.parametrize(
    "sharded", [pytest.param(False, marks=pytest.mark.slow), True], ids=["one_device", "mesh"]
)
def test_logprobs_equal_teacher_forced(tiny, sharded):
    """Sampled rows (temperature 0.8, top-k 20, 6 slots for 12 rows, per-row budgets):
    the behaviour log-probs equal the trainer's teacher-forced ones within 1e-5, on one
    device and with the parameters sharded over the 8-device mesh (there with the layers
    unrolled: their parameters sliced once per session, `PagedSampler.weights`)."""
    cfg, params = tiny
    mesh = None
    if sharded:
        cfg = dataclasses.replace(cfg, scan_layers=False)
        mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
        params = jax.device_put(params, models.param_shardings(cfg, mesh))
    ids, mask = sampling.pad_prompts(PROMPTS[:4], 0)
    spec = sampling.RolloutSpec(
        num_generations=3, max_new_tokens=16, temperature=0.8, top_k=20, stop_ids=(7,)
    )
    budgets = np.array([16, 3, 9, 16, 1, 5, 12, 16, 2, 7, 16, 4])
    paged = sampling.PagedSampler(cfg, mesh, slots=6, page_size=4, chunk_steps=4, prefill_chunk=8)
    out = paged.sample(params, ids, mask, spec, step=2, budgets=budgets)
    assert np.all(np.asarray(out.lengths) <= budgets)
    ref = teacher_forced_logprobs(cfg, params, out, 0.8)
    m = np.asarray(out.mask)
    assert m.sum() > 40
    assert np.abs(np.asarray(out.logprobs) - ref)[m].max() <= 1e-5
    assert np.all(np.asarray(out.logprobs)[~m] == 0)
    if sharded:
        assert out.tokens.sharding.is_equivalent_to(paged.row_sharding, 2)


def test_moe_routes_equal_the_static_samplers():
    """A tiny Qwen3-MoE (unrolled layers) at temperature 0, 4 slots for 12 rows over a
    pool that forces preemptions: the engine's routes ([N, P + T, L, k]) equal the static
    sampler's at every real token but each row's last (the prompt's from its one shared
    prefill, a drawn token's from the step that feeds it), and are -1 at padding and at
    the last drawn token, which the engine never feeds (the static sampler feeds a stop
    token when other rows of its batch go on; its route changes no log-prob the trainer
    scores)."""
    cfg = tiny_model_config(
        architecture="Qwen3MoeForCausalLM",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        initializer_range=0.2,
        max_position_embeddings=512,
        scan_layers=False,  # the engine's unrolled path (layers sliced once per session)
    )
    params = models.init_params(cfg, seed=1)
    ids, mask = sampling.pad_prompts(PROMPTS, 0)
    spec = sampling.RolloutSpec(
        num_generations=2, max_new_tokens=12, temperature=0.0, stop_ids=(7,)
    )
    ref = sampling.Sampler(cfg).sample(params, ids, mask, spec)
    paged = sampling.PagedSampler(
        cfg, slots=4, pages=14, page_size=4, chunk_steps=3, prefill_chunk=8
    )
    out = paged.sample(params, ids, mask, spec)
    assert paged.stats["preempted"] > 0
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    routes, expected = np.asarray(out.routes), np.asarray(ref.routes)
    assert routes.shape == expected.shape and routes.dtype == expected.dtype
    real = np.concatenate([np.asarray(out.prompt_mask), np.asarray(out.mask)], axis=1)
    last = np.zeros_like(real)
    last[np.arange(len(real)), ids.shape[1] + np.asarray(out.lengths) - 1] = True
    fed = real & ~last
    np.testing.assert_array_equal(routes[fed], expected[fed])
    assert (routes[fed] >= 0).all() and (routes[~fed] == -1).all()


def chi2_critical(df, z=3.09):
    """Wilson-Hilferty approximation of the chi-square quantile (z=3.09: 0.999)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_pairs_follow_the_model():
    """The first two tokens of 2000 rows of one prompt (2000 draws through 40 slots, the
    prompt's pages shared by all of them) against the model's exact probabilities
    p(t1) p(t2 | t1) at temperature 0.5, by a chi-square test over the likely pairs (the
    rest pooled); the same test rejects the probabilities at temperature 0.7. The model's
    logits are sharper than the fixture's, so that many pairs are likely."""
    cfg = tiny_model_config(max_position_embeddings=512, initializer_range=0.1)
    params = models.init_params(cfg, seed=3)
    prompt = [3, 14, 15, 9, 26]
    n, temperature = 2000, 0.5
    ids, mask = sampling.pad_prompts([prompt], 0)
    spec = sampling.RolloutSpec(num_generations=n, max_new_tokens=2, temperature=temperature)
    paged = sampling.PagedSampler(cfg, slots=40, page_size=4, chunk_steps=2, prefill_chunk=8)
    out = paged.sample(params, ids, mask, spec, step=1)
    pairs = np.asarray(out.tokens)
    assert paged.stats["prefills"] == 1

    def exact(t):
        V = cfg.vocab_size
        first = jax.nn.log_softmax(models.logits(cfg, params, jnp.array([prompt]))[0, -1] / t)
        seqs = jnp.array([prompt + [a] for a in range(V)])
        second = jax.nn.log_softmax(models.logits(cfg, params, seqs)[:, -1] / t, axis=-1)
        return np.exp(np.asarray(first)[:, None] + np.asarray(second))  # [V, V]

    counts = np.zeros((cfg.vocab_size, cfg.vocab_size))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)

    def chi2(probs):
        e = n * probs.ravel()
        big = e >= 5
        obs = np.append(counts.ravel()[big], counts.ravel()[~big].sum())
        exp = np.append(e[big], e[~big].sum())
        return ((obs - exp) ** 2 / exp).sum(), big.sum()

    stat, df = chi2(exact(temperature))
    assert df > 20, df
    assert stat < chi2_critical(df), (stat, df)
    wrong, _ = chi2(exact(0.7))
    assert wrong > chi2_critical(df), wrong


def test_bad_arguments(tiny):
    cfg, params = tiny
    with pytest.raises(ValueError, match="multiple of page_size"):
        sampling.PagedSampler(cfg, page_size=16, prefill_chunk=24)
    ids, mask = sampling.pad_prompts(PROMPTS[:2], 0)
    spec = sampling.RolloutSpec(max_new_tokens=8)
    with pytest.raises(ValueError, match="must hold one whole sequence"):
        sampling.PagedSampler(cfg, pages=3, page_size=4, prefill_chunk=8).sample(
            params, ids, mask, spec
        )
    with pytest.raises(ValueError, match="budgets"):
        sampling.PagedSampler(cfg).sample(params, ids, mask, spec, budgets=[9, 1])


def test_trainer_with_the_paged_engine(tmp_path):
    """rollout.engine='paged' through the trainer (the tiny model, 2 GRPO steps on the
    8-device mesh, 4 slots for 16 rows), and the engine that config builds gives the
    static one's rollouts of the run's first batch at temperature 0."""
    from tiny_run import make_model_dir, signal_config

    from jaxrl_llm import config as config_lib
    from jaxrl_llm import data, train
    from jaxrl_llm.models import builtin
    from jaxrl_llm.rollout import sources
    from jaxrl_llm.trainer.metrics import read_metrics

    c = signal_config(make_model_dir(str(tmp_path / "model")))
    c.rollout.engine, c.rollout.paged.slots, c.rollout.paged.page_size = "paged", 4, 8
    c.rollout.paged.prefill_chunk = 16
    last = train.train(c, str(tmp_path / "run"))
    assert [m["step"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert np.isfinite(last["loss/total"]) and last["optim/nonfinite"] == 0.0

    tokenizer = builtin.load_tokenizer(builtin.resolve(c.model.path))
    batch = next(data.make_iterator(c.data, tokenizer, c.rollout.batch_size))
    cfg, params = models.load_hf(c.model.path)
    spec = config_lib.rollout_spec(c, tokenizer).replace(temperature=0.0)
    c.rollout.bucket_steps = 4  # (None: the run picks it at start-up)
    outs = []
    for engine in ("static", "paged"):
        c.rollout.engine = engine
        sampler = sources.make_sampler(c, cfg, None, data.prompts.pad_id(tokenizer))
        outs.append(sampler.sample(params, batch.prompt_ids, batch.prompt_mask, spec))
    assert isinstance(sampler, sampling.PagedSampler)
    for name in ("tokens", "mask", "lengths", "finish"):
        np.testing.assert_array_equal(
            np.asarray(getattr(outs[0], name)), np.asarray(getattr(outs[1], name)), err_msg=name
        )
    assert np.abs(np.asarray(outs[0].logprobs) - np.asarray(outs[1].logprobs)).max() <= 1e-5


def test_config_refuses_what_the_paged_engine_does_not_do(tmp_path):
    from tiny_run import tiny_config

    from jaxrl_llm import config as config_lib
    from jaxrl_llm.config import checks_rollout

    c = tiny_config(str(tmp_path))
    c.rollout.engine, c.rollout.mode = "paged", "split"
    c.env.name = "calculator"
    checks_rollout.check_engine(c, 1)  # environments in every mode
    c.rollout.partial = True
    checks_rollout.check_engine(c, 1)  # partial rollouts with environments: `TurnSession.swap`
    c.env.name, c.agent.entry = "", "agent.py:run"
    checks_rollout.check_engine(c, 1)  # the gateway's partial rollouts: `TurnSession.swap` too
    c.rollout.partial = False
    checks_rollout.check_engine(c, 1)  # the gateway in every mode
    c.agent.entry = ""
    c.rollout.partial = True
    checks_rollout.check_engine(c, 1)  # single-turn partial rollouts: the stream recomputes
    c.rollout.partial, c.rollout.paged.prefill_chunk = False, 20
    with pytest.raises(config_lib.ConfigError, match="multiple of rollout.paged.page_size"):
        checks_rollout.check_engine(c, 1)
    c.rollout.paged.prefill_chunk, c.rollout.paged.attention = 64, "splash"
    with pytest.raises(config_lib.ConfigError, match="rollout.paged.attention='splash'"):
        checks_rollout.check_engine(c, 1)
    c.rollout.paged.attention = "auto"
    c.rollout.engine = "vllm"
    with pytest.raises(config_lib.ConfigError, match="rollout.engine='vllm'"):
        checks_rollout.check_engine(c, 1)


def test_the_automatic_pool_holds_one_whole_sequence(tiny):
    """rollout.paged.pages=0 for 2 prompts x 2 rows with prefill chunks longer than the
    rows' tokens: the pool is at least the one whole sequence a session needs (it was
    below it: `pages=7: the pool must hold one whole sequence`), and the greedy rows
    equal the static sampler's."""
    cfg, params = tiny
    ids, mask = sampling.pad_prompts(PROMPTS[:2], 0)
    spec = sampling.RolloutSpec(num_generations=2, max_new_tokens=5, temperature=0.0)
    ref = sampling.Sampler(cfg).sample(params, ids, mask, spec)
    paged = sampling.PagedSampler(cfg, page_size=16, chunk_steps=4, prefill_chunk=64)
    out = paged.sample(params, ids, mask, spec)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))


def test_a_page_pool_past_the_machines_memory_is_one_line(tiny):
    """rollout.paged.pages=1e9 is refused before anything is allocated, naming the key,
    the pool's size (numpy reference: pages x page_size x layers x K,V x kv heads x
    head_dim x 4 bytes) and the fix; the automatic pool is not checked."""
    from tiny_run import tiny_config

    from jaxrl_llm import config as config_lib
    from jaxrl_llm.config import checks_model

    cfg, _ = tiny
    c = tiny_config("unused")
    c.rollout.engine, c.rollout.paged.pages, c.rollout.paged.page_size = "paged", 10**9, 16
    size = np.prod(
        [10**9, 16, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim, 4], dtype=np.float64
    )
    with pytest.raises(config_lib.ConfigError) as err:
        checks_model.check_page_pool(c, cfg)
    assert str(err.value).startswith(
        f"rollout.paged.pages=1000000000: the page pool's KV cache is {size / 2**30:,.1f} GiB"
    )
    assert str(err.value).endswith("lower rollout.paged.pages (0 = automatic)")
    c.rollout.paged.pages = 0
    checks_model.check_page_pool(c, cfg)


def test_device_out_of_memory_in_the_page_pool_names_rollout_paged_pages(tiny, monkeypatch):
    """XLA's RESOURCE_EXHAUSTED while a set pool is allocated, or while a decode chunk runs
    over an automatic one, is one line naming rollout.paged.pages and the pool's size
    (numpy reference: pages x page_size x layers x K,V x kv heads x head_dim x 4 bytes),
    not the update's batch size and remat."""
    from jaxrl_llm import errors

    cfg, params = tiny
    ids, mask = sampling.pad_prompts(PROMPTS[:2], 0)
    spec = sampling.RolloutSpec(num_generations=2, max_new_tokens=5, temperature=0.0)
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 GiB")

    def fail(*args, **kwargs):
        raise oom

    def gib(pages):
        size = [pages, 4, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim, 4]
        return f"{np.prod(size, dtype=np.float64) / 2**30:,.2f} GiB"

    paged = sampling.PagedSampler(cfg, pages=10**7, page_size=4, prefill_chunk=8)
    pool = paged.pool

    def allocation_fails(*args, shapes=False, **sizes):
        return pool(*args, shapes=True, **sizes) if shapes else fail()

    monkeypatch.setattr(paged, "pool", allocation_fails)
    with pytest.raises(errors.UserError) as err:
        paged.sample(params, ids, mask, spec)
    line = errors.format_error(err.value)
    assert line.startswith("error: rollout.paged.pages=10000000: device out of memory")
    assert f"10000000 pages of 4 tokens, {gib(10**7)} of KV cache" in line
    assert line.endswith("lower rollout.paged.pages (0 = automatic)")
    assert "remat" not in line and err.value.__cause__ is oom

    paged = sampling.PagedSampler(cfg, page_size=4, prefill_chunk=8)
    monkeypatch.setattr(paged, "decode_slots", fail)
    with pytest.raises(errors.UserError) as err:
        paged.sample(params, ids, mask, spec)
    total = paged.auto_pages(4, ids.shape[1] + 5)
    assert str(err.value).startswith("rollout.paged.pages=0: device out of memory")
    assert f"automatic page pool of {total} pages of 4 tokens, {gib(total)}" in str(err.value)
    assert f"set rollout.paged.pages below {total}" in str(err.value)


def test_kernels_that_cannot_run_on_cpu_are_refused_naming_the_key(tmp_path):
    """On CPU, model.attention='cudnn' / 'pallas' and rollout.paged.attention='pallas' (in
    a training run) stop before the start with one line naming the key."""
    from tiny_run import make_model_dir, tiny_config

    from jaxrl_llm import config as config_lib
    from jaxrl_llm.config import checks_model, checks_rollout

    c = tiny_config(make_model_dir(str(tmp_path / "model")))
    for attention in ("cudnn", "pallas"):
        c.model.attention = attention
        with pytest.raises(config_lib.ConfigError, match=f"model.attention='{attention}': a "):
            checks_model.check_model(c)
    c.model.attention, c.rollout.engine, c.rollout.paged.attention = "auto", "paged", "pallas"
    with pytest.raises(config_lib.ConfigError, match="rollout.paged.attention='pallas': "):
        checks_rollout.check_engine(c, 1)
