"""The trainer end to end on a tiny model: every algorithm, exact resume, SIGTERM, export."""

import json
import os
import signal

import jax
import numpy as np
import pytest
import torch
import transformers
from tiny_run import make_model_dir, tiny_config

from jaxrl_llm import export, models, train
from jaxrl_llm.parallel import allocator
from jaxrl_llm.trainer import checkpoint
from jaxrl_llm.trainer.metrics import read_metrics


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("tiny_model")))


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("dr_grpo", marks=pytest.mark.slow),
        "dapo",
        pytest.param("gspo", marks=pytest.mark.slow),
        pytest.param("rloo", marks=pytest.mark.slow),
        pytest.param("reinforce_pp", marks=pytest.mark.slow),
        "ppo",
    ],
)
def test_every_algorithm_runs_two_steps(model_dir, tmp_path, name):
    """Each preset but GRPO (`tiny_config`'s, which the rest of this file runs)."""
    c = tiny_config(model_dir, name=name)
    if name == "ppo":
        c.rollout.num_generations = 1
        c.rollout.batch_size = 8
    last = train.train(c, str(tmp_path))
    logged = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in logged] == [1, 2]
    assert np.isfinite(last["loss/total"]) and "perf/step_s" in last
    assert last["optim/nonfinite"] == 0.0
    if name == "dapo":
        assert "rollout/degenerate_frac" in last
    if name == "ppo":
        assert "loss/value" in last


def test_release_memory_phases_returns_free_pages_before_each_phase(
    model_dir, tmp_path, monkeypatch
):
    """`train.release_memory="phases"`: the allocator's free pages go back before each
    rollout and each update (2 steps: 4 calls more than the default's)."""
    calls = {"n": 0}

    def count():
        calls["n"] += 1
        return True

    monkeypatch.setattr(allocator, "release_free_memory", count)
    counts = {}
    for mode in ("compiles", "phases"):
        calls["n"] = 0
        c = tiny_config(model_dir)
        c.train.release_memory = mode
        train.train(c, str(tmp_path / mode))
        counts[mode] = calls["n"]
    assert counts["phases"] == counts["compiles"] + 4


def test_gemma3_grpo_two_steps(tmp_path):
    """A tiny Gemma 3 (sliding window 4 < prompt + completion) through the trainer: the
    sampler, the reference (beta > 0) and the update read its layer pattern."""
    c = tiny_config(make_model_dir(str(tmp_path / "gemma3"), gemma3=True), beta=0.04)
    last = train.train(c, str(tmp_path / "run"))
    assert [m["step"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert np.isfinite(last["loss/total"]) and last["optim/nonfinite"] == 0.0
    assert np.isfinite(last["loss/kl"])  # the reference model ran


@pytest.mark.parametrize("name", ["grpo", pytest.param("ppo", marks=pytest.mark.slow)])
def test_bfloat16_model_trains_and_resumes(model_dir, tmp_path, name):
    """model.dtype=bfloat16 (the GPU / TPU configs): bf16 parameters with a float32 master
    copy and moments in the optimizer state (`rl.MasterWeights`), finite steps, and a
    checkpoint that resumes."""
    c = tiny_config(model_dir, name=name)
    c.model.dtype = "bfloat16"
    c.checkpoint.every = 1
    if name == "ppo":
        c.rollout.num_generations = 1
        c.rollout.batch_size = 8
    last = train.train(c, str(tmp_path))
    assert np.isfinite(last["loss/total"]) and last["optim/nonfinite"] == 0.0
    with checkpoint.Checkpointer(str(tmp_path / "checkpoints"), read_only=True) as ck:
        saved = ck.abstract_state()
    assert {x.dtype for x in jax.tree.leaves(saved["params"])} == {np.dtype("bfloat16")}
    opt_dtypes = {x.dtype for x in jax.tree.leaves(saved["opt_state"])}
    assert np.dtype("bfloat16") not in opt_dtypes and np.dtype("float32") in opt_dtypes
    c.train.num_steps = 3
    resumed = train.train(c, str(tmp_path))  # restores step 2, runs step 3
    assert np.isfinite(resumed["loss/total"]) and resumed["optim/nonfinite"] == 0.0
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_sigterm_and_resume_equal_a_straight_run(model_dir, tmp_path, monkeypatch):
    c = tiny_config(model_dir)  # grpo with a reference model: beta 0.04
    c.train.num_steps = 6
    c.checkpoint.every = 0  # only the SIGTERM and final saves
    straight = tmp_path / "straight"
    train.train(c, str(straight))

    resumed = tmp_path / "resumed"
    original_step = train.Run.step

    def step_then_sigterm(self, step):
        out = original_step(self, step)
        if step == 2:  # the third step: SIGTERM arrives while it runs
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(train.Run, "step", step_then_sigterm)
    train.train(c, str(resumed))
    with checkpoint.Checkpointer(str(resumed / "checkpoints"), read_only=True) as ck:
        assert ck.all_steps() == [3]  # saved on SIGTERM, then exited
    monkeypatch.setattr(train.Run, "step", original_step)
    train.train(c, str(resumed))  # the same command again: resumes at 3

    a, b = (read_metrics(d / "metrics.jsonl") for d in (straight, resumed))
    assert [m["step"] for m in b] == [1, 2, 3, 4, 5, 6]  # no duplicates across the resume
    for ma, mb in zip(a, b, strict=True):
        for k in ma:
            if not k.startswith("perf/"):
                np.testing.assert_allclose(mb[k], ma[k], rtol=1e-6, atol=1e-6, err_msg=k)
    sa, sb = (
        checkpoint.Checkpointer(str(d / "checkpoints"), read_only=True).restore(6)[0]
        for d in (straight, resumed)
    )
    for x, y in zip(jax.tree.leaves(sa["params"]), jax.tree.leaves(sb["params"]), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


def test_export_after_training_loads_in_transformers(model_dir, tmp_path):
    c = tiny_config(model_dir)
    workdir = tmp_path / "run"
    train.train(c, str(workdir))
    export.export(str(workdir), str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    cfg, params = models.load_hf(tmp_path / "hf")
    state, _ = checkpoint.Checkpointer(str(workdir / "checkpoints"), read_only=True).restore()
    trained = state["params"]
    for x, y in zip(jax.tree.leaves(trained), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ids = np.array([[5, 6, 14, 7, 18]])
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids)).logits.numpy()
    ours = np.asarray(models.logits(cfg, params, ids))
    assert np.abs(ours - ref).max() <= 1e-4
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").eos_token == "<eos>"
    with open(workdir / "config.json") as f:
        assert os.path.isabs(json.load(f)["model"]["path"])


def test_nonfinite_update_stops_naming_the_step(model_dir, tmp_path, monkeypatch):
    c = tiny_config(model_dir)
    from jaxrl_llm.rollout import scoring

    original = scoring.Scorer.__call__

    def nan_rewards(*args, **kwargs):
        scored = original(*args, **kwargs)
        scored.rewards[:] = np.nan
        return scored

    monkeypatch.setattr(scoring.Scorer, "__call__", nan_rewards)
    with pytest.raises(train.NonFiniteError, match=r"step 1: non-finite loss or gradient"):
        train.train(c, str(tmp_path / "stop"))
    c.train.skip_nonfinite = True
    last = train.train(c, str(tmp_path / "skip"))
    assert last["optim/nonfinite"] == 1.0


def test_quickstart_config_shortened(tmp_path, capsys):
    """configs/quickstart.py itself (shipped model, arithmetic data), for 2 steps; what
    its console shows in a log file; a rerun says it is already done."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "quickstart", os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.train.num_steps, c.eval.every, c.eval.num_prompts = 2, 2, 32
    c.rollout.batch_size, c.logging.tensorboard = 8, False
    c.train.print_samples_every = 2
    last = train.train(c, str(tmp_path))
    assert 0.0 <= last["eval/pass@1"] <= 1.0 and "eval/pass@8" in last
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in records][-1] == 2
    lines = capsys.readouterr().err.splitlines()
    evals = [m for m in records if "eval/pass@1" in m]
    assert [m["step"] for m in evals] == [0, 2]
    for m in evals:  # each evaluation in one line, as metrics.jsonl has it
        line = (
            f"[eval step {m['step']}] pass@1 {m['eval/pass@1']:.2f} pass@8 {m['eval/pass@8']:.2f}"
        )
        assert f"{line} ({int(m['eval/num_prompts'])} prompts)" in lines, lines
    assert len([x for x in lines if x.startswith("[step 2] reward ")]) == 1  # one sample line
    assert any(x.startswith("train step 2/2 | reward ") for x in lines)  # no bar redraws
    assert not any("\r" in x or "it/s" in x for x in lines)
    best = max(evals, key=lambda m: m["eval/pass@1"])
    summary = lines[lines.index(next(x for x in lines if x.startswith("done: 2 steps in "))) :]
    assert summary[0].endswith(f"; workdir {tmp_path}")
    assert summary[1] == (
        f"eval/pass@1: final {evals[-1]['eval/pass@1']:.2f} (step 2), "
        f"best {best['eval/pass@1']:.2f} (step {best['step']})"
    )
    assert summary[2].endswith(f"plot --metrics={tmp_path}/metrics.jsonl --out=curve.png")
    assert summary[3].endswith(f"export --workdir={tmp_path} --out=HF_DIR")

    # The rerun: one line, nothing loaded or compiled, the last metrics returned.
    again = train.train(c, str(tmp_path))
    err = capsys.readouterr().err
    assert err.startswith(f"already finished at step 2: {tmp_path} (to start fresh"), err
    assert len(err.splitlines()) == 1 and again["eval/pass@1"] == last["eval/pass@1"]
