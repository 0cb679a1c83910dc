"""The console: progress with a time estimate that leaves out the compiling steps, plain
lines in a log file, one line per evaluation, the closing summary. The trainer's own
console (eval lines, summary, a rerun of a finished run) is checked on the quickstart's
run in test_train.py."""

import numpy as np

from jaxrl_llm.trainer.console import Progress, eval_line, summary


def test_log_file_lines_estimate_from_recent_steps_not_compiles(capsys):
    bar = Progress(10, every_s=0.0, interactive=False)
    bar.update(1, step_s=100.0, reward=0.5)  # the first steps compile: left out
    bar.update(2, step_s=50.0)
    bar.update(3, step_s=2.0)
    bar.update(4, step_s=np.float32(1.0), reward=np.float32(0.25))
    bar.update(5, step_s=1.5)
    bar.write("[step 5] sample")
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "train step 1/10 | reward 0.5 | step_s 100"  # no estimate yet
    assert lines[2] == "train step 3/10 | step_s 2 | ~0:14 left"  # 7 steps x 2 s
    assert lines[3] == "train step 4/10 | reward 0.25 | step_s 1 | ~0:09 left"  # median 1.5
    assert lines[4] == "train step 5/10 | step_s 1.5 | ~0:08 left"
    assert lines[5] == "[step 5] sample" and len(lines) == 6


def test_log_file_lines_come_every_so_often_and_at_the_end(capsys):
    bar = Progress(3, every_s=3600.0, interactive=False)
    for step in (1, 2, 3):
        bar.update(step, step_s=1.0)
    assert capsys.readouterr().err.splitlines() == ["train step 3/3 | step_s 1"]


def test_terminal_bar_shows_step_values_and_time_left(capsys):
    bar = Progress(10, initial_step=2, interactive=True)
    for step in (3, 4, 5):
        bar.update(step, reward=0.123456, step_s=2.0)
    bar.write("[step 5] sample")
    bar.close()
    err = capsys.readouterr().err
    assert "5/10" in err and "reward=0.1235" in err and "left=~0:10" in err
    assert "[step 5] sample\n" in err


def test_eval_line_has_the_headline_metrics():
    ev = {
        "eval/pass@8": 0.640625,
        "eval/pass@1": 0.4921875,
        "eval/num_prompts": 256.0,
        "eval/length_mean": 3.2,
    }
    assert eval_line(50, ev) == "[eval step 50] pass@1 0.49 pass@8 0.64 (256 prompts)"
    agent = {"eval/pass@1": 0.5, "eval/reward_mean": 0.625, "eval/turns_mean": 1.5}
    assert eval_line(10, agent) == "[eval step 10] pass@1 0.50 reward 0.62 turns 1.50"


def test_summary_names_final_and_best_eval_and_the_next_commands():
    records = [
        {"step": 0, "eval/pass@1": 0.28},
        {"step": 5, "reward/mean": 0.4},
        {"step": 50, "eval/pass@1": 0.53},
        {"step": 100, "eval/pass@1": 0.53},
        {"step": 150, "eval/pass@1": 0.5},
    ]
    assert summary(records, 150, 3725.4, "/tmp/run") == [
        "done: 150 steps in 1:02:05; workdir /tmp/run",
        "eval/pass@1: final 0.50 (step 150), best 0.53 (step 50)",
        "plot:   python -m jaxrl_llm.trainer.metrics plot --metrics=/tmp/run/metrics.jsonl"
        " --out=curve.png",
        "export: python -m jaxrl_llm.export --workdir=/tmp/run --out=HF_DIR",
    ]
    assert len(summary([{"step": 1, "reward/mean": 0.1}], 1, 5.0, "/tmp/r")) == 3
