"""Multi-host training: 2 processes x 4 CPU devices (gloo collectives, localhost) end with
the same LoRA adapters as 1 process x 8 devices, including across a resume."""

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from tiny_run import make_model_dir, signal_config

from jaxrl_llm import train
from jaxrl_llm.parallel import allocator
from jaxrl_llm.trainer import checkpoint
from jaxrl_llm.trainer.metrics import read_metrics

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(model_dir, workdir, num_steps, extra_args=()):
    port = free_port()
    procs = []
    for i in range(2):
        env = dict(
            os.environ,
            XLA_FLAGS="--xla_force_host_platform_device_count=4",
            JAX_PLATFORMS="cpu",
            JAXRL_DISTRIBUTED="1",
            JAXRL_COORDINATOR=f"127.0.0.1:{port}",
            JAXRL_NUM_PROCESSES="2",
            JAXRL_PROCESS_ID=str(i),
            TINY_MODEL_DIR=model_dir,
            PYTHONPATH=HERE,
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jaxrl_llm.train",
                    f"--config={HERE}/tiny_run.py",
                    f"--workdir={workdir}",
                    f"--config.train.num_steps={num_steps}",
                    *extra_args,
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    # The command line re-ran itself with tcmalloc where it is installed; process 0 says
    # so where it is not.
    hint = "host allocator: system malloc"
    expected = allocator.preload_environ({}) is None and allocator.hint() is not None
    assert (hint in outputs[0]) == expected, outputs[0][-3000:]
    assert hint not in outputs[1]


def final_params(workdir, step):
    with checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True) as ck:
        return ck.restore(step)[0]["params"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("tiny_model")))


def test_two_processes_equal_one_and_resume(model_dir, tmp_path):
    """LoRA (rank 4) across hosts: 2 processes x 4 devices train the same adapters as
    1 x 8, across a resume of the two. (Full parameters across hosts: the two-process
    trainer of `test_workers.py`, whose update is this one's.)"""
    assert jax.device_count() == 8
    c = signal_config(model_dir)
    c.model.lora.rank = 4
    single = tmp_path / "single"
    train.train(c, str(single))  # 1 process x 8 devices, 2 steps

    multi, lora = tmp_path / "multi", ["--config.model.lora.rank=4"]
    run_two_processes(model_dir, str(multi), num_steps=1, extra_args=lora)
    with checkpoint.Checkpointer(str(multi / "checkpoints"), read_only=True) as ck:
        assert ck.all_steps() == [1]
    run_two_processes(model_dir, str(multi), num_steps=2, extra_args=lora)  # resumes at 1

    a, b = final_params(single, 2), final_params(multi, 2)
    assert set(a["layers"]) == set(b["layers"]) and all("_lora_" in k for k in a["layers"])
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5)
    # Only process 0 wrote metrics, one record per step, equal to the single-process run.
    ma, mb = read_metrics(single / "metrics.jsonl"), read_metrics(multi / "metrics.jsonl")
    assert [m["step"] for m in mb] == [1, 2]
    for key in ("reward/mean", "loss/total", "rollout/length_mean"):
        np.testing.assert_allclose([m[key] for m in mb], [m[key] for m in ma], atol=1e-5)
