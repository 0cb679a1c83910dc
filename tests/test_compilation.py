"""Start-up compilation: the programs are compiled before the first step, each says so in
one line, and a second run in a fresh process loads them stored (or from XLA's cache, and
stores them then)."""

import copy
import os
import re
import subprocess
import sys
import time
from concurrent.futures import CancelledError

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_run
from tiny_run import make_model_dir

from jaxrl_llm import compilation, executables, run
from jaxrl_llm.metrics import read_metrics

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("tiny_model")))


def _train(model_dir, workdir, cache, *overrides) -> list[str]:
    """The command line in a fresh process, on one device -> its lines about compiled
    and loaded programs."""
    env = dict(os.environ, TINY_MODEL_DIR=model_dir, PYTHONPATH=os.pathsep.join([ROOT, HERE]),
               XLA_FLAGS="--xla_force_host_platform_device_count=1")  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl_llm.train", f"--config={HERE}/tiny_run.py",
         f"--workdir={workdir}", f"--config.train.compilation_cache_dir={cache}",
         "--config.mesh.fsdp=1", "--config.mesh.tensor=1", *overrides],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stderr.replace("\r", "\n")
    # XLA_FLAGS did not name the level: the command line compiles at -O1 on a CPU-only
    # machine (`parallel.xla_flags`) and says so in its start-up line.
    assert "XLA_FLAGS: --xla_backend_optimization_level=1" in text, text[-3000:]
    found = (re.search(r"(compiling|loading) .*", line) for line in text.splitlines())
    return [m.group(0) for m in found if m]


def _learning(workdir) -> list[dict]:
    return [
        {k: v for k, v in m.items() if not k.startswith("perf/")}
        for m in read_metrics(os.path.join(workdir, "metrics.jsonl"))
    ]


def test_second_run_loads_every_program_stored_and_the_cache_backs_it(model_dir, tmp_path):
    cache = tmp_path / "xla"
    cold = _train(model_dir, tmp_path / "cold", cache)
    names = [line.split(" (")[0] for line in cold]
    # tiny_run: GRPO (a reference model: the initial policy), 16-token prompt bucket, no
    # evaluation. The first update reads no reference log-probs: the reference is built
    # last, once the first step is done, for the second.
    assert names == ["compiling sampler", "compiling update", "compiling reference"]
    assert all("(bucket 16)" in line and "compilation cache" not in line for line in cold)
    first, second = read_metrics(tmp_path / "cold" / "metrics.jsonl")
    assert first["perf/compile_s"] == second["perf/compile_s"] == 0.0  # none in the steps
    assert first["perf/reference_s"] < 0.01 and first["policy/kl_ref"] == 0.0
    assert second["policy/kl_ref"] != 0.0  # the reference forward's, off the moved policy
    stored = sorted(os.listdir(cache / "executables"))
    assert len(stored) == 3

    # A rerun loads the three executables: nothing is traced, lowered or compiled; one
    # more step and another checkpoint setting (keys no program reads) do not matter.
    warm = _train(model_dir, tmp_path / "warm", cache, "--config.train.num_steps=3",
                  "--config.checkpoint.keep=1")  # fmt: skip
    expected = sorted(name.replace("compiling", "loading") for name in names)
    assert sorted(line.split(" (")[0] for line in warm) == expected, warm
    assert all(line.endswith("(stored executable)") for line in warm), warm
    assert _learning(tmp_path / "warm")[:2] == _learning(tmp_path / "cold")
    assert len(_learning(tmp_path / "warm")) == 3
    assert sorted(os.listdir(cache / "executables")) == stored

    # Without the stored executables XLA's cache answers, and what it answered is stored
    # as the cache held it: the next run loads all three again.
    for name in stored:
        os.remove(cache / "executables" / name)
    cached = _train(model_dir, tmp_path / "cached", cache)
    assert sorted(line.split(" (")[0] for line in cached) == sorted(names), cached
    assert all(line.endswith("(compilation cache)") for line in cached), cached
    assert _learning(tmp_path / "cached") == _learning(tmp_path / "cold")
    assert len(os.listdir(cache / "executables")) == 3
    again = _train(model_dir, tmp_path / "again", cache)
    assert sorted(line.split(" (")[0] for line in again) == expected, again
    assert all(line.endswith("(stored executable)") for line in again), again
    assert _learning(tmp_path / "again") == _learning(tmp_path / "cold")


def test_the_stored_programs_key_leaves_out_only_keys_no_program_reads():
    base = tiny_run.signal_config("model-dir")
    key = run.store_context(base)

    def changed(**keys):
        c = copy.deepcopy(base)
        for dotted, value in keys.items():
            section, name = dotted.split("__")
            c[section][name] = value
        return run.store_context(c)

    assert base.optim.schedule == "constant"
    same = {"train__num_steps": 1000, "train__log_every": 7, "checkpoint__every": 3,
            "eval__every": 5, "train__verifier_workers": 2, "logging__wandb": True}  # fmt: skip
    for dotted, value in same.items():
        assert changed(**{dotted: value}) == key, dotted
    other = {"train__seed": 1, "optim__learning_rate": 0.5, "optim__warmup_steps": 2,
             "train__logprob_chunk": 8, "eval__num_prompts": 3,
             "rollout__max_new_tokens": 5}  # fmt: skip
    for dotted, value in other.items():
        assert changed(**{dotted: value}) != key, dotted
    # A decaying schedule reads the number of steps.
    cosine = changed(optim__schedule="cosine")
    assert changed(optim__schedule="cosine", train__num_steps=1000) != cosine


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


class _Failing:
    """A lowered program whose compile fails (as XLA running out of memory would)."""

    out_info = jax.ShapeDtypeStruct((7,), np.float32)

    def compile(self):
        raise RuntimeError("no memory left to compile")


def test_background_builds_serve_their_first_calls_and_raise_their_errors():
    """background=True: the block ends with the programs still building; the first call
    of each waits for its own build and runs the executable it installed (no compile of
    its own); a build's error raises in the call that waits for it. The first program
    builds alone, the others once it is done; their compiles are start-up's, not in
    `seconds` (a step's perf/compile_s)."""
    lines, order = [], []
    x = np.arange(7, dtype=np.float32)
    f = executables.Program(jax.jit(lambda x: jnp.tanh(x) * 5.0 - x))
    g = executables.Program(jax.jit(lambda x: jnp.exp(-x) + 2.0 * x))

    class Broken(executables.Program):
        def lower(self, *args, **kwargs):
            return _Failing()

    broken = Broken(jax.jit(lambda x: x + 1.0))
    log = compilation.CompileLog(write=lines.append).listen()
    compile_f = log._compile

    def recorded(name, *args):
        order.append((name, "start"))
        try:
            return compile_f(name, *args)
        finally:
            order.append((name, "end"))

    log._compile = recorded
    try:
        with log.ahead_of_time(background=True) as build:
            build("f", "7 rows", f, x)
            build("g", "7 rows", g, x)
            build("broken", "7 rows", broken, x)
        assert f.pending and g.pending and broken.pending  # left building
        seconds = log.seconds
        with log.program("first calls") as calls:
            np.testing.assert_allclose(f(x), np.tanh(x) * 5.0 - x, atol=1e-5)
            np.testing.assert_allclose(g(x), np.exp(-x) + 2.0 * x, atol=1e-5)
        assert calls.compiles == 0 and not f.pending and not g.pending
        with pytest.raises(RuntimeError, match="no memory left to compile"):
            broken(x)
        with pytest.raises(RuntimeError, match="no memory left to compile"):
            log.wait()  # waits for them all; the failed build's error again
    finally:
        log.close()
    assert order[:2] == [("f", "start"), ("f", "end")]  # the first alone
    assert {name for name, _ in order[2:]} == {"g", "broken"}
    assert log.seconds == seconds == 0.0
    assert sorted(line.split(" (")[0] for line in lines) == ["compiling f", "compiling g"]
    assert not any(line.startswith("programs ready") for line in lines)  # one build failed


def test_a_gated_build_starts_when_its_gate_opens_and_is_dropped_if_it_never_does():
    """build(..., gate=): the program is traced at once but compiles only once the gate
    opens (its first call then finds it installed); a gate that never opens before
    `close` drops its build, and `close` does not wait for it."""
    lines = []
    x = np.arange(5, dtype=np.float32)
    f = executables.Program(jax.jit(lambda x: jnp.sinh(x) - 3.0 * x))
    g = executables.Program(jax.jit(lambda x: jnp.cosh(x) + 4.0 * x))
    opened, never = compilation.Gate(), compilation.Gate()
    log = compilation.CompileLog(write=lines.append).listen()
    try:
        with log.ahead_of_time(background=True) as build:
            build("f", "5 rows", f, x, gate=opened)
            build("g", "5 rows", g, x, gate=never)
        time.sleep(0.5)
        assert lines == [] and f.pending and g.pending  # neither has started
        opened.open()
        with log.program("first call") as call:
            np.testing.assert_allclose(f(x), np.sinh(x) - 3.0 * x, rtol=1e-5)
        assert call.compiles == 0 and lines[0].startswith("compiling f (5 rows)... ")
    finally:
        log.close()
    assert all(future.cancelled() or isinstance(future.exception(), CancelledError)
               for future in g.pending.values())  # fmt: skip
    assert [line.split(" (")[0] for line in lines] == ["compiling f"]  # g was dropped
    np.testing.assert_allclose(g(x), np.cosh(x) + 4.0 * x, rtol=1e-5)  # compiles at use
