"""One trainer per run directory (two real processes, kill -9), unusable directories, and
the config history and resume checks."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from jaxrl_llm import config as config_lib
from jaxrl_llm.errors import UserError
from jaxrl_llm.trainer import workdir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HOLD = """
import sys, time
from jaxrl_llm.trainer import workdir
workdir.lock(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""
_TAKE = """
import sys
from jaxrl_llm.trainer import workdir
from jaxrl_llm.errors import cli_main
cli_main(lambda: workdir.lock(sys.argv[1]))
print("taken")
"""


def python(code, *args):
    env = {**os.environ, "PYTHONPATH": REPO}
    return [sys.executable, "-c", textwrap.dedent(code), *map(str, args)], env


def test_second_trainer_is_refused_naming_the_holder_until_it_is_killed(tmp_path):
    run = tmp_path / "run"
    cmd, env = python(_HOLD, run)
    holder = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        cmd, env = python(_TAKE, run)
        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and second.stdout == ""
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        host = socket.gethostname()
        prefix = f"error: {run}: in use by another trainer (pid {holder.pid} on {host}, since "
        assert lines[0].startswith(prefix), lines[0]
        assert lines[0].endswith("); wait for it to finish or stop it, or choose another --workdir")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The kernel released the dead holder's lock: nothing stale is left to clean up.
    third = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert third.returncode == 0 and third.stdout.strip() == "taken", third.stderr


def test_lock_in_process_release_and_retake(tmp_path):
    held = workdir.lock(tmp_path / "run")
    with pytest.raises(UserError, match=rf"pid {os.getpid()} on "):
        workdir.lock(tmp_path / "run")
    held.release()
    held.release()
    with workdir.lock(tmp_path / "run") as again:
        assert again.held
    assert not again.held


def test_workdir_that_is_a_file(tmp_path):
    path = tmp_path / "run"
    path.write_text("not a directory")
    with pytest.raises(UserError) as err:
        workdir.lock(path)
    assert (
        str(err.value) == f"{path}: --workdir is a file, not a directory; choose another --workdir"
    )


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only tmpfs (root ignores permission bits, so chmod would prove nothing)."""
    path = tmp_path / "ro"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)])
    if mounted.returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here")
    yield path
    subprocess.run(["umount", str(path)], check=True)


def test_read_only_workdir_and_parent(read_only_dir):
    for path in (read_only_dir, read_only_dir / "new_run"):
        with pytest.raises(UserError) as err:
            workdir.lock(path)
        assert str(err.value) == (
            f"{path}: --workdir is not writable (read-only file system); choose a writable "
            "--workdir"
        )


def _config(**changes):
    """The default config as code without `train.max_failed_steps` wrote it, with changes."""
    c = config_lib.base_config()
    for key, value in changes.items():
        section, name = key.split(".")
        c[section][name] = value
    c = c.to_dict()
    del c["train"]["max_failed_steps"]
    return c


def test_config_history_across_three_resumes(tmp_path):
    first = _config()
    assert workdir.check_resume(tmp_path, first) == []  # a new run
    assert workdir.save_config(tmp_path, first).endswith("configs/config.1.json")

    assert workdir.check_resume(tmp_path, first) == []  # same command again
    workdir.save_config(tmp_path, first)
    assert len(workdir.history(tmp_path)) == 1  # an unchanged resume adds nothing

    second = _config(**{"optim.learning_rate": 3e-6, "rollout.batch_size": 16})
    with pytest.raises(UserError) as err:
        workdir.check_resume(tmp_path, second)
    assert str(err.value) == (
        f"{tmp_path}/config.json: resuming with a config that changes what the run means "
        "(optim.learning_rate: 1e-06 -> 3e-06, rollout.batch_size: 8 -> 16); rerun with the "
        "saved values, use a new --workdir, or pass --config.train.allow_config_change=True"
    )
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads(json.dumps(first))
    lines = workdir.check_resume(tmp_path, second, allow=True)
    assert lines == ["optim.learning_rate: 1e-06 -> 3e-06", "rollout.batch_size: 8 -> 16"]
    workdir.save_config(tmp_path, second)

    third = _config(**{"optim.learning_rate": 3e-6, "rollout.batch_size": 16})
    third["train"]["num_steps"] = 200  # constant schedule: extending the run is harmless
    third["optim"]["micro_batches"] = 4  # a memory knob
    assert workdir.check_resume(tmp_path, third) == [
        "optim.micro_batches: null -> 4",
        "train.num_steps: 100 -> 200",
    ]
    workdir.save_config(tmp_path, third)

    fourth = json.loads(json.dumps(third))
    fourth["train"]["max_failed_steps"] = 3  # a key added to the code since: listed only
    assert workdir.check_resume(tmp_path, fourth) == ["train.max_failed_steps: <absent> -> 3"]
    workdir.save_config(tmp_path, fourth)

    kept = [json.loads(open(p).read()) for p in workdir.history(tmp_path)]
    plain = [json.loads(json.dumps(c)) for c in (first, second, third, fourth)]
    assert kept == plain
    assert json.loads((tmp_path / "config.json").read_text()) == plain[-1]


def test_a_resume_may_find_its_rollout_workers_elsewhere(tmp_path):
    first = _config(**{"rollout.workers": 2, "rollout.worker_addresses": "w0:7070,w1:7070"})
    workdir.save_config(tmp_path, first)
    moved = _config(**{"rollout.workers": 1, "rollout.worker_addresses": "w9:7070"})
    assert workdir.check_resume(tmp_path, moved) == [
        'rollout.worker_addresses: "w0:7070,w1:7070" -> "w9:7070"',
        "rollout.workers: 2 -> 1",
    ]


def test_config_json_from_before_the_history_is_kept(tmp_path):
    old = json.loads(json.dumps(_config()))
    (tmp_path / "config.json").write_text(json.dumps(old))
    workdir.save_config(tmp_path, _config(**{"train.seed": 1}))
    first, second = workdir.history(tmp_path)
    assert json.loads(open(first).read()) == old
    assert json.loads(open(second).read())["train"]["seed"] == 1


@pytest.mark.parametrize(
    "key, meaningful",
    [
        ("model.path", True),
        ("model.dtype", True),
        ("model.remat", False),
        ("data.name", True),
        ("data.template", True),
        ("data.seed", True),
        ("data.skip_bad_rows", False),
        ("data.max_prompt_len", False),
        ("rollout.batch_size", True),
        ("rollout.num_generations", True),
        ("rollout.temperature", True),
        ("rollout.cache_segments", False),
        ("algo.beta", True),
        ("optim.learning_rate", True),
        ("optim.mini_batches", True),
        ("optim.micro_batches", False),
        ("rewards.gsm8k", True),
        ("rewards", True),
        ("train.seed", True),
        ("train.verifier_timeout_s", False),
        ("mesh.fsdp", False),
        ("eval.every", False),
        ("checkpoint.keep", False),
        ("logging.wandb", False),
        ("env.name", True),
        ("env.options", True),
        ("env.options.secret", True),
        ("env.max_turns", True),
        ("env.max_total_tokens", True),
        ("env.stop_tokens", True),
        ("env.turn_reward_discount", True),
        ("env.step_timeout_s", False),
        ("env.trajectory_timeout_s", False),
        ("env.workers", False),
        ("env.memory_mb", False),
        ("teacher.path", True),
        ("teacher.weight", True),
        ("teacher.paths.math", True),
        ("agent.entry", True),
        ("agent.options.tries", True),
        ("agent.max_total_tokens", True),
        ("agent.timeout_s", False),
        ("agent.batch_wait_s", False),
        ("agent.max_request_bytes", False),
    ],
)
def test_which_keys_change_what_the_run_means(key, meaningful):
    c = config_lib.base_config().to_dict()
    assert workdir.meaningful(key, c, c) is meaningful


def test_num_steps_matters_only_under_a_decaying_schedule():
    constant, cosine = _config(), _config(**{"optim.schedule": "cosine"})
    assert not workdir.meaningful("train.num_steps", constant, constant)
    assert workdir.meaningful("train.num_steps", cosine, cosine)


def test_an_environment_change_refuses_the_resume(tmp_path):
    """Issue 40 row 8: the environment is the run's reward function. Its name or an option
    (added or changed) refuses the resume like a `rewards` change; its workers' limits are
    listed only."""
    first = config_lib.base_config()
    first.env.name = "calculator"
    workdir.save_config(tmp_path, first)
    for key, value in [("name", "guess_number"), ("options", {"secret": 3})]:
        changed = config_lib.base_config()
        changed.env.name = "calculator"
        setattr(changed.env, key, value)
        with pytest.raises(UserError, match=rf"changes what the run means \(env\.{key}"):
            workdir.check_resume(tmp_path, changed)
    limits = config_lib.base_config()
    limits.env.name, limits.env.step_timeout_s, limits.env.workers = "calculator", 30.0, 2
    assert workdir.check_resume(tmp_path, limits) == [
        "env.step_timeout_s: 10.0 -> 30.0",
        "env.workers: 0 -> 2",
    ]


def test_a_teacher_or_agent_change_refuses_the_resume(tmp_path):
    """The teacher (its path, weight, a named teacher added) and the agent (its entry, an
    option added) define the run's target: a change refuses the resume, naming the key."""
    first = config_lib.base_config()
    first.teacher.path, first.agent.entry = "/models/teacher", "agent.py:run"
    workdir.save_config(tmp_path, first)
    changes = [
        ("teacher.path", ""),
        ("teacher.weight", 0.5),
        ("teacher.paths", {"math": "/models/math"}),
        ("agent.entry", "other.py:run"),
        ("agent.options", {"tries": 2}),
    ]
    for key, value in changes:
        changed = config_lib.base_config()
        changed.teacher.path, changed.agent.entry = "/models/teacher", "agent.py:run"
        section, name = key.split(".")
        changed[section][name] = value
        with pytest.raises(UserError, match=rf"changes what the run means \({key}"):
            workdir.check_resume(tmp_path, changed)
