"""The multi-turn turn loop against independent references: a conversation re-prefilled
every turn with HF `generate`, teacher-forced log-probs, and the loss's gradient."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_reference import hf_model
from tiny_run import TOKENIZER

from jaxrl_llm import envs, models, rl, sampling
from jaxrl_llm.models import builtin

TEST_ENVS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "envs_for_tests.py")
# Rows whose environment ends after 1, 2, 4 (past max_turns) or 3 actions: some rows stop
# while others go on.
EXAMPLES = [
    {"question": "1+2=", "turns": 1},
    {"question": "12*3+45=", "turns": 2},
    {"question": "7=", "turns": 4},
    {"question": "(8-9)/3=", "turns": 3},
]
# Turns end on "=" "." "," or " " (or after 6 tokens): the tiny models stop on some of
# them and run out of budget on others.
SETTINGS = envs.TurnSettings(
    max_turns=3,
    turn_tokens=6,
    max_total_tokens=28,
    stop_ids=(18, 22, 23, 25),
    end_of_turn_ids=(18, 22, 23, 25),
)


@pytest.fixture(scope="module")
def tok():
    return builtin.load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            model = hf_model(arch, seed=3, vocab_size=33)
            d = tmp_path_factory.mktemp(arch)
            model.save_pretrained(d)
            cache[arch] = (model, *models.load_hf(d))
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def pool():
    with envs.EnvPool(f"{TEST_ENVS}:Scripted", {"turns": 3}, workers=1) as p:
        yield p


@pytest.fixture(scope="module")
def greedy(tiny, pool, tok):
    """One greedy multi-turn rollout per architecture (G = 2: a group for the update),
    shared by the tests that read it."""
    cache = {}

    def get(arch):
        if arch not in cache:
            model, cfg, params = tiny(arch)
            cache[arch] = model, cfg, params, *play(cfg, params, pool, tok, G=2)
        return cache[arch]

    return get


def play(cfg, params, pool, tok, settings=SETTINGS, G=1, temperature=0.0, mesh=None):
    renderer = envs.Renderer(tok, use_chat=False)
    trajs, observations = pool.reset(EXAMPLES)
    prompts = [renderer.prompt(o) for o in observations]
    ids, mask = sampling.pad_prompts(prompts, 0)
    trajs, _ = envs.replicate(trajs, observations, G)
    spec = sampling.RolloutSpec(
        G, settings.max_total_tokens, temperature, stop_ids=settings.end_of_turn_ids
    )
    sampler = sampling.Sampler(cfg, mesh, seed=5, cache_segments=1)
    out, turns = envs.play(
        sampler, params, ids, mask, spec, settings, pool, trajs, renderer, tok, step=1, mesh=mesh
    )
    return prompts, out, turns, trajs, spec


def hf_conversation(model, example, tok, s=SETTINGS):
    """The reference turn loop: every turn `generate` re-reads the whole conversation
    (prompt, sampled turns, observations) from scratch."""
    env, renderer = envs.get(f"{TEST_ENVS}:Scripted"), envs.Renderer(tok, False)
    prompt = renderer.prompt(env.reset(example))
    model.generation_config.eos_token_id = None
    seq, completion = list(prompt), []
    for turn in range(s.max_turns):
        ids = torch.tensor([seq])
        with torch.no_grad():  # an explicit mask: a sampled pad id (0) is a real token
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=s.turn_tokens,
                do_sample=False,
                eos_token_id=list(s.stop_ids),
                pad_token_id=0,
            )
        new = out[0, len(seq) :].tolist()
        completion, seq = completion + new, seq + new
        step = env.step(tok.decode(new, skip_special_tokens=True))
        if step.done or turn == s.max_turns - 1:
            break
        obs = renderer.turn(step.observation, new[-1] if new[-1] in s.end_of_turn_ids else None)
        if len(completion) + len(obs) + s.turn_tokens > s.max_total_tokens:
            break
        completion, seq = completion + obs, seq + obs
    return completion


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_trajectories_equal_hf_reprefilling_every_turn(greedy, tok, arch):
    """Appending each observation to the KV cache == re-prefilling the whole conversation
    every turn: the same tokens, turn for turn, for a scripted environment."""
    model, _, _, prompts, out, turns, trajs, _ = greedy(arch)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    assert tokens.shape[1] == SETTINGS.max_total_tokens
    for b, example in enumerate(EXAMPLES):
        reference = hf_conversation(model, example, tok)
        for i in (2 * b, 2 * b + 1):  # greedy: both rows of the group
            np.testing.assert_array_equal(tokens[i, : lengths[i]], reference)
    ends = [t.end for t in trajs]
    assert ends == ["done"] * 4 + ["max_turns"] * 2 + ["done"] * 2
    assert turns.model_turns.tolist() == [1, 1, 2, 2, 3, 3, 3, 3]


def test_trained_tokens_are_the_sampled_ones_with_their_logprobs(greedy, tok):
    """Observation tokens are in the completion exactly as rendered, with loss mask 0 and
    log-prob 0; the teacher-forced log-probs of the whole trajectory (the trainer's own
    function) equal the sampler's on every sampled token."""
    _, cfg, params, _, out, turns, trajs, spec = greedy("qwen3")
    ref = rl.make_logprob_fn(cfg, spec, chunk_size=16)(params, out)
    tokens, mask, loss_mask, logprobs = (
        np.asarray(x) for x in (out.tokens, out.mask, out.loss_mask, out.logprobs)
    )
    renderer = envs.Renderer(tok, use_chat=False)
    for i, spans in enumerate(turns.spans):
        k = 0
        for kind, a, b in spans:
            assert a == (spans[k - 1][2] if k else 0)  # turns follow each other, no hole
            assert loss_mask[i, a:b].all() == (kind == "model") and mask[i, a:b].all()
            if kind == "env":
                assert not logprobs[i, a:b].any()
            k += 1
        assert not mask[i, spans[-1][2] :].any()
    for i, spans in enumerate(turns.spans):  # the observations, as rendered
        env_spans = [(a, b) for kind, a, b in spans if kind == "env"]
        for j, (a, b) in enumerate(env_spans):
            model_end = spans[2 * j][2]
            last = int(tokens[i, model_end - 1])
            closed = last if last in SETTINGS.end_of_turn_ids else None
            expected = renderer.turn(["12", "3+4="][j], closed)
            np.testing.assert_array_equal(tokens[i, a:b], expected)
    assert np.abs(np.asarray(ref) - logprobs)[loss_mask].max() <= 1e-4
    assert (turns.obs_tokens[2:] > 0).all() and len(trajs) == 8


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "gspo", "rloo", "ppo"])
def test_observation_positions_get_no_gradient(name):
    """d loss / d log-prob is exactly 0 at observation positions (attended, not sampled),
    and the old / behaviour / reference log-probs there do not change the loss."""
    rng = np.random.default_rng(0)
    N, T = 6, 12
    mask = np.arange(T)[None] < rng.integers(6, T + 1, N)[:, None]
    loss_mask = mask & ~((np.arange(T)[None] % 5 >= 3) & (np.arange(T)[None] > 1))
    assert (mask & ~loss_mask).any()
    logp, old, behaviour, ref = (
        jnp.asarray(rng.normal(-1.0, 0.3, (N, T)), jnp.float32) for _ in range(4)
    )
    adv = jnp.asarray(rng.normal(size=(N, T) if name == "ppo" else N), jnp.float32)
    cfg = rl.preset(name, beta=0.04, tis_cap=2.0)
    obs = jnp.asarray(mask & ~loss_mask)

    def loss(lp, old, behaviour, ref):
        return rl.policy_objective(
            cfg, lp, old, behaviour, ref, adv, jnp.asarray(loss_mask), max_len=T
        )[0]

    grad = np.asarray(jax.grad(loss)(logp, old, behaviour, ref))
    assert (grad[np.asarray(obs)] == 0).all() and (grad[loss_mask] != 0).any()
    shifted = [jnp.where(obs, x + 5.0, x) for x in (old, behaviour, ref)]
    assert loss(logp, *shifted) == loss(logp, old, behaviour, ref)


def test_update_ignores_observation_logprobs(greedy):
    """The trainer's update on a multi-turn batch: changing the behaviour and reference
    log-probs at observation positions leaves the new parameters bit for bit the same."""
    _, cfg, params, _, out, _, _, spec = greedy("qwen3")
    ref = out.logprobs - 0.1  # stands in for a reference model's (only its value matters)
    obs = out.mask & ~out.loss_mask
    assert bool(obs.any())
    algo = rl.preset("grpo", beta=0.04)
    opt = rl.make_optimizer(learning_rate=1e-2)
    update = rl.make_update_fn(cfg, algo, opt, spec, chunk_size=16)
    rewards = jnp.asarray(np.arange(8) % 3, jnp.float32)
    new = []
    for shift in (0.0, 4.0):
        batch = rl.RolloutBatch.from_sample(
            out.replace(logprobs=jnp.where(obs, out.logprobs + shift, out.logprobs)),
            rewards,
            jnp.where(obs, ref - shift, ref),
        )
        state = rl.init_train_state(jax.tree.map(jnp.copy, params), opt)
        new.append(update(state, batch)[0].params)
    jax.tree.map(np.testing.assert_array_equal, *new)
    changed = jax.tree.map(lambda a, b: bool((a != b).any()), new[0], params)
    assert any(jax.tree.leaves(changed))


def _docs_example(tmp_path) -> str:
    """The custom environment of docs/envs.md, written to a file -> its env name."""
    docs = os.path.join(os.path.dirname(os.path.dirname(TEST_ENVS)), "docs", "envs.md")
    with open(docs, encoding="utf-8") as f:
        text = f.read()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert 15 <= len(code.strip().splitlines()) <= 25
    path = tmp_path / "closer.py"
    path.write_text(code)
    return f"{path}:Closer"


def test_trainer_runs_the_docs_environment_on_the_mesh(tmp_path):
    """Two GRPO steps with the docs' example environment on the 8-device mesh: the turn
    schedule allows 1 turn at step 0 and 2 from step 1; env metrics are logged and
    samples.jsonl holds whole trajectories turn by turn."""
    from tiny_run import make_model_dir, tiny_config

    from jaxrl_llm import train
    from jaxrl_llm.trainer import metrics

    c = tiny_config(make_model_dir(str(tmp_path / "model")))
    c.rewards = {}
    c.env.name = _docs_example(tmp_path)
    c.env.options = {"tries": 3}
    c.env.max_turns = "1@0,2@1"
    c.env.max_total_tokens = 24
    c.env.workers = 1
    c.rollout.cache_segments = 1  # one decode loop body per program: shorter compiles
    c.model.scan_layers = True  # likewise
    c.algo.beta = 0.0  # no reference program to compile
    c.train.print_samples_every = 1
    train.train(c, str(tmp_path / "run"))
    rows = metrics.read_metrics(tmp_path / "run" / "metrics.jsonl")
    first, second = (r for r in rows if "env/turns_mean" in r)
    assert first["env/turns_mean"] == 1.0 and 1.0 < second["env/turns_mean"] <= 2.0
    assert second["env/obs_tokens"] > 0 and first["env/errors"] == second["env/errors"] == 0
    assert np.isfinite(second["loss/total"])
    samples = metrics.read_metrics(tmp_path / "run" / "samples.jsonl")
    multi = [s for s in samples if len(s["turns"]) > 1]
    assert multi and [t["role"] for t in multi[0]["turns"]][:3] == ["model", "env", "model"]
    assert multi[0]["completion"] == "".join(t["text"] for t in multi[0]["turns"])


def test_env_evaluation_plays_greedy_trajectories(tmp_path, tok):
    """Held-out evaluation of an environment run: eval/pass@1 is the share of greedy
    trajectories the environment scores correct, here one turn of odd length in
    characters, which a plain greedy `Sampler.sample` of the same prompts reproduces."""
    from tiny_run import tiny_config

    from jaxrl_llm import assets
    from jaxrl_llm.rollout import evaluation
    from jaxrl_llm.rollout.played import EnvRollout

    c = tiny_config(assets.QUICKSTART_MODEL)  # trained: greedy answers of varied lengths
    c.data.name = "arithmetic/digits_2"
    c.env.name, c.env.max_turns, c.env.workers = f"{TEST_ENVS}:OddLength", 1, 1
    c.env.max_total_tokens = 24
    c.eval.split, c.eval.num_prompts = "test", 16
    cfg, params = models.load_hf(c.model.path)
    spec = sampling.RolloutSpec(4, c.rollout.max_new_tokens, 1.0, stop_ids=(tok.eos_token_id,))
    sampler = sampling.Sampler(cfg, None, seed=0, cache_segments=1)
    batches = evaluation.held_out_batches(c, tok, 8)
    env_rollout = EnvRollout(c, tok, sampler, spec)
    try:
        got = env_rollout.evaluate(params, batches, pass_k=2, temperature=1.0)
    finally:
        env_rollout.close()
    greedy = spec.replace(num_generations=1, temperature=0.0)
    hits = []
    for i, batch in enumerate(batches):
        out = sampler.sample(params, batch.prompt_ids, batch.prompt_mask, greedy, i)
        for row, n in zip(np.asarray(out.tokens), np.asarray(out.lengths), strict=True):
            hits.append(len(tok.decode(row[:n], skip_special_tokens=True)) % 2 == 1)
    assert got["eval/num_prompts"] == 16 and 0 < np.mean(hits) < 1
    assert got["eval/pass@1"] == np.mean(hits) == got["eval/reward_mean"]  # a 0/1 reward
    assert got["eval/turns_mean"] == 1.0 and got["eval/pass@2"] >= 0.0


@pytest.mark.slow
def test_calculator_demo_learns_to_call_its_tool(tmp_path):
    """configs/calculator_tiny.py shortened to 20 steps: held-out greedy trajectories
    call the calculator more often and answer right more often than the shipped model
    (docs/envs.md: 0.25 -> 0.45 calls, pass@1 0.16 -> 0.33 at step 20)."""
    import importlib.util

    from jaxrl_llm import train
    from jaxrl_llm.trainer import metrics

    path = os.path.join(os.path.dirname(TEST_ENVS), "..", "configs", "calculator_tiny.py")
    spec = importlib.util.spec_from_file_location("calculator_tiny", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.train.num_steps, c.eval.every, c.train.print_samples_every = 20, 20, 0
    c.logging.tensorboard = False
    train.train(c, str(tmp_path))
    first, last = (
        r for r in metrics.read_metrics(tmp_path / "metrics.jsonl") if "eval/pass@1" in r
    )
    assert (first["step"], last["step"]) == (0, 20)
    assert last["eval/tool_calls"] >= first["eval/tool_calls"] + 0.1, (first, last)
    assert last["eval/pass@1"] >= first["eval/pass@1"] + 0.05, (first, last)
