"""Start-up compilation: the programs are compiled before the first step, each says so in
one line, and a second run in a fresh process loads them from XLA's persistent cache."""

import contextlib
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_run import make_model_dir

from jaxrl_llm.startup import compilation
from jaxrl_llm.trainer.metrics import read_metrics

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("tiny_model")))


def _train(model_dir, workdir, cache, *overrides) -> list[str]:
    """The command line in a fresh process, on one device -> its lines about compiled
    and loaded programs."""
    env = dict(
        os.environ,
        TINY_MODEL_DIR=model_dir,
        PYTHONPATH=os.pathsep.join([ROOT, HERE]),
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxrl_llm.train",
            f"--config={HERE}/tiny_run.py",
            f"--workdir={workdir}",
            f"--config.train.compilation_cache_dir={cache}",
            "--config.mesh.fsdp=1",
            "--config.mesh.tensor=1",
            *overrides,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stderr.replace("\r", "\n")
    # XLA_FLAGS did not name the level: the command line compiles at -O1 on a CPU-only
    # machine (`parallel.xla_flags`) and says so in its start-up line.
    assert "XLA_FLAGS: --xla_backend_optimization_level=1" in text, text[-3000:]
    found = [m.group(0) for line in text.splitlines() if (m := re.search(r"compiling .*", line))]
    # A compile still running after a second is announced ("compiling NAME (DETAIL)...")
    # before its line with the time.
    done = [line for line in found if not line.endswith("...")]
    for line in found:
        if line.endswith("..."):
            later = found[found.index(line) + 1 :]
            assert any(x.startswith(line + " ") for x in later), (line, found)
    return done


def _learning(workdir) -> list[dict]:
    return [
        {k: v for k, v in m.items() if not k.startswith("perf/")}
        for m in read_metrics(os.path.join(workdir, "metrics.jsonl"))
    ]


def test_the_first_step_compiles_nothing_and_a_rerun_loads_from_the_cache(model_dir, tmp_path):
    cache = tmp_path / "xla"
    cold = _train(model_dir, tmp_path / "cold", cache)
    names = [line.split(" (")[0] for line in cold]
    # tiny_run: GRPO (a reference model: the initial policy), 16-token prompt bucket, no
    # evaluation. The first update reads no reference forward: the reference is built
    # last, once the first step is done, for the second.
    assert names == ["compiling sampler", "compiling update", "compiling reference"]
    assert all("(bucket 16)" in line and "compilation cache" not in line for line in cold)
    first, second = read_metrics(tmp_path / "cold" / "metrics.jsonl")
    assert first["perf/compile_s"] == second["perf/compile_s"] == 0.0  # none in the steps
    # Step 0: the behaviour log-probs stand in for the reference's (the same model).
    assert first["perf/reference_s"] < 0.01 and abs(first["policy/kl_ref"]) < 1e-6
    assert abs(second["policy/kl_ref"]) > 1e-6  # the reference forward, off the moved policy

    # A rerun finds every program in XLA's persistent cache; one more step and another
    # checkpoint setting change nothing of what the first two steps compute.
    warm = _train(
        model_dir,
        tmp_path / "warm",
        cache,
        "--config.train.num_steps=3",
        "--config.checkpoint.keep=1",
    )
    assert sorted(line.split(" (")[0] for line in warm) == sorted(names), warm
    assert all(line.endswith("(compilation cache)") for line in warm), warm
    assert _learning(tmp_path / "warm")[:2] == _learning(tmp_path / "cold")
    assert len(_learning(tmp_path / "warm")) == 3


def test_compile_log_names_the_program_and_counts_cache_hits(tmp_path):
    lines = []
    previous = jax.config.jax_compilation_cache_dir  # the test session's (conftest)
    compilation.use_cache(str(tmp_path / "xla"))
    try:
        f = jax.jit(lambda x: jnp.sin(x) * 3.0 + jnp.cos(x))
        x = np.arange(7, dtype=np.float32)
        with compilation.CompileLog(write=lines.append) as log:
            with log.ahead_of_time() as build:
                build("toy", "7 rows", f, x)
            with log.program("again", "same shapes"):
                f(x)  # the executable compiled above: nothing compiles, no line
            jax.clear_caches()  # as a new process would: only the persistent cache is left
            with log.program("toy", "7 rows"):
                f(x)
    finally:
        compilation.use_cache(previous or "")
    assert lines[0].startswith("compiling toy (7 rows)... ")
    assert not lines[0].endswith("(compilation cache)")
    assert lines[1].startswith("programs ready in ")
    assert lines[1].endswith("(1 built side by side, 0 from the compilation cache)")
    assert lines[2].startswith("compiling toy (7 rows)... ")
    assert lines[2].endswith(" s (compilation cache)")
    assert len(lines) == 3 and [p.cache_hits for p in log.programs] == [0, 1]
    assert log.seconds > 0


def test_a_compile_is_announced_when_it_starts_and_again_when_it_ends():
    """announce gets "compiling NAME (DETAIL)..." once the compile has run announce_after_s
    (0 here), in a `program` block and in a build ahead of time; write gets the line with
    the time when it ends. A block that compiles nothing announces nothing."""
    lines = []
    f = jax.jit(lambda x: jnp.tanh(x) * 5.0 - x)
    x = np.arange(11, dtype=np.float32)
    g = jax.jit(lambda x: x * 7.0 + 1.0)
    with compilation.CompileLog(lines.append, lines.append, announce_after_s=0.0) as log:
        with log.program("toy", "11 rows"):
            f(x)
        time.sleep(0.05)
        with log.program("toy", "11 rows"):
            f(x)  # compiled: no line
        with log.ahead_of_time() as build:
            build("built", "11 rows", g, x)
    assert lines[0] == "compiling toy (11 rows)..."
    assert lines[1].startswith("compiling toy (11 rows)... ") and lines[1].endswith(" s")
    assert lines[2] == "compiling built (11 rows)..."
    assert lines[3].startswith("compiling built (11 rows)... ")
    assert lines[4].startswith("programs ready in ") and len(lines) == 5

    quiet = []  # a compile that ends before announce_after_s is not announced
    with compilation.CompileLog(quiet.append, quiet.append, announce_after_s=600.0) as log:
        with log.program("toy", "4 rows"):
            f(x[:4])
    assert len(quiet) == 1 and quiet[0].startswith("compiling toy (4 rows)... ")


class _Failing:
    """A jitted function whose compile fails (as XLA running out of memory would)."""

    class _Lowered:
        out_info = jax.ShapeDtypeStruct((7,), np.float32)

        def compile(self):
            raise RuntimeError("no memory left to compile")

    def lower(self, *args, **kwargs):
        return self._Lowered()


def test_background_builds_serve_their_first_calls_and_raise_their_errors():
    """background=True: the block ends with the programs still building; a call inside
    `program(name)` waits for the builds serving `name` and then runs what they compiled
    (no compile of its own); a build's error raises where a call waits for it. The first
    program builds alone, the others once it is done; their compiles are start-up's, not
    in `seconds` (a step's perf/compile_s)."""
    lines, order = [], []
    x = np.arange(7, dtype=np.float32)
    f = jax.jit(lambda x: jnp.tanh(x) * 5.0 - x)
    g = jax.jit(lambda x: jnp.exp(-x) + 2.0 * x)
    log = compilation.CompileLog(write=lines.append).listen()
    program = log.program

    @contextlib.contextmanager
    def recorded(name, *args, background=False, **kwargs):  # a build's compile
        if background:
            order.append((name, "start"))
        try:
            with program(name, *args, background=background, **kwargs) as record:
                yield record
        finally:
            if background:
                order.append((name, "end"))

    log.program = recorded
    try:
        with log.ahead_of_time(background=True) as build:
            build("f", "7 rows", f, x)
            build("g", "7 rows", g, x)
            build("broken", "7 rows", _Failing(), x)
        seconds = log.seconds
        with log.program("f") as call_f:
            np.testing.assert_allclose(f(x), np.tanh(x) * 5.0 - x, atol=1e-5)
        with log.program("g") as call_g:
            np.testing.assert_allclose(g(x), np.exp(-x) + 2.0 * x, atol=1e-5)
        assert call_f.compiles == call_g.compiles == 0
        with pytest.raises(RuntimeError, match="no memory left to compile"):
            with log.program("broken"):
                pass
        with pytest.raises(RuntimeError, match="no memory left to compile"):
            log.wait()  # waits for them all; the failed build's error again
    finally:
        log.close()
    assert order[:2] == [("f", "start"), ("f", "end")]  # the first alone
    assert {name for name, _ in order[2:]} == {"g", "broken"}
    assert log.seconds == seconds == 0.0
    assert sorted(line.split(" (")[0] for line in lines) == ["compiling f", "compiling g"]
    assert not any(line.startswith("programs ready") for line in lines)  # one build failed


def test_a_deferred_build_starts_when_asked_or_needed_and_is_dropped_if_never():
    """build(..., deferred=True): the program is traced at once but compiles only at
    `start_deferred()` or when a call it serves waits for it; one that neither starts
    before `close` is dropped, and `close` does not wait for it."""
    lines = []
    x = np.arange(5, dtype=np.float32)
    f = jax.jit(lambda x: jnp.sinh(x) - 3.0 * x)
    g = jax.jit(lambda x: jnp.cosh(x) + 4.0 * x)
    h = jax.jit(lambda x: jnp.tanh(x) + 5.0 * x)
    log = compilation.CompileLog(write=lines.append).listen()
    try:
        with log.ahead_of_time(background=True) as build:
            build("f", "5 rows", f, x, deferred=True)
            build("g", "5 rows", g, x, deferred=True)
        time.sleep(0.5)
        assert lines == []  # neither has started
        with log.program("f") as call:  # needed: started and waited for
            np.testing.assert_allclose(f(x), np.sinh(x) - 3.0 * x, rtol=1e-5)
        assert call.compiles == 0 and lines[0].startswith("compiling f (5 rows)... ")
        with log.ahead_of_time(background=True) as build:
            build("h", "5 rows", h, x, deferred=True)
        log.start_deferred()  # the first step is done: g and h build now
        log.wait()
        built = sorted(line.split(" (")[0] for line in lines if line.startswith("compiling"))
        assert built == ["compiling f", "compiling g", "compiling h"]
    finally:
        log.close()
    # A deferred build that neither starts before `close` is dropped, unbuilt.
    dropped = []
    log = compilation.CompileLog(write=dropped.append).listen()
    with log.ahead_of_time(background=True) as build:
        build("k", "5 rows", jax.jit(lambda x: jnp.cosh(x) - 6.0 * x), x, deferred=True)
    log.close()
    assert dropped == []
