"""Test fixtures: 8 fake CPU devices, set before jax is imported anywhere, and one
compilation cache for the whole test session."""

import os
import shutil
import tempfile

import pytest

# LLVM code generation at -O0: the tests' models are tiny, so compiling their programs
# costs far more than running them (most of a test's time is XLA's backend compile).
# Against the command line's -O1 (`parallel.xla_flags`), -O0 took two compile-heavy tests
# a sixth less time in all. Tests that start the command line with XLA_FLAGS of their own
# get its -O1.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The trainer's persistent compilation cache (train.compilation_cache_dir defaults under
# $XDG_CACHE_HOME): a fresh directory per test session, made by the process that starts
# the session and inherited through the environment by pytest-xdist's workers and every
# subprocess a test starts. A program that one test compiles is loaded by the others
# instead of compiled again, and no test loads programs that another checkout compiled.
_SESSION_CACHE = "JAXRL_LLM_TEST_CACHE"
_OWN_CACHE = _SESSION_CACHE not in os.environ
if _OWN_CACHE:
    os.environ[_SESSION_CACHE] = tempfile.mkdtemp(prefix="jaxrl_llm_test_cache_")
os.environ["XDG_CACHE_HOME"] = os.environ[_SESSION_CACHE]


@pytest.fixture(scope="session", autouse=True)
def _session_compilation_cache():
    """In-process tests compile through the session's cache too, not only the trainer's
    runs (which turn it on themselves); a test that turns it off or elsewhere is followed
    by ones that use whatever it left, as with any process-wide jax option."""
    from jaxrl_llm import config as config_lib
    from jaxrl_llm.startup import compilation

    compilation.use_cache(config_lib.default_compilation_cache_dir())
    yield


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After each test module, jax's caches let go of its compiled programs. An XLA:CPU
    executable maps each compiled kernel's code and data as pages of their own (a file of
    sampler tests leaves ~20,000 mappings); kept for a worker's whole life, they reach the
    kernel's limit of 65,530 mappings (`vm.max_map_count`) and the next compile or
    serialization fails inside XLA, which crashed the worker. The next module loads what it
    shares from the session's persistent cache."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


def pytest_unconfigure(config):
    if _OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ[_SESSION_CACHE], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """The slow tier (`@pytest.mark.slow`: tests that re-check a path a cheaper test also
    runs) is left out of a run, unless `-m` picks tests (`-m slow`: the tier alone) or the
    test is named on the command line (`tests/test_x.py::test_y`)."""
    if config.option.markexpr:
        return
    named = {arg.split("[")[0] for arg in config.args if "::" in arg}
    keep, slow = [], []
    for item in items:
        left_out = item.get_closest_marker("slow") and item.nodeid.split("[")[0] not in named
        (slow if left_out else keep).append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = keep
