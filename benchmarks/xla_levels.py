"""XLA:CPU's LLVM optimisation level: compile time and step time of a run's programs.

    python benchmarks/xla_levels.py --config=../shared/anchors/jaxrl_w1_config.py
    python benchmarks/xla_levels.py --config=configs/smollm2_arithmetic_cpu.py --rounds=4

One process builds the run (`train.Run`, the config as the trainer would pick it), lowers
its sampler, reference (beta > 0) and update once at the first batch's shapes, then:

- compile: each level of --levels in turn compiles the three programs (per compile
  `xla_backend_optimization_level` in the compile options, jax's in-memory caches
  cleared and the programs lowered again before each level, the persistent cache off),
  --compile-rounds rounds, every other round in reverse order: the machine's drift
  reaches the levels alike;
- run: the programs of the first two levels run in turn on the same inputs (the rollout
  of the first sampler, random rewards, a fresh copy of the state for each update),
  --rounds rounds after one untimed call each.

Printed: per program and level the median [min, max] seconds of each. The command line
compiles at level 1 on a CPU-only machine (`jaxrl_llm/parallel/xla_flags.py`); XLA's
own default is 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_name, table, uptime  # noqa: E402

from jaxrl_llm.parallel import allocator  # noqa: E402

LEVEL = "xla_backend_optimization_level"


def _spread(values) -> str:
    return f"{np.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/quickstart.py")
    p.add_argument("--levels", default="1,2", help="levels to compile at; the first two run")
    p.add_argument("--compile-rounds", type=int, default=3)
    p.add_argument("--rounds", type=int, default=16, help="timed calls per program and level")
    args, extra = p.parse_known_args()
    levels = [int(x) for x in args.levels.split(",")]

    import jax
    import jax.numpy as jnp
    from absl import flags
    from ml_collections import config_flags

    from jaxrl_llm import parallel, rl, train
    from jaxrl_llm.startup import compilation

    config_flags.DEFINE_config_file("config", None, "run config", lock_config=False)
    flags.FLAGS([sys.argv[0], f"--config={args.config}", *extra])
    config = flags.FLAGS.config
    config.train.compilation_cache_dir = ""
    compilation.use_cache("")
    print(f"device: {device_name()}; {uptime()}", flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        run = train.Run.build(config, workdir)
        print(run.tuning_line, flush=True)
        batch = next(run.sampling.data)
        params, rows = run.sampler_params(), run.sampling.row_sharding
        sampler, s_args, s_kwargs = run.sampling.sampler.sample_program(
            params, batch.prompt_ids, batch.prompt_mask, run.spec
        )
        s_dynamic = {k: v for k, v in s_kwargs.items() if k != "spec"}
        out_info = compilation.shaped(sampler.lower(*s_args, **s_kwargs).out_info, rows)
        ref_info = None
        if run.ref_logprobs is not None:
            ref_info = compilation.shaped(
                run.ref_logprobs.lower(run.ref_params, out_info).out_info, rows
            )
        n = out_info.tokens.shape[0] // jax.process_count()
        rewards = np.random.default_rng(0).standard_normal(n).astype(np.float32)
        rewards = parallel.shard_local_batch(rewards, run.mesh)
        update, u_args = run.update.program(
            run.state, rl.RolloutBatch.from_sample(out_info, rewards, ref_info)
        )

        def lowered() -> dict:
            out = {"sampler": sampler.lower(*s_args, **s_kwargs)}
            if ref_info is not None:
                out["reference"] = run.ref_logprobs.lower(run.ref_params, out_info)
            out["update"] = update.lower(*u_args)
            return out

        seconds, compiled = {}, {}
        for r in range(args.compile_rounds):
            for level in levels if r % 2 == 0 else levels[::-1]:
                jax.clear_caches()
                for name, program in lowered().items():
                    start = time.perf_counter()
                    compiled[name, level] = program.compile({LEVEL: level})
                    seconds.setdefault((name, level), []).append(time.perf_counter() - start)
                print(f"compiled at level {level} (round {r + 1})", flush=True)
        rows_out = [
            {"program": name, "level": level, "compile s": _spread(v)}
            for (name, level), v in seconds.items()
        ]

        timed = {}
        out = compiled["sampler", levels[0]](*s_args, **s_dynamic)
        ref = None
        if ref_info is not None:
            ref = compiled["reference", levels[0]](run.ref_params, out)
        rollouts = rl.RolloutBatch.from_sample(out, rewards, ref)
        _, u_inputs = run.update.program(run.state, rollouts)

        def call(name, level):
            if name == "sampler":
                return compiled[name, level](*s_args, **s_dynamic)
            if name == "reference":
                return compiled[name, level](run.ref_params, out)
            state = jax.block_until_ready(jax.tree.map(jnp.copy, u_inputs[0]))  # donated
            return compiled[name, level](state, *u_inputs[1:])

        names = [k for k in ("sampler", "reference", "update") if (k, levels[0]) in compiled]
        for r in range(args.rounds + 1):
            for level in levels[:2] if r % 2 == 0 else levels[:2][::-1]:
                for name in names:
                    start = time.perf_counter()
                    jax.block_until_ready(call(name, level))
                    if r:  # the first call of each is not timed
                        timed.setdefault((name, level), []).append(time.perf_counter() - start)
        for row in rows_out:
            key = (row["program"], row["level"])
            row["run s"] = _spread(timed[key]) if key in timed else ""
        run.close()
    print(f"\n{uptime()}")
    print(table(rows_out, ["program", "level", "compile s", "run s"]))


if __name__ == "__main__":
    allocator.reexec_with_tcmalloc()  # as the trainer's command line does
    main()
