"""jaxrl_llm.parallel.xla_flags: the command line compiles at LLVM -O1 where jax can only
use the CPU, and leaves accelerators and a user's own setting alone."""

import os
import subprocess
import sys

import pytest

from jaxrl_llm.parallel import xla_flags

LEVEL = "--xla_backend_optimization_level"


@pytest.fixture
def no_plugins(monkeypatch):
    monkeypatch.setattr(xla_flags, "accelerator_plugins", lambda environ: [])


def test_added_on_a_cpu_only_machine(no_plugins):
    assert xla_flags.with_cpu_defaults({}) == f"{LEVEL}=1"
    flags = "--xla_force_host_platform_device_count=8  --xla_dump_to=/tmp/x"
    added = xla_flags.with_cpu_defaults({"XLA_FLAGS": flags})
    assert added == f"--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/x {LEVEL}=1"
    assert xla_flags.with_cpu_defaults({"JAX_PLATFORMS": "cpu"}) == f"{LEVEL}=1"


def test_a_users_own_level_wins(no_plugins):
    for value in ("0", "2", "3"):
        assert xla_flags.with_cpu_defaults({"XLA_FLAGS": f"--a=1 {LEVEL}={value}"}) is None


def test_accelerators_are_left_alone(monkeypatch):
    assert xla_flags.with_cpu_defaults({"JAX_PLATFORMS": "cuda"}) is None
    assert xla_flags.with_cpu_defaults({"JAX_PLATFORMS": "cpu,tpu"}) is None
    assert xla_flags.with_cpu_defaults({"TPU_LIBRARY_PATH": "/x/libtpu.so"}) is None
    monkeypatch.setattr(xla_flags, "accelerator_plugins", lambda environ: ["xla_cuda12"])
    assert xla_flags.with_cpu_defaults({}) is None
    # JAX_PLATFORMS=cpu keeps jax off the installed GPU: the CPU defaults apply.
    assert xla_flags.with_cpu_defaults({"JAX_PLATFORMS": "cpu"}) == f"{LEVEL}=1"


def test_named_reads_the_last_setting():
    env = {"XLA_FLAGS": f"{LEVEL}=2 --xla_other=1 {LEVEL}=0 --flag"}
    assert xla_flags.named(LEVEL, env) == "0"
    assert xla_flags.named("--flag", env) == ""
    assert xla_flags.named("--absent", env) is None
    assert xla_flags.named(LEVEL, {}) is None


def test_a_plugin_in_the_jax_plugins_namespace_is_found(tmp_path, monkeypatch):
    assert "fake_gpu" not in xla_flags.accelerator_plugins({})
    (tmp_path / "jax_plugins").mkdir()  # a namespace package, as plugins install it
    (tmp_path / "jax_plugins" / "fake_gpu.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "jax_plugins", raising=False)
    assert "fake_gpu" in xla_flags.accelerator_plugins({})
    assert not xla_flags.cpu_only({})
    assert xla_flags.with_cpu_defaults({}) is None


_SCRIPT = """
import os
from jaxrl_llm.parallel import xla_flags
xla_flags.set_cpu_defaults()
print(os.environ["XLA_FLAGS"])
import jax, jax.numpy as jnp
print(float(jax.jit(lambda x: (x * x).sum())(jnp.arange(4.0))))
"""


def test_set_before_the_backend_starts():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[:2] == [f"--xla_force_host_platform_device_count=1 {LEVEL}=1", "14.0"]
