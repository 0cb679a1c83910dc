"""Judge reward entries: a model on the mesh whose verdicts are known gives the expected
rewards through the trainer, an unparsable verdict costs that sample's term and is
counted, and each judge samples once per scoring call.

The judge is constructed so that its greedy output is determined: every layer's output
projections are zero (the residual stream is the token's embedding), the embeddings are
one-hot and the output head maps each token to one next token (`NEXT`). So a verdict is
the chain NEXT[last prompt token], NEXT[that], ... up to EOS, simulated here on the host:
a completion ending in the marker '7' gets "1", one ending in '5' gets "+" (unparsable),
one ending in '0', '1' or '+' an empty verdict (unparsable), anything else "0".
"""

import jax
import numpy as np
import pytest
from tiny_run import TOKENIZER, make_model_dir, tiny_config, tiny_model_config

from jaxrl_llm import config, models
from jaxrl_llm.startup.precompile import precompile_step
from jaxrl_llm.trainer.run import Run
from jaxrl_llm.verifiers import judge as J

V = 33
EOS = 2
ID = {ch: i for i, ch in enumerate("0123456789", start=4)} | {"+": 14, "#": 24}
NEXT = {t: ID["0"] for t in range(V)}
NEXT.update({ID["7"]: ID["1"], ID["1"]: EOS, ID["5"]: ID["+"], ID["+"]: EOS, ID["0"]: EOS})
TEMPLATE = "{question}#{completion}"
BUDGET = 4


def _judge_dir(path):
    cfg = tiny_model_config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=64,
        head_dim=16,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    )
    p = jax.tree.map(np.asarray, models.init_params(cfg, seed=3))
    p["layers"]["o"] = np.zeros_like(p["layers"]["o"])
    p["layers"]["down"] = np.zeros_like(p["layers"]["down"])
    p["final_norm"] = np.ones_like(p["final_norm"])
    p["embed"] = np.eye(V, 64, dtype=p["embed"].dtype)
    head = np.zeros((64, V), p["lm_head"].dtype)
    for t, nxt in NEXT.items():
        head[t, nxt] = 10.0
    p["lm_head"] = head
    models.save_hf(cfg, jax.tree.map(jax.numpy.asarray, p), path, tokenizer_dir=TOKENIZER)
    return path


def _expected(tokenizer, completion, example, prompt):
    """(score, error?) of the constructed judge, by following NEXT on the host."""
    text = J.render(TEMPLATE, completion, example, prompt, {})
    token, verdict = tokenizer(text)["input_ids"][-1], []
    for _ in range(BUDGET):
        token = NEXT[token]
        if token == EOS:
            break
        verdict.append(token)
    try:
        return J.parse_verdict(tokenizer.decode(verdict), "number"), False
    except ValueError:
        return 0.0, True


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge")
    return make_model_dir(str(root / "student")), _judge_dir(str(root / "judge"))


def _config(student, judge, **options):
    c = tiny_config(student, beta=0.0)
    c.rewards = {
        "format": {"weight": 1.0, "options": {"pattern": "[0-9].*"}},
        "judge": {
            "name": "judge",
            "weight": 0.5,
            "options": {
                "model": judge,
                "template": TEMPLATE,
                "parser": "number",
                "max_new_tokens": BUDGET,
                **options,
            },
        },
    }
    return c


@pytest.mark.parametrize("mode", ["sync", "overlap", pytest.param("split", marks=pytest.mark.slow)])
def test_judge_rewards_through_the_trainer(dirs, tmp_path, mode):
    """Every rollout mode: sync and overlap score in the step, on the one mesh; split on
    the rollout thread, with the judge on the rollout mesh. The judge's sampler is
    compiled ahead of the first step, at the one width every step's prompts pad to."""
    student, judge = dirs
    c = _config(student, judge)
    c.rollout.mode = mode
    if mode == "split":  # training mesh 4 devices (fsdp 2 x tensor 2), rollout mesh 4
        c.mesh.fsdp, c.mesh.tensor, c.mesh.rollout_devices = -1, 2, 4
    run = Run.build(c, str(tmp_path))
    run.compile_log.listen()
    try:
        (j,) = run.judges
        assert j.sampler.mesh is run.sampling.rollout_mesh
        precompile_step(run, side_by_side=False)
        (ahead,) = [p for p in run.compile_log.programs if p.name == j.name]
        assert ahead.compiles >= 1 and ahead.detail == f"bucket {j.width}"
        seen = {"errors": 0, "marked": 0, "rows": 0}
        for step in range(2):
            scored = run.step(step).scored
            # One batched sampler call per step (the rollout thread may score ahead).
            assert j.calls == step + 1 or (mode == "split" and j.calls >= step + 1)
            rows = zip(scored.completions, scored.examples, scored.prompts, strict=True)
            want = [_expected(j.tokenizer, c, ex, p) for c, ex, p in rows]
            scores = np.array([w[0] for w in want])
            errors = sum(w[1] for w in want)
            d = scored.details
            np.testing.assert_array_equal(d.per_verifier["judge"], scores)
            np.testing.assert_allclose(
                scored.rewards, d.per_verifier["format"] + 0.5 * scores, rtol=1e-6
            )
            assert d.errors["judge"] == d.failed["judge"] == errors
            if errors:
                assert d.first_error.startswith("judge sample ")
                assert "unparsable verdict" in d.first_error
            seen["errors"] += errors
            seen["marked"] += int((scores == 1.0).sum())
            seen["rows"] += len(scores)
        # The random student's completions exercise every branch of the judge.
        assert seen["errors"] > 0 and seen["marked"] > 0, seen
        assert seen["errors"] + seen["marked"] < seen["rows"], seen
        # The steps' judge calls compiled nothing: the one record is the ahead build.
        assert [p for p in run.compile_log.programs if p.name == j.name] == [ahead]
    finally:
        run.compile_log.close()
        run.close()
    assert j.calls == run.sampling.scorer.calls  # one per scoring call, ahead ones too


@pytest.mark.parametrize(
    "text,parser,value",
    [
        ("yes, it is", "yes_no", 1.0),
        (" No.", "yes_no", 0.0),
        ("score: -2.5/10", "number", -2.5),
        ("[[7]] ok", r"regex:\[\[(\d+)\]\]", 7.0),
        ("1e3", "number", 1000.0),
    ],
)
def test_parse_verdict(text, parser, value):
    assert J.parse_verdict(text, parser) == value


@pytest.mark.parametrize(
    "text,parser", [("maybe", "yes_no"), ("none", "number"), ("[[x]]", r"regex:\[\[(\d+)\]\]")]
)
def test_unparsable_verdict_raises(text, parser):
    with pytest.raises(ValueError, match="unparsable verdict"):
        J.parse_verdict(text, parser)


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(template="{question}"), "must contain {completion}"),
        (dict(template="{completion}{bogus}"), "unknown field {bogus}"),
        (dict(parser="xml"), "parser='xml'"),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (dict(temperature=-1.0), "temperature=-1.0"),
        (dict(prompt_len=-1), "prompt_len=-1"),
        (dict(prompt_len=300), "prompt_len=300 \\+ max_new_tokens=4 exceeds the judge model"),
    ],
)
def test_judge_options_are_checked(dirs, options, match):
    student, judge = dirs
    with pytest.raises(config.ConfigError, match=match) as err:
        config.prepare(_config(student, judge, **options), devices=jax.devices())
    assert "\n" not in str(err.value) and str(err.value).startswith("rewards.judge.options")


def test_a_judge_prompt_past_its_context_names_the_judge(dirs):
    """A judge prompt longer than the judge model's context (256 positions here) is one
    line naming the judge entry and its template, not the sampler's length error."""
    from jaxrl_llm import parallel, verifiers
    from jaxrl_llm.trainer.judges import make_judges

    student, judge = dirs
    specs = verifiers.parse_specs(_config(student, judge).rewards)
    mesh = parallel.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    (scorer,) = make_judges(specs, mesh)
    with pytest.raises(
        ValueError,
        match=r"^rewards\.judge: a judge prompt of \d+ tokens .* "
        r"max_position_embeddings 256; shorten rewards\.judge"
        r"\.options\.template",
    ):
        scorer(["9" * 300], [{"question": "1"}], ["1"])
