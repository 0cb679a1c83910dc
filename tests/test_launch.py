"""Launch scripts: every dry run, on a PATH without gcloud/kubectl/SLURM, and shellcheck.

Each script runs as a subprocess with a PATH holding only basic tools plus tripwires named
gcloud, kubectl, sbatch, ... that record any call: a dry run must print its commands and
run none of them. Printed commands are parsed with `shlex` (POSIX shell rules), and the
remote and batch command strings are executed by a real shell against a fake trainer, so
the quoting of arguments with spaces and quotes is checked end to end.
"""

import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
SCRIPTS = ["tpu_pod.sh", "gke.sh", "slurm.sh"]

TOOLS = (
    "bash sh cat dirname basename sed xargs printf tr id mkdir rm tail hostname setsid nohup sleep"
)
TRIPWIRES = "gcloud gsutil kubectl sbatch srun squeue scancel ssh scp git"

# EXTRA_ARGS as a user writes it, and the argv words it must become.
EXTRA_ARGS = "--config.algo.beta=0.0 --config.logging.run_name='my run & co'"
EXTRA_ARGV = ["--config.algo.beta=0.0", "--config.logging.run_name=my run & co"]
# Passed after `--`: reaches the trainer verbatim.
TAIL_ARGV = ['--config.data.template=it\'s "{question}" \\n']

TPU_ENV = {
    "TPU_NAME": "rl-pod",
    "ZONE": "us-east5-a",
    "PROJECT": "my-project",
    "BUCKET": "my-bucket",
    "CONFIG": "configs/math_grpo_llama3_8b_tpu.py",
    "EXTRA_ARGS": EXTRA_ARGS,
}
GKE_ENV = {
    "IMAGE": "us-docker.pkg.dev/p/r/jaxrl-llm:1",
    "BUCKET": "my-bucket",
    "CONFIG": "configs/math_grpo_llama3_8b_tpu.py",
    "EXTRA_ARGS": EXTRA_ARGS,
}
SLURM_ENV = {
    "CONFIG": "configs/gsm8k_grpo_qwen2p5_0p5b.py",
    "RUNS_DIR": "/shared/runs",
    "NODES": "4",
    "EXTRA_ARGS": EXTRA_ARGS,
}


@pytest.fixture(scope="module")
def fake_bin(tmp_path_factory):
    """(tools, tripwires, calls): symlinks to the basic tools; a directory of scripts named
    like the cluster CLIs that append their command line to `calls` and fail."""
    root = tmp_path_factory.mktemp("fake_path")
    tools, tripwires = root / "tools", root / "tripwires"
    tools.mkdir()
    tripwires.mkdir()
    for tool in TOOLS.split():
        path = shutil.which(tool)
        assert path, f"{tool} is needed by the launch scripts' tests"
        (tools / tool).symlink_to(path)
    calls = root / "tripwire_calls"
    for tool in TRIPWIRES.split():
        (tripwires / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\nexit 97\n')
        (tripwires / tool).chmod(0o755)
    return tools, tripwires, calls


def launch(fake_bin, script, *args, env=None):
    """Runs launch/SCRIPT with only `env` (and PATH, HOME) in its environment."""
    tools, tripwires, calls = fake_bin
    full_env = {"PATH": f"{tools}:{tripwires}", "HOME": str(tools.parent), "LC_ALL": "C"}
    full_env.update(env or {})
    proc = subprocess.run(
        [str(LAUNCH / script), *args],
        env=full_env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert not calls.exists(), f"the dry run ran: {calls.read_text()}"
    return proc


def dry_run(fake_bin, script, subcommand, env, *trainer_args):
    extra = ["--", *trainer_args] if trainer_args else []
    proc = launch(fake_bin, script, "--dry-run", subcommand, *extra, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def commands(stdout):
    """The printed commands, each as its argv (comment lines dropped)."""
    return [shlex.split(line) for line in stdout.splitlines() if not line.startswith("#")]


def option(argv, name):
    (value,) = [a.split("=", 1)[1] for a in argv if a.startswith(name + "=")]
    return value


# ----------------------------------------------------------------------------- TPU VM pod


def test_tpu_pod_dry_run_of_every_subcommand(fake_bin):
    out = {
        s: dry_run(fake_bin, "tpu_pod.sh", s, TPU_ENV)
        for s in ["create", "setup", "run", "check", "stop", "delete"]
    }
    for stdout in out.values():
        for argv in commands(stdout):
            if argv[0] == "gcloud":
                assert argv[1:4] == ["compute", "tpus", "tpu-vm"], argv
                assert "--zone=us-east5-a" in argv and "--project=my-project" in argv, argv

    [create] = commands(out["create"])
    assert create[4:6] == ["create", "rl-pod"]
    assert "--accelerator-type=v5p-64" in create and "--version=v2-alpha-tpuv5" in create

    archive, scp, install = commands(out["setup"])
    assert archive[:2] == ["git", "-C"] and "archive" in archive and archive[-1] == "HEAD"
    assert scp[4] == "scp" and scp[5] == archive[archive.index("-o") + 1]
    assert "--worker=all" in scp and "--worker=all" in install
    assert "pip install -q -e '.[tpu]'" in option(install, "--command")

    [run] = commands(out["run"])
    assert run[4:6] == ["ssh", "rl-pod"] and "--worker=all" in run
    remote = option(run, "--command")
    assert "JAXRL_DISTRIBUTED=1" in remote
    assert "python3 -m jaxrl_llm.train --config=configs/math_grpo_llama3_8b_tpu.py" in remote
    assert "--workdir=gs://my-bucket/runs/math_grpo_llama3_8b_tpu" in remote

    [check] = commands(out["check"])
    assert "--worker=all" in check
    assert "gs://my-bucket/runs/math_grpo_llama3_8b_tpu/logs/" in option(check, "--command")
    [stop] = commands(out["stop"])
    assert "--worker=all" in stop and "kill -TERM" in option(stop, "--command")
    [delete] = commands(out["delete"])
    assert delete[4:6] == ["delete", "rl-pod"]


def remote_command(fake_bin, subcommand, *trainer_args):
    stdout = dry_run(fake_bin, "tpu_pod.sh", subcommand, TPU_ENV, *trainer_args)
    [argv] = commands(stdout)
    return option(argv, "--command")


def on_worker(worker_home, tools, command):
    """Runs a --command string the way ssh does: a shell in the worker's home."""
    env = {"PATH": f"{worker_home / 'bin'}:{tools}", "HOME": str(worker_home)}
    return subprocess.run(
        ["bash", "-c", command],
        cwd=worker_home,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def wait_for(path, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_tpu_pod_run_check_stop_on_a_worker(fake_bin, tmp_path):
    """The remote scripts of run/check/stop, executed by bash in a fake worker home."""
    tools = fake_bin[0]
    (tmp_path / "jaxrl_llm").mkdir()
    (tmp_path / "bin").mkdir()
    trainer = tmp_path / "bin" / "python3"
    trainer.write_text(
        "#!/bin/bash\n"
        'printf "%s\\0" "$@" > "$HOME/argv.tmp"; mv "$HOME/argv.tmp" "$HOME/argv"\n'
        'echo "$JAXRL_DISTRIBUTED $PWD" > "$HOME/env"\n'
        "echo trainer started\n"
        "trap 'kill $!; echo trainer got SIGTERM; exit 0' TERM\n"
        "sleep 30 & wait\n"
    )
    trainer.chmod(0o755)
    (tmp_path / "bin" / "mv").symlink_to(shutil.which("mv"))

    logs = tmp_path / "jaxrl_llm_logs" / "math_grpo_llama3_8b_tpu"
    try:
        started = on_worker(tmp_path, tools, remote_command(fake_bin, "run", *TAIL_ARGV))
        assert started.returncode == 0, started.stderr
        wait_for(tmp_path / "argv")
        argv = (tmp_path / "argv").read_text().split("\0")[:-1]
        assert argv == [
            "-m",
            "jaxrl_llm.train",
            "--config=configs/math_grpo_llama3_8b_tpu.py",
            "--workdir=gs://my-bucket/runs/math_grpo_llama3_8b_tpu",
            *EXTRA_ARGV,
            *TAIL_ARGV,
        ]
        wait_for(tmp_path / "env")  # the fake trainer writes it after argv
        assert (tmp_path / "env").read_text().split() == ["1", str(tmp_path / "jaxrl_llm")]

        again = on_worker(tmp_path, tools, remote_command(fake_bin, "run"))
        assert again.returncode == 1 and "already running" in again.stderr

        check = on_worker(tmp_path, tools, remote_command(fake_bin, "check"))
        assert ": running" in check.stdout and "trainer started" in check.stdout
        assert "could not copy the log" in check.stdout  # no gcloud on this worker
    finally:
        stop = on_worker(tmp_path, tools, remote_command(fake_bin, "stop"))
    assert "SIGTERM sent" in stop.stdout
    [log] = logs.glob("*.log")
    wait_for(log.with_name(log.name + ".rc"))
    check = on_worker(tmp_path, tools, remote_command(fake_bin, "check"))
    assert "exited with status 0" in check.stdout and "trainer got SIGTERM" in check.stdout


def test_tpu_pod_run_with_rollout_workers(fake_bin, tmp_path):
    """WORKER_TPUS: `run` starts a worker on each worker slice's hosts, then the trainer on the
    slice; executed in fake homes (a fake gcloud answering the secret and the VMs' IPs)
    the worker gets the token from Secret Manager and the trainer the workers' IPs."""
    env = {**TPU_ENV, "WORKER_TPUS": "rl-w0 rl-w1"}
    stdout = dry_run(fake_bin, "tpu_pod.sh", "run", env, *TAIL_ARGV)
    w0, w1, trainer = commands(stdout)
    assert w0[4:7] == ["ssh", "rl-w0", "--worker=all"]  # every host of a worker's slice
    assert w1[4:7] == ["ssh", "rl-w1", "--worker=all"]
    assert trainer[4:7] == ["ssh", "rl-pod", "--worker=all"]
    gcloud = (
        "#!/bin/sh\n"
        'case "$1 $2 $5" in\n'
        '  "secrets versions --secret=jaxrl-worker-token") echo token-1 ;;\n'
        '  "compute tpus rl-w0") echo 10.0.0.7 ;;\n'
        '  "compute tpus rl-w1") echo 10.0.0.8 ;;\n'
        "  *) exit 3 ;;\n"
        "esac\n"
    )
    recorder = (
        "#!/bin/bash\n"
        'printf "%s\\0" "$JAXRL_WORKER_TOKEN" "$JAXRL_DISTRIBUTED" "$@" > "$HOME/argv.tmp"\n'
        'mv "$HOME/argv.tmp" "$HOME/argv"\n'
    )
    got = {}
    for role, argv in (("worker", w0), ("trainer", trainer)):
        home = tmp_path / role
        (home / "jaxrl_llm").mkdir(parents=True)
        (home / "bin").mkdir()
        for name, text in (("gcloud", gcloud), ("python3", recorder)):
            (home / "bin" / name).write_text(text)
            (home / "bin" / name).chmod(0o755)
        (home / "bin" / "mv").symlink_to(shutil.which("mv"))
        started = on_worker(home, fake_bin[0], option(argv, "--command"))
        assert started.returncode == 0, started.stderr
        wait_for(home / "argv")
        got[role] = (home / "argv").read_text().split("\0")[:-1]
    config = "--config=configs/math_grpo_llama3_8b_tpu.py"
    assert got["worker"] == [
        "token-1",
        "1",  # its hosts one JAX world
        "-m",
        "jaxrl_llm.workers.serve",
        config,
        "--host=0.0.0.0",
        "--port=7070",
        *EXTRA_ARGV,
        *TAIL_ARGV,
    ]
    assert got["trainer"] == [
        "token-1",
        "1",
        "-m",
        "jaxrl_llm.train",
        config,
        "--workdir=gs://my-bucket/runs/math_grpo_llama3_8b_tpu",
        *EXTRA_ARGV,
        *TAIL_ARGV,
        "--config.rollout.mode=split",
        "--config.rollout.workers=2",
        "--config.rollout.worker_addresses=10.0.0.7:7070,10.0.0.8:7070",
    ]
    assert "token-1" not in stdout
    check = commands(dry_run(fake_bin, "tpu_pod.sh", "check", env))
    stop = commands(dry_run(fake_bin, "tpu_pod.sh", "stop", env))
    assert [a[5] for a in check] == [a[5] for a in stop] == ["rl-pod", "rl-w0", "rl-w1"]


# ------------------------------------------------------------------------------------ GKE


def test_gke_dry_run_renders_a_jobset(fake_bin):
    yaml = pytest.importorskip("yaml")
    stdout = dry_run(fake_bin, "gke.sh", "apply", GKE_ENV, *TAIL_ARGV)
    head, rest = stdout.split("\n", 1)
    assert shlex.split(head) == ["kubectl", "apply", "-f", "-", "<<EOF"]
    manifest, tail = rest.rsplit("EOF\n", 1)
    assert tail == ""
    assert manifest == dry_run(fake_bin, "gke.sh", "render", GKE_ENV, *TAIL_ARGV)

    jobset = yaml.safe_load(manifest)
    assert jobset["kind"] == "JobSet" and jobset["metadata"]["name"] == "math-grpo-llama3-8b-tpu"
    [job] = jobset["spec"]["replicatedJobs"]
    spec = job["template"]["spec"]
    # v5p 2x4x4: 32 chips, 4 per host -> 8 pods, one per host.
    assert spec["parallelism"] == spec["completions"] == 8
    assert spec["completionMode"] == "Indexed"
    pod = spec["template"]["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
        "cloud.google.com/gke-tpu-topology": "2x4x4",
    }
    [container] = pod["containers"]
    assert container["image"] == GKE_ENV["IMAGE"]
    assert container["resources"] == {
        "requests": {"google.com/tpu": 4},
        "limits": {"google.com/tpu": 4},
    }
    assert {"name": "JAXRL_DISTRIBUTED", "value": "1"} in container["env"]
    assert container["command"] == [
        "python",
        "-m",
        "jaxrl_llm.train",
        "--config=configs/math_grpo_llama3_8b_tpu.py",
        "--workdir=gs://my-bucket/runs/math_grpo_llama3_8b_tpu",
        *EXTRA_ARGV,
        *TAIL_ARGV,
    ]


def test_gke_host_count_follows_the_topology(fake_bin):
    yaml = pytest.importorskip("yaml")
    env = {**GKE_ENV, "TPU_ACCELERATOR": "tpu-v5-lite-podslice", "TPU_TOPOLOGY": "4x4"}
    spec = yaml.safe_load(dry_run(fake_bin, "gke.sh", "render", env))["spec"]
    assert spec["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 4
    single_host = launch(
        fake_bin, "gke.sh", "--dry-run", "render", env={**env, "TPU_TOPOLOGY": "2x2"}
    )
    assert single_host.returncode == 2 and "not a multi-host slice" in single_host.stderr


def test_gke_dry_run_with_workers_renders_two_replicated_jobs(fake_bin):
    """WORKERS=2: a replicated job of two worker pods (single-host slices) listed, and so
    started, before the trainer's slice (one host, or several); the trainer in split mode
    with the workers' JobSet DNS names; the JobSet done when the trainer is."""
    yaml = pytest.importorskip("yaml")
    env = {**GKE_ENV, "WORKERS": "2", "TPU_TOPOLOGY": "2x2x1"}
    spec = yaml.safe_load(dry_run(fake_bin, "gke.sh", "render", env, *TAIL_ARGV))["spec"]
    workers, trainer = spec["replicatedJobs"]
    assert workers["name"] == "workers" and workers["replicas"] == 2
    assert trainer["name"] == "slice" and trainer["replicas"] == 1
    assert spec["startupPolicy"] == {"startupPolicyOrder": "InOrder"}
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["slice"]}
    pod = workers["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x2x1"
    [worker] = pod["containers"]
    assert worker["command"] == [
        "python",
        "-m",
        "jaxrl_llm.workers.serve",
        "--config=configs/math_grpo_llama3_8b_tpu.py",
        "--host=0.0.0.0",
        "--port=7070",
        *EXTRA_ARGV,
        *TAIL_ARGV,
    ]
    secret = {"name": "jaxrl-worker-token", "key": "token"}
    assert worker["env"] == [{"name": "JAXRL_WORKER_TOKEN", "valueFrom": {"secretKeyRef": secret}}]
    spec = trainer["template"]["spec"]
    assert spec["parallelism"] == 1
    [container] = spec["template"]["spec"]["containers"]
    name = "math-grpo-llama3-8b-tpu"
    assert container["command"][-3:] == [
        "--config.rollout.mode=split",
        "--config.rollout.workers=2",
        f"--config.rollout.worker_addresses={name}-workers-0-0.{name}:7070,"
        f"{name}-workers-1-0.{name}:7070",
    ]
    token = {"secretKeyRef": secret | {"optional": True}}
    assert {"name": "JAXRL_WORKER_TOKEN", "valueFrom": token} in container["env"]
    # A trainer of several hosts (the default topology's): process 0 draws for all
    many = {**GKE_ENV, "WORKERS": "2"}
    spec = yaml.safe_load(dry_run(fake_bin, "gke.sh", "render", many))["spec"]
    assert spec["replicatedJobs"][1]["template"]["spec"]["parallelism"] > 1


def test_gke_check_and_delete(fake_bin):
    selector = "--selector=jobset.sigs.k8s.io/jobset-name=math-grpo-llama3-8b-tpu"
    get_jobset, get_pods, logs = commands(dry_run(fake_bin, "gke.sh", "check", GKE_ENV))
    assert get_jobset[:4] == ["kubectl", "get", "jobset", "math-grpo-llama3-8b-tpu"]
    assert selector in get_pods and selector in logs and "--prefix" in logs
    [delete] = commands(dry_run(fake_bin, "gke.sh", "delete", GKE_ENV))
    assert delete == [
        "kubectl",
        "delete",
        "jobset",
        "math-grpo-llama3-8b-tpu",
        "--namespace=default",
    ]


# ---------------------------------------------------------------------------------- SLURM


def test_slurm_dry_run_submit(fake_bin, tmp_path):
    mkdir, sbatch = commands(dry_run(fake_bin, "slurm.sh", "submit", SLURM_ENV, *TAIL_ARGV))
    logdir = "/shared/runs/gsm8k_grpo_qwen2p5_0p5b/logs"
    assert mkdir == ["mkdir", "-p", logdir]
    assert sbatch[0] == "sbatch"
    for flag in ["--nodes=4", "--ntasks-per-node=1", "--gres=gpu:8", f"--chdir={REPO}"]:
        assert flag in sbatch
    step = shlex.split(option(sbatch, "--wrap"))
    train = step.index("env")
    assert step[:train] == ["srun", "--kill-on-bad-exit=1", f"--output={logdir}/%j-node%t.log"]
    assert step[train:] == [
        "env",
        "JAXRL_DISTRIBUTED=1",
        "JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7",
        "python",
        "-m",
        "jaxrl_llm.train",
        "--config=configs/gsm8k_grpo_qwen2p5_0p5b.py",
        "--workdir=/shared/runs/gsm8k_grpo_qwen2p5_0p5b",
        *EXTRA_ARGV,
        *TAIL_ARGV,
    ]
    # sbatch runs --wrap with /bin/sh: it must split the string the same way.
    (tmp_path / "srun").write_text('#!/bin/sh\nprintf "%s\\0" "$@"\n')
    (tmp_path / "srun").chmod(0o755)
    env = {"PATH": f"{tmp_path}:{fake_bin[0]}"}
    out = subprocess.run(["sh", "-c", option(sbatch, "--wrap")], env=env, capture_output=True)
    assert out.stdout.decode().split("\0")[:-1] == step[1:]


def test_slurm_check(fake_bin, tmp_path):
    env = {**SLURM_ENV, "RUNS_DIR": str(tmp_path)}
    squeue, *_ = commands(dry_run(fake_bin, "slurm.sh", "check", env))
    assert squeue[:2] == ["squeue", "--name=gsm8k_grpo_qwen2p5_0p5b"]
    logs = tmp_path / "gsm8k_grpo_qwen2p5_0p5b" / "logs"
    logs.mkdir(parents=True)
    for task in range(2):
        (logs / f"77-node{task}.log").write_text("step 1\n")
    _, tail = commands(dry_run(fake_bin, "slurm.sh", "check", env))
    assert tail == ["tail", "-n", "20", str(logs / "77-node0.log"), str(logs / "77-node1.log")]


def test_slurm_dry_run_with_workers_is_one_heterogeneous_job(fake_bin, tmp_path):
    """WORKERS=2: the script on sbatch's stdin asks for a trainer node and two worker
    nodes (`#SBATCH hetjob` between them); run by bash against a fake srun and scontrol
    it starts a worker on each worker node (component 1) and the trainer (component 0)
    with their addresses from SLURM_JOB_NODELIST_HET_GROUP_1."""
    env = {**SLURM_ENV, "NODES": "1", "WORKERS": "2", "JAXRL_WORKER_TOKEN": "secret"}
    mkdir, *_ = commands(stdout := dry_run(fake_bin, "slurm.sh", "submit", env, *TAIL_ARGV))
    assert mkdir == ["mkdir", "-p", "/shared/runs/gsm8k_grpo_qwen2p5_0p5b/logs"]
    head, rest = stdout.split("\n", 2)[1:]
    assert shlex.split(head) == ["sbatch", "<<EOF"]
    script, tail = rest.rsplit("EOF\n", 1)
    assert tail == "" and "secret" not in stdout  # the job inherits the token
    flags = [line.split(" ", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH")]
    trainer, workers = flags[: flags.index("hetjob")], flags[flags.index("hetjob") + 1 :]
    assert "--nodes=1" in trainer and "--gres=gpu:8" in trainer and "--exclusive" in trainer
    assert "--nodes=2" in workers and "--ntasks-per-node=1" in workers
    assert f"--chdir={REPO}" in trainer

    calls = tmp_path / "srun_calls"  # a file per call: the worker's and trainer's race
    calls.mkdir()
    (tmp_path / "srun").write_text(f'#!/bin/sh\nprintf "%s\\0" "$@" > {calls}/$$\n')
    (tmp_path / "scontrol").write_text(
        '#!/bin/sh\n[ "$3" = "gpu-[7-8]" ] && printf "gpu-7\\ngpu-8\\n"\n'
    )
    for tool in ("srun", "scontrol"):
        (tmp_path / tool).chmod(0o755)
    run_env = {"PATH": f"{tmp_path}:{fake_bin[0]}", "SLURM_JOB_NODELIST_HET_GROUP_1": "gpu-[7-8]"}
    done = subprocess.run(["bash", "-c", script + "\nwait\n"], env=run_env, capture_output=True)
    assert done.returncode == 0, done.stderr
    argvs = sorted(c.read_text().split("\0")[:-1] for c in calls.iterdir())
    logdir = "/shared/runs/gsm8k_grpo_qwen2p5_0p5b/logs"
    config = "--config=configs/gsm8k_grpo_qwen2p5_0p5b.py"
    assert argvs == [
        [
            "--het-group=0",
            "--kill-on-bad-exit=1",
            f"--output={logdir}/%j-node%t.log",
            "env",
            "JAXRL_DISTRIBUTED=1",
            "JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7",
            "python",
            "-m",
            "jaxrl_llm.train",
            config,
            "--workdir=/shared/runs/gsm8k_grpo_qwen2p5_0p5b",
            *EXTRA_ARGV,
            *TAIL_ARGV,
            "--config.rollout.mode=split",
            "--config.rollout.workers=2",
            "--config.rollout.worker_addresses=gpu-7:7070,gpu-8:7070",
        ],
        [
            "--het-group=1",
            f"--output={logdir}/%j-worker%t.log",
            "python",
            "-m",
            "jaxrl_llm.workers.serve",
            config,
            "--host=0.0.0.0",
            "--port=7070",
            *EXTRA_ARGV,
            *TAIL_ARGV,
        ],
    ]


def test_slurm_workers_take_a_trainer_of_several_nodes_and_need_a_token(fake_bin):
    env = {**SLURM_ENV, "WORKERS": "2", "JAXRL_WORKER_TOKEN": "secret"}
    script = dry_run(fake_bin, "slurm.sh", "submit", env).split("EOF\n")[0]
    flags = [line.split(" ", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "--nodes=4" in flags[: flags.index("hetjob")]
    env = {**env, "JAXRL_WORKER_TOKEN": ""}
    proc = launch(fake_bin, "slurm.sh", "--dry-run", "submit", env=env)
    assert proc.returncode == 2 and "JAXRL_WORKER_TOKEN is not set" in proc.stderr


# ------------------------------------------------------------------------------ all scripts


@pytest.mark.parametrize(
    "script, subcommand, env, missing",
    [
        ("tpu_pod.sh", "run", TPU_ENV, "TPU_NAME"),
        ("tpu_pod.sh", "create", TPU_ENV, "ZONE"),
        ("tpu_pod.sh", "run", TPU_ENV, "BUCKET"),
        ("tpu_pod.sh", "run", TPU_ENV, "CONFIG"),
        ("gke.sh", "apply", GKE_ENV, "IMAGE"),
        ("gke.sh", "apply", GKE_ENV, "BUCKET"),
        ("gke.sh", "render", GKE_ENV, "CONFIG"),
        ("slurm.sh", "submit", SLURM_ENV, "CONFIG"),
        ("slurm.sh", "submit", SLURM_ENV, "RUNS_DIR"),
    ],
)
def test_a_missing_variable_stops_with_one_line(fake_bin, script, subcommand, env, missing):
    env = {k: v for k, v in env.items() if k != missing}
    proc = launch(fake_bin, script, "--dry-run", subcommand, env=env)
    assert proc.returncode == 2
    assert proc.stdout == ""  # nothing printed as if it would run
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"{script}: {missing} is not set (")


@pytest.mark.parametrize("script, env", zip(SCRIPTS, [TPU_ENV, GKE_ENV, SLURM_ENV], strict=True))
def test_usage_errors(fake_bin, script, env):
    proc = launch(fake_bin, script, "--help")
    assert proc.returncode == 0 and "--dry-run" in proc.stdout and "Usage:" in proc.stdout
    assert launch(fake_bin, script, "--dry-run", env=env).returncode == 2
    proc = launch(fake_bin, script, "--dry-run", "launch", env=env)
    assert proc.returncode == 2 and "unknown subcommand 'launch'" in proc.stderr
    subcommand = {"tpu_pod.sh": "run", "gke.sh": "render", "slurm.sh": "submit"}[script]
    proc = launch(fake_bin, script, "--dry-run", subcommand, env={**env, "EXTRA_ARGS": "--a='b"})
    assert proc.returncode == 2 and "unbalanced quotes" in proc.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_header(script):
    path = LAUNCH / script
    lines = path.read_text().splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert "set -euo pipefail" in lines
    assert os.access(path, os.X_OK)


def test_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (Debian/Ubuntu: apt-get install -y shellcheck)")
    scripts = sorted(str(p.relative_to(REPO)) for p in LAUNCH.glob("*.sh"))
    proc = subprocess.run(
        ["shellcheck", "--external-sources", *scripts], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
