"""The jitted update step: log-probs, micro-/mini-batching, sharding, guards, NaN, PPO critic.

References are independent of the code under test: a float64 numpy log-softmax over full
logits, the sampler's own log-probs, the same update without micro-batching or without
sharding, and a plain full-sequence forward for the critic's values.

Parameter comparisons use Adam with eps = 1: its step is then a smooth function of the
gradient. With eps = 1e-8 a gradient of ~1e-9 (rounding noise) gets a full-size step of
either sign, and two correct computations could differ by the learning rate.
"""

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from tiny_run import tiny_model_config

from jaxrl_llm import models, parallel, rl, sampling
from jaxrl_llm.rl import critic
from jaxrl_llm.rl import update as U

TEMPERATURE, G = 0.7, 4
SPEC = sampling.RolloutSpec(num_generations=G, max_new_tokens=6, temperature=TEMPERATURE)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11]]  # N = 16 rows
CFG = tiny_model_config()
SMOOTH_ADAM = U.make_optimizer(learning_rate=0.3, eps=1.0, max_grad_norm=1.0)


@pytest.fixture(scope="module")
def params():
    return models.init_params(CFG, seed=0)


@pytest.fixture(scope="module")
def rollout(params):
    return sampling.generate(
        CFG, params, PROMPTS, max_new_tokens=6, num_samples=G, temperature=TEMPERATURE, seed=3
    )


@pytest.fixture(scope="module")
def host_batch(rollout):
    """Numpy batch with ragged lengths, tool tokens, a row with no trained token, groups of
    equal rewards (advantage 0) and a reference policy a little off the sampler's."""
    lengths = np.array([6, 3, 1, 6, 2, 6, 5, 6, 4, 6, 6, 1, 6, 3, 6, 2])
    mask = np.arange(6)[None, :] < lengths[:, None]  # as if the rows had stopped there
    loss_mask = mask.copy()
    loss_mask[3, 1:3] = False  # attended, not trained (tool output)
    loss_mask[9] = False
    rewards = np.array([1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 0, 0.5, 1, 0, 0.2], np.float32)
    logprobs = np.where(mask, np.asarray(rollout.logprobs), 0.0).astype(np.float32)
    noise = np.random.default_rng(0).normal(0, 0.1, mask.shape)
    return U.RolloutBatch(
        prompt_tokens=np.asarray(rollout.prompt_tokens),
        prompt_mask=np.asarray(rollout.prompt_mask),
        tokens=np.where(mask, np.asarray(rollout.tokens), 0).astype(np.int32),
        mask=mask,
        loss_mask=loss_mask,
        behaviour_logprobs=logprobs,
        rewards=rewards,
        policy_version=np.zeros(16, np.int32),
        ref_logprobs=np.where(mask, logprobs + noise, 0.0).astype(np.float32),
        num_generations=G,
    )


def on_device(host_batch, mesh=None, **replace):
    return parallel.shard_batch(host_batch.replace(**replace), mesh)


def fresh_state(params, opt=SMOOTH_ADAM, mesh=None):
    """A train state owning a copy of params (the update donates it)."""
    if mesh is not None:
        params = jax.device_put(params, models.param_shardings(CFG, mesh))
    return U.init_train_state(jax.tree.map(jnp.copy, params), opt)


@functools.cache
def update_fn(
    preset,
    micro=1,
    mini=1,
    iterations=1,
    skip=False,
    opt=SMOOTH_ADAM,
    share=False,
    spec=SPEC,
    seed=0,
    cfg=CFG,
):
    """One jitted function per setting, shared by the tests (compiles are the cost).
    share=False: every row reads its own prompt (the reference of the shared path)."""
    algo = rl.preset(preset, num_iterations=iterations)
    return U.make_update_fn(
        cfg,
        algo,
        opt,
        spec,
        micro_batches=micro,
        mini_batches=mini,
        chunk_size=4,
        skip_nonfinite=skip,
        share_prompts=share,
        seed=seed,
    )


def host(tree):
    return jax.tree.map(np.asarray, tree)


def max_diff(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(x - y).max()), a, b)))


# ---------------------------------------------------------------------------- optimizer
@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
@pytest.mark.parametrize("end_ratio", [0.0, 0.1])
def test_schedule_matches_formula(schedule, end_ratio):
    lr, warmup, total = 0.1, 4, 20
    opt = U.make_optimizer(
        learning_rate=lr,
        warmup_steps=warmup,
        total_steps=total,
        schedule=schedule,
        end_lr_ratio=end_ratio,
    )
    end = lr * end_ratio
    for s in (0, 2, 4, 9, 20):
        frac = (s - warmup) / (total - warmup)
        expected = (
            {
                "constant": lr,
                "cosine": end + (lr - end) * 0.5 * (1 + np.cos(np.pi * frac)),
                "linear": lr - (lr - end) * frac,
            }[schedule]
            if s >= warmup
            else lr * s / warmup
        )
        np.testing.assert_allclose(float(opt.schedule(jnp.int32(s))), expected, rtol=1e-6)


@pytest.mark.parametrize("mu_dtype", ["float32", "bfloat16"])
def test_optimizer_step_matches_numpy_adamw(mu_dtype):
    """bfloat16 first moment: updated in float32, stored rounded, and the direction taken
    from the stored moment (the reference rounds its moment to bfloat16 each step)."""
    rng = np.random.default_rng(0)
    p = {"w": rng.normal(size=(3, 4)), "final_norm": rng.normal(size=4)}
    p = jax.tree.map(lambda x: x.astype(np.float32), p)
    grads = [
        jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), p) for _ in range(4)
    ]
    wd, b1, b2, eps, clip, lr = 0.1, 0.9, 0.99, 1e-6, 1.0, 0.05
    opt = U.make_optimizer(
        learning_rate=lr,
        weight_decay=wd,
        b1=b1,
        b2=b2,
        eps=eps,
        max_grad_norm=clip,
        mu_dtype=mu_dtype,
    )
    store = (lambda x: x) if mu_dtype == "float32" else (lambda x: x.astype(ml_dtypes.bfloat16))
    params, state = p, opt.init(p)
    ref = {k: v.astype(np.float64) for k, v in p.items()}
    m = {k: 0.0 for k in p}
    v = {k: 0.0 for k in p}
    for t, g in enumerate(grads, start=1):
        params, state = opt.step(g, state, params, jnp.float32(lr))
        norm = np.sqrt(sum(np.sum(np.square(x.astype(np.float64))) for x in g.values()))
        for k in p:
            gk = g[k] * min(1.0, clip / norm)
            m[k] = b1 * m[k] + (1 - b1) * gk
            v[k] = b2 * v[k] + (1 - b2) * gk**2
            m[k] = store(np.asarray(m[k], np.float32)).astype(np.float64)
            u = (m[k] / (1 - b1**t)) / (np.sqrt(v[k] / (1 - b2**t)) + eps)
            decay = 0.0 if "norm" in k else wd  # norm scales are not decayed
            ref[k] = ref[k] - lr * (u + decay * ref[k])
    for k in p:
        np.testing.assert_allclose(np.asarray(params[k]), ref[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            np.asarray(state[1].mu[k], np.float64), m[k], rtol=1e-5, atol=1e-7
        )
        assert state[1].mu[k].dtype == jnp.dtype(mu_dtype)


def test_bfloat16_params_update_through_float32_master():
    """bf16 parameters: the optimizer keeps a float32 master copy; the moments and updates
    are float32 and land on it, and the parameters are its rounding. Updates far below
    bf16's rounding step (lr 1e-4 on weights ~1, ulp 2^-7) accumulate instead of
    vanishing: the same trajectory as float32 parameters."""
    rng = np.random.default_rng(1)
    p32 = {
        "w": (1 + 0.1 * rng.normal(size=(3, 4))).astype(np.float32),
        "q_norm": np.ones(4, np.float32),
    }
    p32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), p32)
    opt = U.make_optimizer(learning_rate=1e-4, weight_decay=0.01, max_grad_norm=1.0)
    ref, ref_state = p32, opt.init(p32)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p32)
    state = opt.init(params)
    assert isinstance(state, rl.MasterWeights) and not isinstance(ref_state, rl.MasterWeights)
    step = jax.jit(opt.step)
    for _ in range(60):
        g = jax.tree.map(lambda x: jnp.asarray(0.5 + rng.random(x.shape), jnp.float32), p32)
        ref, ref_state = step(g, ref_state, ref, jnp.float32(1e-4))
        params, state = step(g, state, params, jnp.float32(1e-4))  # float32 grads, as summed
    for k in p32:
        assert params[k].dtype == jnp.bfloat16 and state.master[k].dtype == jnp.float32
        np.testing.assert_array_equal(state.master[k], ref[k])
        np.testing.assert_array_equal(params[k], state.master[k].astype(jnp.bfloat16))
    for leaf in jax.tree.leaves(state.inner):
        assert leaf.dtype in (jnp.float32, jnp.int32)
    # ~60 x 1e-4 moved every weight by more than half a bf16 step: the parameters changed.
    assert np.all(np.asarray(params["w"], np.float32) != np.asarray(p32["w"]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fresh_optimizer_state_is_one_program_placed_like_the_eager_one(params, dtype):
    """init_train_state builds the optimizer state in one compiled program: the same
    values and placement as optax's eager init (moments and master copies sharded like
    their params, counts replicated on the mesh), and nothing else compiles."""
    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    placed = jax.device_put(params, models.param_shardings(CFG, mesh))
    placed = jax.tree.map(lambda x: x.astype(dtype), placed)
    eager = rl.state.commit_like(SMOOTH_ADAM.init(placed), placed)
    owned, compiles = jax.tree.map(jnp.copy, placed), []

    def listen(event, *_, **__):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        state = U.init_train_state(owned, SMOOTH_ADAM)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(compiles) <= 1  # 0 when this session compiled it already
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(eager)
    for got, want in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(eager), strict=True):
        assert got.dtype == want.dtype and got.sharding.is_equivalent_to(want.sharding, got.ndim)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if dtype == "bfloat16":  # the float32 master copies: the params, widened
        assert isinstance(state.opt_state, rl.MasterWeights)
        jax.tree.map(
            lambda m, p: np.testing.assert_array_equal(m, np.asarray(p, np.float32)),
            host(state.opt_state.master),
            host(placed),
        )
    assert state.step.sharding == jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    assert int(state.step) == 0 and state.step.dtype == jnp.int32


def _aligned_host_array(n: int) -> np.ndarray:
    """float32 ones whose data starts on a page: what tcmalloc gives large arrays, and what
    `jax.device_put` on CPU views instead of copying."""
    raw = np.empty(n * 4 + 4096, np.uint8)
    start = (-raw.ctypes.data) % 4096
    a = raw[start : start + n * 4].view(np.float32)
    a[:] = 1.0
    return a


def test_owned_lets_the_first_donating_call_write_over_loaded_weights():
    """A CPU array put from an aligned numpy array views its memory: a donating program
    cannot write its output there (it allocates another buffer beside it: the first
    update held a second copy of the weights). After `rl.owned` it can; an array XLA made
    passes through as it is."""
    step = jax.jit(lambda x: x * 0.5 + 1.0, donate_argnums=0)

    def writes_in_place(x) -> bool:
        at = x.unsafe_buffer_pointer()
        y = step(x)
        np.testing.assert_array_equal(np.asarray(y), 1.5)
        return y.unsafe_buffer_pointer() == at

    # If this fails, jax no longer views host memory here and `owned` has nothing to do.
    assert not writes_in_place(jax.device_put(_aligned_host_array(1 << 16)))
    tree = {"w": jax.device_put(_aligned_host_array(1 << 16)), "n": 3}
    got = rl.owned(tree)
    assert got["n"] == 3 and tree["w"].is_deleted()  # donated: one copy, not two
    assert writes_in_place(got["w"])
    made = jnp.ones((1 << 16,))
    at = made.unsafe_buffer_pointer()
    assert rl.owned(made).unsafe_buffer_pointer() == at  # no copy


# ----------------------------------------------------------------------------- logprobs
def numpy_logprobs(params, batch, temperature):
    """log softmax(logits / tau)[token] in float64 from the full [N, P + T, V] logits."""
    ids = np.concatenate([batch.prompt_tokens, batch.tokens], 1)
    mask = np.concatenate([batch.prompt_mask, batch.mask], 1)
    logits = np.asarray(models.logits(CFG, params, ids, mask), np.float64) / temperature
    p = batch.prompt_tokens.shape[1]
    z = logits[:, p - 1 : -1]
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    return np.take_along_axis(z, batch.tokens[..., None], -1)[..., 0] - lse


def test_logprob_fn_matches_numpy_and_sampler(params, host_batch):
    b = host_batch
    fn = U.make_logprob_fn(CFG, SPEC.replace(num_generations=1), chunk_size=4)
    logp = np.asarray(fn(params, b))
    assert logp.shape == b.tokens.shape
    np.testing.assert_allclose(
        logp[b.mask], numpy_logprobs(params, b, TEMPERATURE)[b.mask], atol=1e-5
    )
    np.testing.assert_allclose(logp[b.mask], b.behaviour_logprobs[b.mask], atol=1e-4)
    assert np.all(logp[~b.mask] == 0)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "mesh"])
def test_shared_prompt_logprobs_equal_the_full_forward(params, host_batch, scan_layers, sharded):
    """Each prompt run once, the G rows' completions run after its keys/values ==
    every row's prompt + completion through the full forward (the path tested against
    numpy above): ragged prompts (left padding) and completions, 2 row slices."""
    cfg = tiny_model_config(scan_layers=scan_layers)
    b = host_batch
    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}) if sharded else None
    p = params if mesh is None else jax.device_put(params, models.param_shardings(cfg, mesh))
    d = on_device(b, mesh)
    kw = dict(chunk_size=4, micro_batches=2)
    full_fn = U.make_logprob_fn(cfg, SPEC.replace(num_generations=1), **kw)
    shared_fn = U.make_logprob_fn(cfg, SPEC, **kw)
    full, shared = np.asarray(full_fn(p, d)), np.asarray(shared_fn(p, d))
    assert np.abs(full[b.mask]).min() > 0.1  # real log-probs, not zeros
    np.testing.assert_allclose(shared[b.mask], full[b.mask], atol=1e-5)
    assert np.all(shared[~b.mask] == 0)
    # Only a group's first row's prompt is read: another prompt in row 1 changes the full
    # forward's row 1 (so the comparison above can see prompts), not the shared one.
    other = b.prompt_tokens.copy()
    other[1] = (other[1] + 1) % cfg.vocab_size
    d = d.replace(prompt_tokens=jnp.asarray(other))
    assert np.abs(np.asarray(full_fn(p, d))[1] - full[1])[b.mask[1]].max() > 1e-3
    np.testing.assert_array_equal(np.asarray(shared_fn(p, d)), shared)


def test_shared_prompt_logprobs_need_whole_groups(params, host_batch):
    b = host_batch
    with pytest.raises(ValueError, match="16 rows are not groups of num_generations=3"):
        rl.prefix.shared_prompt_logprobs(
            CFG, params, b.prompt_tokens, b.prompt_mask, b.tokens, b.mask, num_generations=3
        )


@pytest.mark.parametrize(
    "sharded", [pytest.param(False, marks=pytest.mark.slow), True], ids=["one_device", "mesh"]
)
def test_shared_prompt_update_equals_every_row_reading_its_prompt(params, host_batch, sharded):
    """share_prompts: each prompt's forward + backward runs once, before the 4 micro-batches
    (each holds one row of every group), its keys/values' cotangents summed over them ==
    the update where every row reads its own prompt. beta > 0, ragged prompts and
    completions, a row with no trained token."""
    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}) if sharded else None
    batch = on_device(host_batch, mesh)
    per_row, m_row = update_fn("grpo", micro=4)(fresh_state(params, mesh=mesh), batch)
    shared, m_shared = update_fn("grpo", micro=4, share=True)(fresh_state(params, mesh=mesh), batch)
    assert max_diff(host(per_row.params), host(params)) > 1e-3  # not vacuous
    assert max_diff(host(shared.params), host(per_row.params)) <= 1e-5
    assert max_diff(host(shared.opt_state), host(per_row.opt_state)) <= 1e-5
    for name in ("loss/total", "policy/entropy", "optim/grad_norm"):
        np.testing.assert_allclose(float(m_shared[name]), float(m_row[name]), rtol=1e-5)
    if sharded:
        return
    # Only a group's first row's prompt is read: another prompt in row 1 moves the
    # per-row update (so the comparison above can see prompts), not the shared one.
    prompts = host_batch.prompt_tokens.copy()
    prompts[1] = (prompts[1] + 1) % CFG.vocab_size
    other = on_device(host_batch, prompt_tokens=prompts)
    moved, _ = update_fn("grpo", micro=4)(fresh_state(params), other)
    assert max_diff(host(moved.params), host(per_row.params)) > 1e-4
    same, _ = update_fn("grpo", micro=4, share=True)(fresh_state(params), other)
    assert max_diff(host(same.params), host(shared.params)) == 0.0


@pytest.mark.parametrize(
    "share, sharded", [(False, False), (True, True)], ids=["per_row", "shared_prompts_mesh"]
)
def test_unrolled_update_equals_the_scanned_one(params, host_batch, share, sharded):
    """An unrolled model (`scan_layers=False`, no remat) takes its gradient with respect
    to each layer's weights sliced once (`rl.gradients._Sliced`) and sums it per layer:
    the same update as the scanned model's through its layer stacks, 4 micro-batches,
    with and without the shared prompts' forward."""
    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}) if sharded else None
    batch = on_device(host_batch, mesh)
    unrolled = CFG.replace(scan_layers=False)
    fields = ("algo", "opt", "critic_opt", "spec", "micro_batches", "mini_batches")
    fields += ("chunk_size", "skip_nonfinite", "seed")
    assert U.Setup(unrolled, **dict.fromkeys(fields)).slices_layers  # the path under test
    scanned, m_scanned = update_fn("grpo", micro=4, share=share)(
        fresh_state(params, mesh=mesh), batch
    )
    sliced, m_sliced = update_fn("grpo", micro=4, share=share, cfg=unrolled)(
        fresh_state(params, mesh=mesh), batch
    )
    assert max_diff(host(scanned.params), host(params)) > 1e-3  # not vacuous
    assert max_diff(host(sliced.params), host(scanned.params)) <= 1e-6
    assert max_diff(host(sliced.opt_state), host(scanned.opt_state)) <= 1e-6
    for name in ("loss/total", "optim/grad_norm"):
        np.testing.assert_allclose(float(m_sliced[name]), float(m_scanned[name]), rtol=1e-6)


def test_shared_prompt_old_logprobs_with_mini_batches(params, host_batch, multi_pass):
    """Mini-batches permute the rows, so the forward + backward reads every row's prompt;
    the old policy's log-probs (a forward of the whole batch first) still share them."""
    state, metrics = update_fn("grpo", micro=2, mini=2, iterations=2, share=True)(
        fresh_state(params), on_device(host_batch)
    )
    single, m_single = multi_pass
    assert max_diff(host(state.params), host(single.params)) <= 1e-5
    np.testing.assert_allclose(
        float(metrics["policy/ratio_max"]), float(m_single["policy/ratio_max"]), rtol=1e-5
    )
    fn = update_fn("grpo", micro=2, mini=2, iterations=2, share=True)
    assert (fn.forward_passes, fn.shared_prompt_passes) == (7, 1)
    fn = update_fn("grpo", micro=4, share=True)
    assert (fn.forward_passes, fn.shared_prompt_passes) == (3, 3)
    assert update_fn("grpo", micro=4).shared_prompt_passes == 0


def test_update_checks_the_batch_groups(params, host_batch):
    """G exists once: the update refuses a batch whose G differs from its spec's, and a
    batch whose rows are not whole groups."""
    spec3 = SPEC.replace(num_generations=3)
    with pytest.raises(ValueError, match="batch.num_generations=4: .*spec.num_generations=3"):
        update_fn("grpo", spec=spec3)(fresh_state(params), on_device(host_batch))
    with pytest.raises(ValueError, match="16 rows are not groups of num_generations=3"):
        update_fn("grpo", spec=spec3)(
            fresh_state(params), on_device(host_batch).replace(num_generations=3)
        )
    with pytest.raises(ValueError, match="num_generations=1: .*needs >= 2"):
        update_fn("grpo", spec=SPEC.replace(num_generations=1))


def test_permutation_key_derives_from_the_seed(params, host_batch):
    """Mini-batches are a permutation of the rows keyed by (train.seed, step): the same
    seed gives the same update, another seed other mini-batches (other parameters)."""
    batch = on_device(host_batch)
    a, _ = update_fn("grpo", micro=2, mini=2, seed=0)(fresh_state(params), batch)
    b, _ = update_fn("grpo", micro=2, mini=2, seed=0)(fresh_state(params), batch)
    c, _ = update_fn("grpo", micro=2, mini=2, seed=1)(fresh_state(params), batch)
    assert max_diff(host(a.params), host(b.params)) == 0.0
    assert max_diff(host(a.params), host(c.params)) > 1e-4


# -------------------------------------------------------------------- micro-batch, guard
@pytest.mark.parametrize(
    "preset", ["grpo", pytest.param("dr_grpo", marks=pytest.mark.slow)]
)  # seq-mean-token-mean / -sum-norm
def test_micro_batches_equal_one_big_batch(params, host_batch, preset):
    batch = on_device(host_batch)
    big, _ = update_fn(preset, micro=1, skip=True)(fresh_state(params), batch)
    state = fresh_state(params)
    # The first call compiles; under the guard, so neither compiling nor running may copy
    # between host and device implicitly.
    with jax.transfer_guard("disallow"):
        small, metrics = update_fn(preset, micro=4, skip=True)(state, batch)
        nonfinite = metrics["optim/nonfinite"]
    assert float(nonfinite) == 0.0
    moved = max_diff(host(small.params), host(params))
    assert moved > 1e-3  # the comparison below is not vacuous
    assert max_diff(host(small.params), host(big.params)) <= 1e-5
    assert max_diff(host(small.opt_state), host(big.opt_state)) <= 1e-5
    assert int(small.step) == 1


def test_second_call_does_not_recompile(params, host_batch):
    fn = update_fn("grpo", micro=4, skip=True)
    state, _ = fn(fresh_state(params), on_device(host_batch))
    before = sum(fn.traces.values())
    state, _ = fn(state, on_device(host_batch))
    assert sum(fn.traces.values()) == before == 1 and int(state.step) == 2


@pytest.mark.parametrize(
    "preset, micro, mini",
    [("grpo", 2, 1), ("rloo", 1, 2)],  # KL in the loss, on-policy / in the reward, pi_old
    ids=["kl_in_loss", "kl_in_reward"],
)
def test_behaviour_logprobs_stand_in_for_the_initial_reference(
    params, host_batch, preset, micro, mini
):
    """A fresh run whose reference is the initial policy runs no reference forward in its
    first step: the rollout's behaviour log-probs (the sampler's, from the same params)
    are the batch's reference log-probs (`trainer.Run.reference`). That update equals the
    one given the reference forward's log-probs to float rounding, and its KL is ~0."""
    b = host_batch
    ref_fn = U.make_logprob_fn(CFG, SPEC, chunk_size=4)
    forward = np.asarray(ref_fn(params, on_device(b)))
    mask = np.asarray(b.mask)
    np.testing.assert_allclose(np.where(mask, forward, 0), b.behaviour_logprobs, atol=2e-5)
    true_ref = on_device(b, ref_logprobs=forward)
    stand_in = on_device(b, ref_logprobs=np.asarray(b.behaviour_logprobs))
    fn = update_fn(preset, micro=micro, mini=mini)
    want, m_want = fn(fresh_state(params), true_ref)
    got, m_got = fn(fresh_state(params), stand_in)
    assert max_diff(host(got.params), host(params)) > 1e-3  # not vacuous
    assert max_diff(host(got.params), host(want.params)) <= 1e-5
    if mini == 1:  # one optimizer step from the reference's params: the KL is ~0
        assert abs(float(m_got["policy/kl_ref"])) < 1e-6
    for name in ("loss/total", "adv/std", "optim/grad_norm", "policy/kl_ref"):
        np.testing.assert_allclose(float(m_got[name]), float(m_want[name]), rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------- mini-batches and sharding
@pytest.fixture(scope="module")
def multi_pass(params, host_batch):
    """2 passes x 2 mini-batches x 2 micro-batches, single device."""
    fn = update_fn("grpo", micro=2, mini=2, iterations=2)
    return fn(fresh_state(params), on_device(host_batch))


def test_mini_batches_and_iterations_move_the_ratio(multi_pass):
    _, m = multi_pass
    # Later optimizer steps see a policy that has moved away from pi_old.
    assert float(m["policy/ratio_min"]) < 0.99 and float(m["policy/ratio_max"]) > 1.01
    assert float(m["policy/approx_kl"]) > 0
    assert float(m["policy/clipfrac_low"]) + float(m["policy/clipfrac_high"]) > 0
    assert float(m["optim/nonfinite"]) == 0.0


def test_sharded_update_equals_single_device(params, host_batch, multi_pass):
    single, m_single = multi_pass
    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    fn = update_fn("grpo", micro=2, mini=2, iterations=2)
    state = fresh_state(params, mesh=mesh)
    shardings = jax.tree.map(lambda x: x.sharding, state.params)
    sharded, m_sharded = fn(state, on_device(host_batch, mesh))
    traces = sum(fn.traces.values())
    assert max_diff(host(sharded.params), host(single.params)) <= 1e-5
    assert max_diff(host(sharded.opt_state), host(single.opt_state)) <= 1e-5
    for name in ("loss/total", "policy/ratio_max", "optim/grad_norm", "adv/std"):
        np.testing.assert_allclose(float(m_sharded[name]), float(m_single[name]), rtol=1e-5)
    # Params come back with the shardings they went in with: no resharding, no recompile.
    assert jax.tree.map(lambda x: x.sharding, sharded.params) == shardings
    fn(sharded, on_device(host_batch, mesh))
    assert sum(fn.traces.values()) == traces


# ---------------------------------------------------------------------------- NaN / inf
def test_skip_nonfinite_leaves_state_unchanged(params, host_batch):
    fn = update_fn("grpo", micro=4, skip=True)
    for bad in (
        dict(rewards=np.where(np.arange(16) == 2, np.nan, host_batch.rewards)),
        dict(behaviour_logprobs=np.where(host_batch.mask, np.nan, host_batch.behaviour_logprobs)),
    ):
        state = fresh_state(params)
        before = host((state.params, state.opt_state))
        new, metrics = fn(state, on_device(host_batch, **bad))
        assert float(metrics["optim/nonfinite"]) == 1.0
        after = host((new.params, new.opt_state))
        assert jax.tree.all(jax.tree.map(np.array_equal, after, before))
        assert int(new.step) == 1  # the trainer step still counts


def test_update_without_skip_copies_no_optimizer_state(params, host_batch):
    """Without skip_nonfinite the new moments overwrite the old ones in place. The skip
    keeps the old state alive beside the new one to select between them, so XLA copies
    the moments first (a float32 copy of the optimizer state at the update's peak)."""
    state, batch = fresh_state(params), on_device(host_batch)

    def copied_state(skip: bool) -> list[str]:
        hlo = update_fn("grpo", micro=4, skip=skip).lower(state, batch).compile().as_text()
        return [x for x in re.findall(r" copy\((%?[\w.]+)\)", hlo) if "opt_state" in x]

    assert copied_state(skip=True)  # what the check looks for is there to find
    assert copied_state(skip=False) == []


def test_nonfinite_without_skip_is_reported(params, host_batch):
    rewards = np.where(np.arange(16) == 2, np.nan, host_batch.rewards)
    new, metrics = update_fn("dr_grpo", micro=1)(
        fresh_state(params), on_device(host_batch, rewards=rewards)
    )
    assert float(metrics["optim/nonfinite"]) == 1.0
    assert not np.isfinite(np.asarray(new.params["embed"])).all()  # applied anyway


# --------------------------------------------------------------------------------- PPO
def test_critic_values_are_the_shifted_trunk_states(params, host_batch):
    b = host_batch
    cp = critic.init_critic(CFG, params)
    assert "lm_head" not in cp["trunk"] and float(jnp.abs(cp["value_head"]["kernel"]).max()) == 0
    rng = np.random.default_rng(1)
    cp["value_head"] = {
        "kernel": jnp.asarray(rng.normal(size=32), jnp.float32),
        "bias": jnp.float32(0.5),
    }
    v = np.asarray(
        jax.jit(critic.values, static_argnums=0)(
            CFG, cp, b.prompt_tokens, b.prompt_mask, b.tokens, b.mask
        )
    )
    assert v.shape == b.tokens.shape
    # Naive: one full forward of the policy trunk, the state at position P - 1 + t.
    ids = np.concatenate([b.prompt_tokens, b.tokens], 1)
    mask = np.concatenate([b.prompt_mask, b.mask], 1)
    hidden = np.asarray(jax.jit(models.forward, static_argnums=0)(CFG, params, ids, mask))
    p = b.prompt_tokens.shape[1]
    ref = np.stack([hidden[:, p - 1 + t] for t in range(b.tokens.shape[1])], 1)
    ref = ref @ np.asarray(cp["value_head"]["kernel"]) + 0.5
    np.testing.assert_allclose(v[b.mask], ref[b.mask], atol=1e-5)
    # V(s_0) is the value of the prompt alone: the completion cannot leak into it.
    hidden_prompt = np.asarray(models.forward(CFG, params, b.prompt_tokens, b.prompt_mask))
    np.testing.assert_allclose(
        v[:, 0], hidden_prompt[:, -1] @ cp["value_head"]["kernel"] + 0.5, atol=1e-5
    )


def test_ppo_critic_warmup_freezes_the_policy(params, host_batch):
    algo = rl.preset("ppo", critic_warmup_steps=1)
    fn = U.make_update_fn(
        CFG, algo, SMOOTH_ADAM, SPEC, micro_batches=2, chunk_size=4, critic_optimizer=SMOOTH_ADAM
    )
    own = jax.tree.map(jnp.copy, params)
    state = U.init_train_state(own, SMOOTH_ADAM, critic.init_critic(CFG, own), SMOOTH_ADAM)
    policy0, critic0 = host((state.params, state.opt_state)), host(state.critic_params)
    batch = on_device(host_batch)
    state, m = fn(state, batch)  # step 0 < warmup: critic only
    assert jax.tree.all(
        jax.tree.map(np.array_equal, host((state.params, state.opt_state)), policy0)
    )
    assert max_diff(host(state.critic_params), critic0) > 1e-3
    assert float(m["optim/nonfinite"]) == 0 and np.isfinite(float(m["loss/value"]))
    assert float(m["value/mean"]) == 0.0  # rollout-time values of the zero head
    traces = sum(fn.traces.values())
    state, m = fn(state, batch)  # step 1: both move
    assert sum(fn.traces.values()) == traces  # the critic's layout is stable too
    assert max_diff(host(state.params), policy0[0]) > 1e-3
    assert np.isfinite(float(m["value/explained_variance"]))


def test_the_shared_prompts_forward_is_recomputed_not_held(params):
    """The update's shared prompts' forward (`prompt_prefix(..., recompute=True)`, an
    unrolled model's sliced layers) keeps only each layer's input and recomputes the
    layer in the backward, after its cotangent: the same gradient as keeping the
    activations, and the compiled program holds far less (kept, XLA holds every layer's
    activations at once; `jax.checkpoint` alone does not stop it)."""
    cfg = CFG.replace(scan_layers=False, num_layers=4)
    tokens = jax.random.randint(jax.random.key(1), (32, 96), 1, cfg.vocab_size)
    mask = jnp.ones(tokens.shape, bool).at[::3, :20].set(False)
    weights = models.init_params(cfg, seed=2)

    def grad(recompute):
        def loss(p, layers):
            kv, last = rl.prefix.prompt_prefix(
                cfg, p, tokens, mask, 2, None, None, layers, recompute
            )
            return jnp.sum(last**2) + sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(kv))

        return jax.jit(jax.grad(loss, argnums=(0, 1)))

    args = (weights, models.layer_params(weights))
    held, recomputed = grad(False), grad(True)
    want = held(*args)
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(want))
    assert max_diff(want, recomputed(*args)) <= 1e-6 * scale  # float32 rounding only
    temporaries = lambda g: g.lower(*args).compile().memory_analysis().temp_size_in_bytes  # noqa: E731
    assert temporaries(recomputed) < 0.6 * temporaries(held)


def test_the_recompute_slices_the_weights_again_after_the_cotangent():
    """`recompute_in_backward(fn, (stacked, reslice))` keeps the stacks, not the forward's
    slices of them (each a copy, so every layer's would be resident until its backward:
    for the shared prompts, through all the micro-batches), and slices each layer again
    at an index tied to its cotangent: one dynamic slice per layer survives compilation
    (neither merged with the forward's slice nor hoisted out of the backward). Same
    gradient as plain autodiff, which keeps the slices."""
    L, D, N = 4, 64, 8
    keys = jax.random.split(jax.random.key(0), 2)
    stacked = jax.random.normal(keys[0], (L, D, D)) / np.sqrt(D)
    x = jax.random.normal(keys[1], (N, D))

    def layer(carry, w, at):
        del at
        return jnp.tanh(carry @ w)

    def grad(again):
        def loss(stacked):
            h = x
            for i in range(L):
                source = (
                    stacked,
                    lambda s, offset, i=i: jax.lax.dynamic_index_in_dim(
                        s, i + offset, keepdims=False
                    ),
                )
                step = models.layers.recompute_in_backward(layer, source) if again else layer
                h = step(h, stacked[i], None)
            return jnp.sum(jnp.sin(h))

        return jax.jit(jax.grad(loss))

    kept, again = grad(False)(stacked), grad(True)(stacked)
    assert float(np.abs(kept - again).max()) <= 1e-6 * float(np.abs(kept).max())
    hlo = lambda again: grad(again).lower(stacked).compile().as_text()  # noqa: E731
    assert hlo(False).count("dynamic-slice(") == 0
    assert hlo(True).count("dynamic-slice(") >= L
