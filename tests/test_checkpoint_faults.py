"""Stopping and failing while checkpointing: Ctrl-C once (save and stop) and twice (abort),
in process and through `python -m jaxrl_llm.train`; a disk that fills up mid-save."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import make_model_dir

from jaxrl_llm.trainer import checkpoint
from jaxrl_llm.trainer.checkpoint import Checkpointer, DiskFullError, install_sigterm_handler

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_first_ctrl_c_sets_the_flag_and_a_second_aborts(capfd):
    before = signal.getsignal(signal.SIGINT)
    flag = install_sigterm_handler()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.requested and flag.stop_at(7) and flag.reason == "SIGINT"
        assert "press Ctrl-C again to abort without saving" in capfd.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGINT) is before and not flag.installed


def test_sigterm_then_ctrl_c_aborts():
    flag = install_sigterm_handler()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.requested and flag.reason == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        flag.restore()


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs: a 4 MiB checkpoint cannot fit."""
    path = tmp_path / "disk"
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield path
    subprocess.run(["umount", str(path)], check=True)


def _big():
    return {"w": jax.random.normal(jax.random.key(0), (1024, 1024))}  # 4 MiB, incompressible


@pytest.mark.parametrize("async_save", [True, False])
def test_disk_full_is_one_error_and_the_last_checkpoint_survives(small_disk, capfd, async_save):
    ckpt = Checkpointer(small_disk / "ckpt", save_interval_steps=1, async_save=async_save)
    ckpt.save(1, {"w": jnp.arange(256.0)}, {"step": 1})
    ckpt.wait()
    with pytest.raises(DiskFullError) as err:
        ckpt.save(2, _big(), {"step": 2})
        ckpt.save(3, _big(), {"step": 3})  # an async failure surfaces at the next save...
        ckpt.wait()  # ...or here
    ckpt.wait()  # reported once; the trainer's cleanup goes on
    ckpt.close()
    message = str(err.value)
    assert message.startswith(f"{small_disk / 'ckpt'}: no space left on device while saving ")
    assert " free; the last complete checkpoint: step 1); free some space" in message
    assert "Traceback" not in capfd.readouterr().err  # orbax's per-thread reports are dropped
    with Checkpointer(small_disk / "ckpt", read_only=True) as reader:
        state, extra = reader.restore()
    assert extra == {"step": 1}
    np.testing.assert_array_equal(state["w"], np.arange(256.0))


_FILL = """
import sys
import jax
from jaxrl_llm.trainer.checkpoint import Checkpointer
from jaxrl_llm.errors import cli_main

def main():
    ckpt = Checkpointer(sys.argv[1], save_interval_steps=1)
    try:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": jax.random.normal(jax.random.key(step), (1024, 1024))})
    finally:
        ckpt.wait()
        ckpt.close()

cli_main(main)
"""


def _script(source: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Runs `source` in a fresh Python on one CPU device; its stdout and stderr kept."""
    env = {**os.environ, "PYTHONPATH": REPO, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_disk_full_at_the_command_line_is_one_line(small_disk):
    proc = _script(_FILL, str(small_disk / "ckpt"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: {small_disk / 'ckpt'}: no space left on device while ")


# A tensorstore future awaited on a loop that closes before the future completes: what a
# failed save leaves behind (its loop abandoned with writes in flight). Completing it makes
# tensorstore call the closed loop's call_soon_threadsafe, reported as unraisable.
_LATE_CALLBACK = """
import asyncio, sys
import tensorstore as ts
from jaxrl_llm.trainer.checkpoint import Checkpointer

Checkpointer(sys.argv[1], save_interval_steps=1).close()
promise, future = ts.Promise.new()
loop = asyncio.new_event_loop()

async def wait():
    await future

task = loop.create_task(wait())
loop.run_until_complete(asyncio.sleep(0.01))
loop.close()
promise.set_result(1)

class Other:
    def __del__(self):
        raise RuntimeError("other")

Other()
"""


def test_a_write_finishing_after_its_failed_save_prints_nothing(tmp_path):
    proc = _script(_LATE_CALLBACK, str(tmp_path / "ckpt"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Event loop is closed" not in proc.stderr
    assert "RuntimeError: other" in proc.stderr  # any other report still reaches the hook


def test_orbax_disk_full_texts_are_recognised():
    wrapped = ValueError(
        'RESOURCE_EXHAUSTED: Error writing "w/0.0" in OCDBT database at local file "/x/": '
        "Failed to write 1803989 bytes to file 11: No space left on device [os_error_code='28']"
    )
    assert checkpoint._disk_full(wrapped)
    try:
        try:
            raise OSError(122, "Disk quota exceeded")
        except OSError as quota:
            raise RuntimeError("save failed") from quota
    except RuntimeError as chained:
        assert checkpoint._disk_full(chained)
    assert not checkpoint._disk_full(ValueError("RESOURCE_EXHAUSTED: Out of memory"))


# ------------------------------------------------------------------ through the trainer
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("tiny_model")))


# The command line with the stop's wait for its save made slow: a second Ctrl-C sent once
# the first is answered lands during it however fast the tiny run saves (without it, the
# run could finish its save and exit 0 before the test's second press arrived).
_SLOW_STOP = """
import runpy, time
from jaxrl_llm.trainer.checkpoint import Checkpointer
wait = Checkpointer.wait
def slow_wait(self):
    time.sleep(60)
    wait(self)
Checkpointer.wait = slow_wait
runpy.run_module("jaxrl_llm.train", run_name="__main__", alter_sys=True)
"""


def _train(model_dir, workdir, *overrides, slow_stop=False):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
        "TINY_MODEL_DIR": model_dir,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    cmd = [
        sys.executable,
        *(["-c", _SLOW_STOP] if slow_stop else ["-m", "jaxrl_llm.train"]),
        f"--config={os.path.join(REPO, 'tests', 'tiny_run.py')}",
        f"--workdir={workdir}",
        "--config.train.num_steps=1000",
        "--config.checkpoint.every=0",
        *overrides,
    ]
    # stderr to a file: `_interrupt_after` reads it while the trainer runs.
    with open(f"{workdir}.stderr", "w", encoding="utf-8") as stderr:
        return subprocess.Popen(cmd, env=env, stderr=stderr, stdout=subprocess.DEVNULL)


def _logged_steps(workdir) -> list[int]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["step"] for line in f if line.endswith("\n")]


def _interrupt_after(proc, workdir, steps: int, presses: int, timeout_s: float = 400):
    """Ctrl-C `presses` times once `steps` steps are logged -> the trainer's stderr. A
    press waits until the trainer has answered the one before: two SIGINTs that arrive
    while the main thread is inside one XLA call reach Python's handler once."""
    deadline = time.monotonic() + timeout_s

    def wait_for(done, what):
        while not done():
            assert proc.poll() is None, _stderr(workdir)[-3000:]
            assert time.monotonic() < deadline, f"the trainer did not {what} in time"
            time.sleep(0.01)

    try:
        wait_for(lambda: len(_logged_steps(workdir)) >= steps, "log")
        for press in range(presses):
            if press:
                wait_for(lambda: "press Ctrl-C again" in _stderr(workdir), "answer Ctrl-C")
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
    finally:
        proc.kill()
    return _stderr(workdir)


def _stderr(workdir) -> str:
    with open(f"{workdir}.stderr", encoding="utf-8") as f:
        return f.read()


def test_ctrl_c_saves_the_step_and_exits_cleanly(model_dir, tmp_path):
    workdir = str(tmp_path / "run")
    proc = _train(model_dir, workdir)
    err = _interrupt_after(proc, workdir, steps=2, presses=1)
    assert proc.returncode == 0, err[-3000:]
    logged = _logged_steps(workdir)
    with Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True) as ckpt:
        saved = ckpt.all_steps()
    assert "press Ctrl-C again to abort without saving" in err
    assert "Traceback" not in err, err[-3000:]
    assert saved == [logged[-1]] and logged == list(range(1, logged[-1] + 1))  # nothing lost


def test_a_ctrl_c_whose_handler_runs_inside_the_first_ones_aborts(monkeypatch):
    """Python may run a signal handler again before its first call returns: a second
    Ctrl-C handled while the first one's note is being written (after the user saw it)
    aborts, since the flag is set before the note goes out."""
    import types

    flag = checkpoint.PreemptionFlag()
    notes = []

    def write(fd, data):
        notes.append(data)
        if len(notes) == 1:
            flag._handle(signal.SIGINT, None)  # the second press, inside the first's write
        return len(data)

    monkeypatch.setattr(checkpoint, "os", types.SimpleNamespace(write=write))
    with pytest.raises(KeyboardInterrupt, match="second Ctrl-C"):
        flag._handle(signal.SIGINT, None)
    assert flag.requested and flag.reason == "SIGINT" and len(notes) == 1


def test_second_ctrl_c_aborts_with_one_line(model_dir, tmp_path):
    workdir = str(tmp_path / "run")
    proc = _train(model_dir, workdir, slow_stop=True)
    err = _interrupt_after(proc, workdir, steps=1, presses=2)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("error: interrupted; ")
    assert "Traceback" not in err, err[-3000:]


def test_a_second_ctrl_c_during_the_stops_save_announces_nothing(model_dir, tmp_path, capfd):
    """Issue 40 row 7: a Ctrl-C that lands while the stop's save is being finished (here:
    as the trainer waits for it) aborts without the "saved step" line, which would be
    false, and without orbax's logged traceback; the resume point is a complete step."""
    from tiny_run import signal_config

    from jaxrl_llm import train
    from jaxrl_llm.trainer import run as run_lib

    step, wait = run_lib.Run.step, Checkpointer.wait

    def first_ctrl_c(self, i):
        out = step(self, i)
        if i == 1:
            os.kill(os.getpid(), signal.SIGINT)  # the flag's handler: stop after this step
        return out

    def second_ctrl_c(self):
        os.kill(os.getpid(), signal.SIGINT)  # the handler raises KeyboardInterrupt
        wait(self)

    c = signal_config(model_dir)
    c.train.num_steps, c.checkpoint.every = 10, 1
    pytest.MonkeyPatch.setattr(mp := pytest.MonkeyPatch(), run_lib.Run, "step", first_ctrl_c)
    try:
        mp.setattr(Checkpointer, "wait", second_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            train.train(c, str(tmp_path / "run"))
    finally:
        mp.undo()
    err = capfd.readouterr().err
    assert "press Ctrl-C again" in err and "saved step" not in err, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    # Read-only: in process, the abandoned save may still be writing step 2 (the command
    # line exits at once); either way the latest step is a complete one.
    with Checkpointer(tmp_path / "run" / "checkpoints", read_only=True) as ckpt:
        assert ckpt.latest_step() in (1, 2)
        assert ckpt.restore(ckpt.latest_step())[1]["step"] == ckpt.latest_step()


def test_orbax_records_of_an_abort_are_dropped():
    """A Ctrl-C that cuts orbax's wait for a save is logged by orbax with its traceback;
    the one line of `errors.cli_main` reports it instead."""
    try:
        raise KeyboardInterrupt("second Ctrl-C")
    except KeyboardInterrupt:
        record = logging.LogRecord(
            "absl",
            logging.ERROR,
            "/x/orbax/checkpoint/checkpoint_manager.py",
            1,
            "Save Finalize thread (save_finalize) failed.",
            (),
            sys.exc_info(),
        )
    assert not checkpoint._REPORTED_FILTER.filter(record)


def _run_interrupted(code: str) -> subprocess.CompletedProcess:
    """Runs `code` (python source that interrupts itself) -> its result, once checked to
    have exited 130 with the one line on stderr."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: interrupted; work since the last checkpoint is lost"
    ]
    return proc


def test_a_ctrl_c_python_drops_still_aborts_with_one_line():
    """The second Ctrl-C's KeyboardInterrupt raised inside a garbage-collection callback
    (jax keeps one in `gc.callbacks`) is printed and dropped by Python; the command line
    still exits 130 with the one line, not a traceback, and does not run on."""
    code = textwrap.dedent(
        """
        import gc, time
        from jaxrl_llm.errors import cli_main
        def main():
            def interrupted(phase, info):
                gc.callbacks.remove(interrupted)
                raise KeyboardInterrupt("second Ctrl-C")
            gc.callbacks.append(interrupted)
            gc.collect()
            time.sleep(1)
            print("ran on")
        cli_main(main)
        """
    )
    proc = _run_interrupted(code)
    assert proc.stdout == ""


def test_ctrl_c_while_the_trainer_exits_is_one_line(tmp_path):
    """A Ctrl-C after the run returned, while the interpreter exits (jax's atexit clean-up
    runs there), ends with the one line and 130, not a traceback from an atexit hook."""
    code = textwrap.dedent(
        """
        import atexit, os, signal, time
        from jaxrl_llm.errors import cli_main
        atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(5)))
        cli_main(lambda: print("trained"))
        """
    )
    proc = _run_interrupted(code)
    assert proc.stdout == "trained\n"
