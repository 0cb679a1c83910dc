"""One line per failure at the command line: `format_error` on the exceptions users meet,
and `cli_main` through real command lines (`metrics plot`, `export`), with and without
`--debug`."""

import errno
import os
import subprocess
import sys

import pytest

from jaxrl_llm import config as config_lib
from jaxrl_llm import data, errors, models, sft
from jaxrl_llm.errors import UserError, format_error

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(args, tmp_path, extra_path=(), env=None):
    """Runs `python -m <args>` on this checkout's code; returns the CompletedProcess."""
    environ = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", **(env or {})}
    environ.pop(errors.DEBUG_ENV, None) if errors.DEBUG_ENV not in (env or {}) else None
    environ["PYTHONPATH"] = os.pathsep.join([*extra_path, REPO])
    return subprocess.run(
        [sys.executable, "-m", *args], env=environ, cwd=tmp_path, capture_output=True, text=True
    )


def one_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: ")
    return lines[0]


def test_user_error_formats_where_what_fix():
    err = UserError("data.path", "'x.jsonl' does not exist", "check the path")
    assert str(err) == "data.path: 'x.jsonl' does not exist; check the path"
    assert (err.where, err.what, err.fix) == (
        "data.path",
        "'x.jsonl' does not exist",
        "check the path",
    )
    assert str(UserError("a: b; c")) == "a: b; c"  # an already formatted line
    assert (
        format_error(UserError("k", "line one\nline two", "fix"))
        == "error: k: line one line two; fix"
    )


def test_the_errors_users_meet_are_user_errors_and_keep_their_old_types():
    for cls in (
        config_lib.ConfigError,
        data.BadRow,
        models.hf_io.CheckpointError,
        models.hf_config.UnsupportedModelError,
    ):
        err = cls("rollout.batch_size=0: must be >= 1")
        assert isinstance(err, UserError) and isinstance(err, ValueError), cls
        assert format_error(err) == "error: rollout.batch_size=0: must be >= 1"
    assert sft.config.ConfigError is config_lib.ConfigError  # one config error for RL and SFT


def test_os_errors_name_the_path_and_the_fix(tmp_path):
    missing = FileNotFoundError(errno.ENOENT, "No such file or directory", "/no/such.jsonl")
    assert (
        format_error(missing) == "error: /no/such.jsonl: no such file or directory; check the path"
    )
    denied = PermissionError(errno.EACCES, "Permission denied", "/root/x")
    assert format_error(denied).startswith("error: /root/x: permission denied; ")
    readonly = OSError(errno.EROFS, "Read-only file system", "/mnt/ro/run")
    assert format_error(readonly).startswith("error: /mnt/ro/run: read-only file system; ")
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ckpt"))
    line = format_error(full)
    assert line.startswith(f"error: {tmp_path / 'ckpt'}: no space left on device (")
    assert " free); free some space or use a larger disk" in line
    # Our own messages, without a filename attribute, pass through as written.
    ours = FileNotFoundError("data.path: JSONL file 'a.jsonl' does not exist")
    assert format_error(ours) == "error: data.path: JSONL file 'a.jsonl' does not exist"


def test_library_failures_become_one_line():
    config_file = OSError(
        "Configuration is not available because of an earlier failure to load: Failed "
        "loading config file config_config\n  Attempted [Relative path]:\n    /no/cfg.py\n"
        "      [Errno 2] No such file or directory: '/no/cfg.py'"
    )
    assert format_error(config_file) == (
        "error: --config: /no/cfg.py: [Errno 2] No such file or directory: '/no/cfg.py'; "
        "check the path and that the file defines get_config()"
    )
    with pytest.raises(SyntaxError) as syntax:
        compile("def get_config(:\n", "/cfg/bad.py", "exec")
    assert format_error(syntax.value) == "error: /cfg/bad.py line 1: invalid syntax; fix the file"
    missing = ModuleNotFoundError("No module named 'wandb'", name="wandb")
    assert format_error(missing) == "error: wandb: python package not installed; pip install wandb"
    oom = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.0GiB\nmore")
    assert format_error(oom).startswith("error: device out of memory (RESOURCE_EXHAUSTED: Out of")
    assert "rollout.batch_size" in format_error(oom)
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = LocalEntryNotFoundError(
        "Got: ConnectError: [Errno -2] Name or service not known\nAn error happened while "
        "trying to locate the files on the Hub."
    )
    assert format_error(offline) == (
        "error: Hugging Face hub: Got: ConnectError: [Errno -2] Name or service not known An "
        "error happened while trying to locate the files on the Hub.; check the network and "
        "the model name, or give a local model directory"
    )
    bug = KeyError("params")
    assert format_error(bug) == (
        "error: KeyError: 'params' (unexpected; rerun with --debug for the traceback)"
    )
    assert format_error(ValueError("first\n  second")) == "error: first"
    assert format_error(KeyboardInterrupt()).startswith("error: interrupted; ")


def test_metrics_plot_failures_are_one_line(tmp_path):
    proc = run_cli(
        ["jaxrl_llm.trainer.metrics", "plot", "--metrics=nope.jsonl", "--out=a.png"], tmp_path
    )
    assert proc.returncode == 2
    assert one_line(proc) == "error: nope.jsonl: no such file or directory; check the path"
    (tmp_path / "m.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    proc = run_cli(
        ["jaxrl_llm.trainer.metrics", "plot", "--metrics=m.jsonl", "--out=a.png", "--keys=x"],
        tmp_path,
    )
    assert proc.returncode == 2
    assert one_line(proc) == "error: m.jsonl: none of ['x'] found; keys: ['reward/mean']"
    args = [
        "jaxrl_llm.trainer.metrics",
        "plot",
        "--metrics=m.jsonl",
        "--out=no/dir/a.png",
        "--keys=reward/mean",
    ]
    assert one_line(run_cli(args, tmp_path)).startswith("error: no/dir/a.png: no such file")


def test_debug_flag_or_environment_shows_the_traceback(tmp_path):
    args = ["jaxrl_llm.trainer.metrics", "plot", "--metrics=nope.jsonl", "--out=a.png"]
    for proc in (
        run_cli([*args, "--debug"], tmp_path),
        run_cli(args, tmp_path, env={errors.DEBUG_ENV: "1"}),
    ):
        assert proc.returncode == 1
        assert "Traceback (most recent call last)" in proc.stderr
        assert proc.stderr.strip().endswith("No such file or directory: 'nope.jsonl'")


def test_plot_without_matplotlib_says_what_to_install(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "matplotlib.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'matplotlib'\")\n"
    )
    (tmp_path / "m.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    proc = run_cli(
        ["jaxrl_llm.trainer.metrics", "plot", "--metrics=m.jsonl", "--out=a.png"],
        tmp_path,
        [str(hide)],
    )
    assert proc.returncode == 2
    assert one_line(proc) == (
        'error: matplotlib: not installed (plotting needs it); pip install -e ".[plot]"'
    )


def test_export_of_a_missing_run_is_one_line(tmp_path):
    proc = run_cli(["jaxrl_llm.export", f"--workdir={tmp_path / 'nope'}", "--out=hf"], tmp_path)
    assert proc.returncode == 2
    assert one_line(proc) == (
        f"error: {tmp_path / 'nope' / 'config.json'}: not found; is --workdir a jaxrl_llm run "
        "directory?"
    )
    assert not (tmp_path / "hf").exists()


def test_overrides_of_the_wrong_type_are_one_line(tmp_path):
    """Issue 40 row 14: a value absl cannot parse is the `error:` line and exit 2, like a
    key typo, not absl's "FATAL Flags parsing error" and exit 1."""
    config = os.path.join(REPO, "configs", "quickstart.py")
    train = ["jaxrl_llm.train", f"--config={config}", f"--workdir={tmp_path / 'run'}"]
    cases = [
        (
            [*train, "--config.model.lora.rank=4.5"],
            "error: --config.model.lora.rank=4.5: invalid literal for int() with base 10: '4.5'",
        ),
        (
            [*train, "--config.rollout.batch_size=abc"],
            "error: --config.rollout.batch_size=abc: invalid literal for int() with base 10",
        ),
        (
            ["jaxrl_llm.export", "--workdir=w", "--out=o", "--lora=pefft"],
            "error: --lora=pefft: value should be one of <merged|peft>",
        ),
    ]
    for args, start in cases:
        proc = run_cli(args, tmp_path)
        assert proc.returncode == 2, proc.stderr[-2000:]
        line = one_line(proc)
        assert line.startswith(start) and line.endswith(
            "check the value and its type (--helpfull lists the flags)"
        )
    assert not (tmp_path / "run").exists()


def test_dotted_overrides_add_keys_to_free_form_sections():
    """`--config.agent.options.tries=2` and `--config.teacher.paths.math=...` (the docs'
    forms) add keys the config does not have to the sections whose keys the user names,
    in a locked config, with the value as a Python literal or else the string; every
    other override is left for ml_collections."""
    c = config_lib.base_config()
    c.lock()
    others = [
        "--config=configs/quickstart.py",
        "--workdir=/tmp/w",
        "--debug",
        "--config.agent.entry=a.py:run",
        "--config.env.options.a.b=1",
    ]
    rest, taken = errors.take_free_form(
        ["--config.agent.options.tries=2", "--config.teacher.paths.math=/models/math", *others]
    )
    errors.apply_free_form(c, taken)
    assert rest == others
    assert c.agent.options.tries == 2 and c.teacher.paths.math == "/models/math"


def test_workers_topology_for_a_config_without_workers_is_one_line(tmp_path):
    """--compile_workers_for reaches the compile-only run: a config with no rollout
    workers is told so in one line, before any chip is described."""
    config = os.path.join(REPO, "configs", "quickstart.py")
    args = ["jaxrl_llm.train", f"--config={config}", "--compile_for=v5e:2x2"]
    proc = run_cli([*args, "--compile_workers_for=v6e:1x1"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert one_line(proc) == (
        "error: --compile_workers_for=v6e:1x1: the config has no rollout workers "
        "(rollout.workers=0); set rollout.workers=N (docs/workers.md)"
    )
