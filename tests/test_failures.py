"""Failures a user can fix, through the trainer: one line at the real command line, one
trainer per workdir, config changes on resume, rewards that always fail, bad data found
before the model loads. The library pieces have their own tests (test_errors.py,
test_workdir.py, test_verifier_faults.py, test_data_checks.py, test_checkpoint_faults.py)."""

import json
import os
import subprocess
import sys
import time

import pytest
from tiny_run import make_model_dir, tiny_config

from jaxrl_llm import data, models, train, verifiers
from jaxrl_llm.errors import UserError
from jaxrl_llm.trainer import workdir
from jaxrl_llm.trainer.metrics import read_metrics

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TINY = os.path.join(HERE, "tiny_run.py")
NEEDS_ANSWER = os.path.join(HERE, "data", "verifier_with_options.py") + ":needs_answer"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("tiny_model")))


def _trainer(model_dir, *args, **popen):
    env = dict(os.environ, TINY_MODEL_DIR=model_dir, PYTHONPATH=REPO, JAXRL_LLM_TCMALLOC="0")
    cmd = [sys.executable, "-m", "jaxrl_llm.train", *args]
    return subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    )


def _one_error_line(proc, timeout=240) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 2, (proc.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def typo_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("configs") / "typo.py"
    path.write_text(
        f"import sys\nsys.path.insert(0, {HERE!r})\nfrom tiny_run import get_config as base\n\n\n"
        "def get_config():\n    c = base()\n    c.rollout.batchsize = 16\n    return c\n"
    )
    return str(path)


@pytest.mark.parametrize(
    "args,expected",
    [
        (
            ["--config=typo"],
            "error: rollout.batchsize: unknown key; did you mean rollout.batch_size?",
        ),
        (
            ["--config.rollout.num_generations=1"],
            "error: rollout.num_generations=1: algo.advantage='grpo'",
        ),
        (["--config.algo.name=grpoo"], "error: algo.name='grpoo': unknown preset"),
        (["--config.algo.beta=-1.0"], "error: algo.beta=-1.0: must be >= 0"),
        (["--config.rollout.batch_size=0"], "error: rollout.batch_size=0: must be >= 1"),
        (
            ["--config.model.path=/nonexistent/model"],
            "error: model.path='/nonexistent/model': no config.json",
        ),
        (["--config=/nonexistent/config.py"], "/nonexistent/config.py"),
        (["--workdir=FILE"], "a file"),
    ],
    ids=["typo_in_file", "G=1", "algo", "beta", "batch", "model_path", "no_config", "workdir_file"],
)
def test_command_line_errors_are_one_line(model_dir, tmp_path, typo_config, args, expected):
    """`python -m jaxrl_llm.train` with a fixable mistake: exit 2, one line `error: <key or
    file>: ...`, no traceback, before any model is loaded."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    argv = {"--config": TINY, "--workdir": str(tmp_path / "run")}
    for arg in args:
        key, _, value = arg.partition("=")
        value = {"typo": typo_config, "FILE": str(a_file)}.get(value, value)
        if key in argv:
            argv[key] = value
        else:
            argv[arg] = None
    line = _one_error_line(
        _trainer(model_dir, *(k if v is None else f"{k}={v}" for k, v in argv.items()))
    )
    assert expected in line, line
    if "--workdir" in args[0]:
        assert str(a_file) in line


def test_a_second_trainer_on_a_workdir_names_the_first(model_dir, tmp_path):
    """Two trainers on one workdir: the second exits at once with one line naming the
    first's pid and host; after the first is killed (-9) the workdir is free again."""
    run = str(tmp_path / "run")
    first = _trainer(
        model_dir, f"--config={TINY}", f"--workdir={run}", "--config.train.num_steps=1000"
    )
    try:
        deadline = time.monotonic() + 180
        while workdir.holder(run, wait_s=0) is None:
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the first trainer never took the workdir"
            time.sleep(0.5)
        second = _trainer(model_dir, f"--config={TINY}", f"--workdir={run}")
        line = _one_error_line(second, timeout=120)
        assert f"in use by another trainer (pid {first.pid} on {os.uname().nodename}" in line
    finally:
        first.kill()
        first.wait()
    with workdir.lock(run):  # kill -9 left no stale lock
        pass


def test_resume_with_a_changed_config(model_dir, tmp_path):
    """A rerun that changes what the run means is refused, naming the keys; allowed, it
    resumes and lists them; every start's config is kept; no step is logged twice."""
    run = str(tmp_path / "run")
    c = tiny_config(model_dir)
    c.train.num_steps = 1
    train.train(c, run)
    c.train.num_steps = 2
    c.optim.learning_rate, c.rollout.batch_size = 3e-3, 8
    with pytest.raises(UserError) as err:
        train.train(c, run)
    message = str(err.value)
    assert message.startswith(os.path.join(run, "config.json"))
    assert (
        "optim.learning_rate: 0.001 -> 0.003" in message and "rollout.batch_size: 4 -> 8" in message
    )
    assert "\n" not in message
    c.train.allow_config_change = True
    train.train(c, run)
    assert [m["step"] for m in read_metrics(os.path.join(run, "metrics.jsonl"))] == [1, 2]
    assert len(workdir.history(run)) == 2  # the two configs the run was started with
    saved = workdir.read_config(run)
    assert saved["optim"]["learning_rate"] == 3e-3 and os.path.isabs(saved["model"]["path"])


def test_rewards_that_always_fail_stop_the_run(model_dir, tmp_path, capsys, monkeypatch):
    """Every reward call raising (the rows reach the verifier without the field it reads):
    a warning line at each failed step, then the run stops with the first error, not
    rc 0 with reward 0 at every step."""
    c = tiny_config(model_dir)
    c.rewards = {"needs_answer": {"name": NEEDS_ANSWER, "weight": 1.0}}
    c.train.num_steps, c.train.max_failed_steps = 5, 2
    original = verifiers.VerifierPool.score

    def without_answer(self, specs, completions, examples, **kw):
        examples = [{"question": e["question"]} for e in examples]
        return original(self, specs, completions, examples, **kw)

    monkeypatch.setattr(verifiers.VerifierPool, "score", without_answer)
    with pytest.raises(verifiers.VerifierFailure) as err:
        train.train(c, str(tmp_path / "run"))
    assert str(err.value).startswith("rewards.needs_answer: ")
    assert "KeyError" in str(err.value) and "2 steps in a row" in str(err.value)
    # Numbered as metrics.jsonl numbers the step (its first record is step 1).
    first = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))[0]
    assert f"warning: step {first['step']}: rewards.needs_answer:" in capsys.readouterr().err
    assert first["step"] == 1


def _jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def test_a_bad_jsonl_row_stops_before_the_model_loads(model_dir, tmp_path, monkeypatch):
    rows = [{"question": f"{i}+1", "answer": str(i + 1)} for i in range(40)]
    rows[29] = '{"question": "1+1", "answer": '  # line 30: malformed
    c = tiny_config(model_dir)
    c.data.source, c.data.path = "jsonl", _jsonl(tmp_path / "d.jsonl", rows)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(models, "load_hf", no_model)
    with pytest.raises(data.BadRow, match=r"d\.jsonl line 30"):
        train.train(c, str(tmp_path / "run"))


def test_skipped_rows_are_a_metric(model_dir, tmp_path):
    rows = [{"question": f"{i % 9}+1", "answer": str(i % 9 + 1)} for i in range(40)]
    rows[3] = {"answer": "7"}  # no question
    rows[17] = "not json"
    c = tiny_config(model_dir)
    c.data.source, c.data.path = "jsonl", _jsonl(tmp_path / "d.jsonl", rows)
    c.data.skip_bad_rows, c.train.num_steps = True, 4
    train.train(c, str(tmp_path / "run"))
    skipped = [m["data/skipped_rows"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert skipped[-1] >= 1 and skipped == sorted(skipped)
