"""MetricWriter files, resume, TensorBoard (read back by TensorBoard itself), W&B, plots."""

import json
import math
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.trainer import metrics
from jaxrl_llm.trainer.console import Progress
from jaxrl_llm.trainer.metrics import MetricWriter, plot_metrics, read_metrics


def _strict_lines(path):
    """Each line parsed by a JSON parser that refuses NaN/Infinity, as jq or JS would."""

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    with open(path) as f:
        return [json.loads(line, parse_constant=refuse) for line in f]


def test_records_are_strict_json_with_step_first(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False) as w:
        w.write(
            1,
            {
                "reward/mean": np.float32(0.25),
                "reward/std": jnp.float32(0.1),
                "loss/total": jnp.array(float("nan")),
                "loss/grad_norm": float("inf"),
                "rollout/tokens": jnp.int32(1200),
                "eval/name": "gsm8k",
            },
        )
        w.write_samples(1, [{"prompt": "1+1=", "completion": "2", "reward": np.float64(1.0)}])
    [record] = _strict_lines(tmp_path / "metrics.jsonl")
    assert list(record) == [
        "step",
        "reward/mean",
        "reward/std",
        "loss/total",
        "loss/grad_norm",
        "rollout/tokens",
        "eval/name",
    ]
    assert record["step"] == 1 and record["reward/mean"] == 0.25
    assert record["reward/std"] == 0.1  # not 0.10000000149011612: float32's own precision
    assert record["loss/total"] is None and record["loss/grad_norm"] is None
    assert record["rollout/tokens"] == 1200 and isinstance(record["rollout/tokens"], int)
    [back] = read_metrics(tmp_path / "metrics.jsonl")
    assert math.isnan(back["loss/total"]) and back["eval/name"] == "gsm8k"
    assert _strict_lines(tmp_path / "samples.jsonl") == [
        {"step": 1, "prompt": "1+1=", "completion": "2", "reward": 1.0}
    ]


def test_bad_values_are_refused_by_name(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False) as w:
        with pytest.raises(ValueError, match="'loss/vec'.*shape \\(3,\\)"):
            w.write(1, {"loss/vec": np.ones(3)})
        with pytest.raises(ValueError, match="'step' is reserved"):
            w.write(1, {"step": 3})


def _write_steps(tmp_path, steps, scale, resume_step):
    with MetricWriter(tmp_path, resume_step=resume_step) as w:
        for s in steps:
            w.write(s, {"reward/mean": scale * s})
            w.write_samples(s, [{"prompt": "p", "completion": f"c{s}", "reward": 0.0}])


def test_resume_drops_the_steps_that_are_done_again(tmp_path):
    _write_steps(tmp_path, range(1, 6), 1.0, resume_step=None)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "reward/me')  # killed mid-line
    _write_steps(tmp_path, [4, 5], 10.0, resume_step=3)  # resumed from the step-3 checkpoint
    got = [(r["step"], r["reward/mean"]) for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert got == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    samples = [(r["step"], r["completion"]) for r in read_metrics(tmp_path / "samples.jsonl")]
    assert samples == [(1, "c1"), (2, "c2"), (3, "c3"), (4, "c4"), (5, "c5")]

    # The reader the TensorBoard server uses hides the first attempt's steps 4-5 the same way.
    from tensorboard.backend.event_processing import plugin_event_accumulator
    from tensorboard.util import tensor_util

    acc = plugin_event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    scalars = [
        (e.step, float(tensor_util.make_ndarray(e.tensor_proto)))
        for e in acc.Tensors("reward/mean")
    ]
    assert scalars == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    text = tensor_util.make_ndarray(acc.Tensors("samples")[-1].tensor_proto).item().decode()
    assert text.splitlines()[0] == "| prompt | completion | reward |" and "| p | c5 | 0.0 |" in text

    _write_steps(tmp_path, [1], 7.0, resume_step=None)  # no checkpoint: a new run
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]
    acc = plugin_event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [
        (e.step, float(tensor_util.make_ndarray(e.tensor_proto)))
        for e in acc.Tensors("reward/mean")
    ] == [(1, 7.0)]


def _step_keys(path):
    """[(step, key)] of every value in a metrics file, in file order."""
    return [(r["step"], k) for r in read_metrics(path) for k in r if k != "step"]


def test_no_step_is_written_twice_across_resumes(tmp_path):
    """A run that logged steps 1-7 (eval at 6) died before its step-7 checkpoint; the last
    checkpoint is 5. Resumes redo 6-7, then one resumes from an older checkpoint (3) whose
    newer ones were deleted, and one finds a complete record that lost its newline."""
    path = tmp_path / "metrics.jsonl"
    with MetricWriter(tmp_path, tensorboard=False) as w:
        for s in range(1, 8):
            w.write(s, {"reward/mean": s})
            if s == 6:
                w.write(s, {"eval/pass@1": 0.5})
    with MetricWriter(tmp_path, tensorboard=False, resume_step=5) as w:
        for s in (6, 7, 8):
            w.write(s, {"reward/mean": 10 * s})
    with MetricWriter(tmp_path, tensorboard=False, resume_step=3) as w:
        w.write(4, {"reward/mean": 400})
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": 5, "reward/mean": 500}))  # killed before its newline
    with MetricWriter(tmp_path, tensorboard=False, resume_step=5) as w:
        w.write(6, {"reward/mean": 600})
    keys = _step_keys(path)
    assert len(keys) == len(set(keys))
    got = [(r["step"], r["reward/mean"]) for r in read_metrics(path)]
    assert got == [(1, 1), (2, 2), (3, 3), (4, 400), (5, 500), (6, 600)]
    assert path.read_text().endswith("}\n") and path.read_text().count("\n") == 6


def test_only_process_zero_writes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with MetricWriter(tmp_path / "run") as w:
        w.write(1, {"reward/mean": 1.0})
        w.write_samples(1, [{"prompt": "p"}])
    assert not (tmp_path / "run").exists()
    bar = Progress(10)
    bar.update(3, reward=0.5)
    bar.write("not shown")
    bar.close()
    assert capsys.readouterr().err == ""


def test_missing_packages_warn_once_and_carry_on(tmp_path, monkeypatch, caplog):
    for name in (
        "wandb",
        "tensorboard.compat.proto",
        "tensorboard.summary.writer.event_file_writer",
    ):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    with MetricWriter(tmp_path, tensorboard=True, wandb=True) as w:
        w.write(1, {"reward/mean": 1.0})
        w.write(2, {"reward/mean": 2.0})
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2
    assert any("`tensorboard` package is not installed" in m for m in warnings)
    assert any("`wandb` package is not installed" in m for m in warnings)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert not (tmp_path / "tensorboard").exists()


def _fake_wandb(calls):
    run = types.SimpleNamespace(
        log=lambda data, step: calls.append(("log", step, data)),
        finish=lambda: calls.append(("finish",)),
    )

    def init(**kw):
        calls.append(("init", kw))
        return run

    ids = iter(["id-a", "id-b"])
    return types.SimpleNamespace(
        init=init,
        Table=lambda columns, data: ("table", columns, data),
        util=types.SimpleNamespace(generate_id=lambda: next(ids)),
    )


def test_wandb_logs_and_resumes_the_same_run(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    config = {"algo": {"beta": 0.0}}
    for resume_step in (None, 3):
        with MetricWriter(
            tmp_path, config, tensorboard=False, wandb=True, resume_step=resume_step, run_name="r"
        ) as w:
            w.write(4, {"reward/mean": 0.5, "eval/name": "x"})
            w.write_samples(4, [{"prompt": "p", "completion": "c", "reward": 1.0}])
    inits = [c[1] for c in calls if c[0] == "init"]
    assert [i["id"] for i in inits] == ["id-a", "id-a"]  # the resumed run appends
    assert (
        inits[0]["project"] == "jaxrl_llm"
        and inits[0]["config"] == config
        and inits[0]["name"] == "r"
    )
    logs = [c for c in calls if c[0] == "log"]
    assert logs[0] == ("log", 4, {"reward/mean": 0.5})  # strings stay out of W&B charts
    assert logs[1] == (
        "log",
        4,
        {"samples": ("table", ["completion", "prompt", "reward"], [["c", "p", 1.0]])},
    )
    assert calls.count(("finish",)) == 2


def test_plot_writes_a_png_of_the_curves(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    with MetricWriter(tmp_path, tensorboard=False) as w:
        for s in range(1, 6):
            w.write(s, {"reward/mean": s / 5})
            if s % 2 == 0:
                w.write(s, {"eval/pass@1": s / 10})
    out = tmp_path / "curve.png"
    metrics.main(["plot", f"--metrics={path}", f"--out={out}"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "reward/mean, eval/pass@1" in capsys.readouterr().out
    with pytest.raises(
        ValueError, match=r"none of \['loss/x'\] found; keys: \['eval/pass@1', 'reward/mean'\]"
    ):
        plot_metrics(path, out, keys=["loss/x"])


def test_the_evaluation_loop_is_a_plain_loop_over_rows():
    """`evaluation.run` with a play of known rows: batch i is drawn greedily with key i,
    then pass_k rows per prompt with key EVAL_KEY_OFFSET + step * batches + i; pass@1,
    pass@k and each value's mean over every greedy row are what a plain loop gives."""
    from jaxrl_llm import sampling
    from jaxrl_llm.rollout import evaluation

    rng = np.random.default_rng(0)
    sizes, pass_k, step = (3, 5), 4, 7
    calls, drawn = [], {}

    def play(batch, spec, key):
        calls.append((batch, spec.num_generations, spec.temperature, key))
        rows = batch * spec.num_generations
        drawn[key] = (rng.random(rows), rng.integers(1, 9, rows))
        return drawn[key][0], {"length_mean": drawn[key][1]}

    spec = sampling.RolloutSpec(num_generations=8, max_new_tokens=4, temperature=0.7)
    got = evaluation.run(play, sizes, spec, pass_k=pass_k, temperature=1.0, step=step)
    offset = evaluation.EVAL_KEY_OFFSET
    assert calls == [
        (3, 1, 0.0, 0),
        (3, pass_k, 1.0, offset + step * 2 + 0),
        (5, 1, 0.0, 1),
        (5, pass_k, 1.0, offset + step * 2 + 1),
    ]
    greedy = [drawn[0], drawn[1]]
    scores = [s for g in greedy for s in g[0]]
    lengths = [n for g in greedy for n in g[1]]
    hits = []
    for key in (offset + step * 2, offset + step * 2 + 1):
        for prompt in range(len(drawn[key][0]) // pass_k):
            hits.append(
                any(s > 0.5 for s in drawn[key][0][prompt * pass_k : (prompt + 1) * pass_k])
            )
    assert got == pytest.approx(
        {
            "eval/pass@1": sum(s > 0.5 for s in scores) / 8,
            "eval/num_prompts": 8.0,
            f"eval/pass@{pass_k}": sum(hits) / 8,
            "eval/length_mean": sum(lengths) / 8,
        }
    )
