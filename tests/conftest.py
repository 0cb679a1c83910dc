"""Test fixtures: 8 fake CPU devices, set before jax is imported anywhere."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The trainer's persistent compilation cache (train.compilation_cache_dir defaults under
# $XDG_CACHE_HOME): a fresh directory per test session, which its subprocesses inherit, so
# a test never loads programs that another checkout compiled.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="jaxrl_llm_test_cache_")
