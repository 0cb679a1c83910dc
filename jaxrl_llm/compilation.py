"""XLA compilation at start-up: the persistent cache, one line per compiled program, and
the step's programs compiled before the first step, side by side.

    compilation.use_cache(config.train.compilation_cache_dir)    # "" = off
    with compilation.CompileLog(write=progress.write) as log:    # or log.listen() ... close()
        with log.program("sampler", "bucket 24"):   # "compiling sampler (bucket 24)... 9.8 s"
            out = sampler.sample(...)
        with log.ahead_of_time(store=store) as build:   # compiled side by side, in threads
            out_info = build("sampler", "bucket 24", program, *args, **kwargs)

Attribution: XLA reports each compile through `jax.monitoring` in the thread that
compiles, so a thread-local label names the program. A program found in the persistent
cache is reported as loaded from it; so is one from the executable store
(`executables`), which a rerun of the same code and config loads without tracing it.
`log.seconds` is the total XLA compile time (`perf/compile_s`; loads from either count as
compiles there).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import threading
import time

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from jaxrl_llm import executables

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"


def use_cache(path: str) -> str | None:
    """Turns XLA's persistent compilation cache on in `path` (every program, however
    small or quick to compile), or off for "" -> the directory in use, or None.

    The setting is process-wide (a jax option); changing it resets jax's cache handle so
    the new directory takes effect."""
    path = os.path.abspath(os.path.expanduser(path)) if path else None
    if jax.config.jax_compilation_cache_dir != path:
        if path:
            os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        compilation_cache.reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


@dataclasses.dataclass
class Compiled:
    """What building a program cost: XLA compiles (count and seconds, loads from the
    persistent cache included), how many of them the cache answered, and the wall time
    of the build, tracing and lowering included (None where the block also ran
    programs). A stored executable counts as one compile answered by the cache."""

    name: str
    detail: str = ""
    compiles: int = 0
    compile_s: float = 0.0
    cache_hits: int = 0
    wall_s: float | None = 0.0
    stored: bool = False  # loaded from the executable store (`executables`)

    @property
    def line(self) -> str:
        label = f"{self.name} ({self.detail})" if self.detail else self.name
        seconds = self.compile_s if self.wall_s is None else self.wall_s
        if self.stored:
            return f"loading {label}... {seconds:.1f} s (stored executable)"
        where = " (compilation cache)" if self.cache_hits == self.compiles else ""
        return f"compiling {label}... {seconds:.1f} s{where}"


class CompileLog:
    """Listens to XLA compile events while entered; see the module doc.

    write: called with one line per program that compiled or was loaded from the cache
    (None: silent). Programs built outside `program(...)` only add to `seconds`."""

    def __init__(self, write=None):
        self.write = write
        self.seconds = 0.0
        self.programs: list[Compiled] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._listening = False

    def listen(self, write=None) -> CompileLog:
        """Starts listening to XLA's compile events (and writing lines with `write`,
        when given) until `close`."""
        if write is not None:
            self.write = write
        if not self._listening:
            jax.monitoring.register_event_duration_secs_listener(self._on_duration)
            jax.monitoring.register_event_listener(self._on_event)
            self._listening = True
        return self

    def close(self) -> None:
        if self._listening:
            jax.monitoring.unregister_event_duration_listener(self._on_duration)
            jax.monitoring.unregister_event_listener(self._on_event)
            self._listening = False

    def __enter__(self) -> CompileLog:
        return self.listen()

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_duration(self, event: str, duration: float, **_) -> None:
        if event != BACKEND_COMPILE:  # reported for loads from the persistent cache too
            return
        current = getattr(self._local, "current", None)
        with self._lock:
            self.seconds += duration
            if current is not None:
                current.compiles += 1
                current.compile_s += duration

    def _on_event(self, event: str, **_) -> None:
        if event == CACHE_HIT and (current := getattr(self._local, "current", None)):
            with self._lock:
                current.cache_hits += 1

    @contextlib.contextmanager
    def program(self, name: str, detail: str = "", traced_s: float = 0.0, runs: bool = False):
        """Attributes the compiles of this thread inside the block to `name`; on exit,
        when any happened, records the program and writes its line. traced_s: tracing
        and lowering time spent before the block, added to its wall time. runs: the block
        also waits for programs to run, so its line gives XLA's compile seconds instead
        of the block's wall time."""
        record, outer = Compiled(name, detail), getattr(self._local, "current", None)
        self._local.current, start = record, time.perf_counter()
        try:
            yield record
        finally:
            self._local.current = outer
            record.wall_s = None if runs else traced_s + time.perf_counter() - start
            if record.compiles:
                with self._lock:
                    self.programs.append(record)
                if self.write is not None:
                    self.write(record.line)

    @contextlib.contextmanager
    def ahead_of_time(self, side_by_side: bool = True, store=None):
        """Yields `build(name, detail, program, *args, **kwargs) -> out_info` (the
        program's output shapes, which shape the next program's inputs).

        store (an `executables.Store`; None: none): a `executables.Program` found there
        is loaded, not traced, lowered or compiled; one that is not is stored once
        compiled. Otherwise `build` traces and lowers the program here (tracing holds the
        GIL) and compiles it in a thread of its own: XLA compiles (and deserializes)
        outside the GIL, so the programs share the cores. The block ends when every
        program is ready; each then serves its first call with the same shapes and
        shardings without compiling. side_by_side=False: each is ready before `build`
        returns."""
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=4 if side_by_side else 1)
        futures, start_all = [], time.perf_counter()

        def build(name: str, detail: str, program, *args, **kwargs):
            start = time.perf_counter()
            keep = store if isinstance(program, executables.Program) else None
            if keep is not None and (entry := keep.read(name, program, args, kwargs)):
                job = (self._load, name, detail, program, entry, keep, args, kwargs)
                out_info = entry.out_info
            else:
                lowered = program.lower(*args, **kwargs)
                traced_s = time.perf_counter() - start
                save = None if keep is None else (keep, program, args, kwargs)
                job = (self._compile, name, detail, lowered, traced_s, save)
                out_info = lowered.out_info
            futures.append(pool.submit(*job))
            if not side_by_side:
                futures[-1].result()
            return out_info

        try:
            yield build
            built = [future.result() for future in futures]
        finally:
            pool.shutdown(wait=True)
        if self.write is not None and built:
            cached = sum(0 < p.compiles == p.cache_hits for p in built)
            seconds = time.perf_counter() - start_all
            how = "side by side" if side_by_side else "one by one"
            self.write(f"programs ready in {seconds:.1f} s ({len(built)} built {how}, "
                       f"{cached} from the compilation cache)")  # fmt: skip

    def _compile(self, name: str, detail: str, lowered, traced_s: float, save=None):
        with self.program(name, detail, traced_s) as record, executables.cache_reads() as reads:
            compiled = lowered.compile()
            # An executable that XLA's persistent cache answered is stored as the cache
            # held it (reloaded, it would serialize without its kernels).
            cached = reads[0] if record.cache_hits and len(reads) == 1 else None
            if save is not None and (cached is not None or not record.cache_hits):
                store, program, args, kwargs = save  # save: store, program, args
                program.install(store.save(name, program, args, kwargs, compiled, cached))
        return record

    def _load(self, name: str, detail: str, program, entry, store, args, kwargs) -> Compiled:
        """A stored program: deserialized here, counted as a compile answered by the
        cache; one that does not load is compiled (and stored again) instead."""
        start = time.perf_counter()
        if (loaded := entry.load()) is None:
            lowered = program.lower(*args, **kwargs)
            save = (store, program, args, kwargs)
            return self._compile(name, detail, lowered, time.perf_counter() - start, save)
        program.install(loaded)
        seconds = time.perf_counter() - start
        record = Compiled(name, detail, 1, seconds, 1, seconds, stored=True)
        with self._lock:
            self.seconds += seconds
            self.programs.append(record)
        if self.write is not None:
            self.write(record.line)
        return record


def shaped(out_info, sharding):
    """A program's output shapes (`Lowered.out_info`) as ShapeDtypeStructs with the given
    (pinned) sharding: the inputs of the programs that read them."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type),
        out_info,
    )


def precompile_step(run, side_by_side: bool = True) -> None:
    """Compiles a `train.Run`'s sampler, reference and update side by side before its
    first step, at the shapes of the batch that step will read, and evaluation's sampler
    programs when evaluation is scheduled (`CompileLog.ahead_of_time`). The rollouts and
    log-probs are pinned to row sharding (`Sampler.row_sharding`), so the reference and
    the update can be compiled from the sampler's output shapes alone. Other prompt
    buckets compile when they first come. side_by_side=False: one after another."""
    from jaxrl_llm import parallel, rl

    position = run.data_iter.state()
    batch = next(run.data_iter)
    run.data_iter.restore(position)
    params, rows = run.sampler_params(), run.row_sharding
    bucket = f"bucket {run.sampler.bucketed(batch.prompt_ids, batch.prompt_mask)[0].shape[1]}"
    with run.compile_log.ahead_of_time(side_by_side, run.executable_store()) as build:
        program, args, kwargs = run.sampler.sample_program(
            params, batch.prompt_ids, batch.prompt_mask, run.spec
        )
        out, ref = shaped(build("sampler", bucket, program, *args, **kwargs), rows), None
        if run.ref_logprobs is not None:
            ref = shaped(build("reference", bucket, run.ref_logprobs, run.ref_params, out), rows)
        local_rows = out.tokens.shape[0] // jax.process_count()
        rewards = parallel.shard_local_batch(np.zeros(local_rows, np.float32), run.mesh)
        rollouts = rl.RolloutBatch.from_sample(out, rewards, ref)
        program, args = run.update.program(run.state, rollouts)
        build("update", bucket, program, *args)
        if run.eval_batches:
            _evaluation(run, build, params)


def _evaluation(run, build, params) -> None:
    """Evaluation's sampler programs (greedy, pass@k) at its first batch's bucket."""
    from jaxrl_llm import evaluation

    e, first = run.config.eval, run.eval_batches[0]
    ids, mask = first.prompt_ids, first.prompt_mask
    bucket = f"bucket {run.sampler.bucketed(ids, mask)[0].shape[1]}"
    for spec in filter(None, evaluation.specs(run.spec, e.pass_k, e.temperature)):
        what = "greedy" if spec.temperature == 0 else f"pass@{spec.num_generations}"
        program, args, kwargs = run.sampler.sample_program(params, ids, mask, spec)
        build(f"evaluation sampler, {what}", bucket, program, *args, **kwargs)
