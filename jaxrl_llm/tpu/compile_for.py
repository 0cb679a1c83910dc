"""A run's programs compiled for a TPU topology from a CPU process: will it fit, how fast.

    python -m jaxrl_llm.train --config=configs/<experiment>.py --compile_for=v6e:2x4

Builds the programs one RL step executes, with the trainer's own builders (the rollout
engine's `device_programs`, `trainer.programs.make_reference`, `trainer.programs.make_update`)
and the config's shapes (the model's config.json, the largest prompt bucket, the full
completion budget), on the config's mesh over the topology's chips
(`tpu.chips.topology_devices`), from abstract arrays (`jax.ShapeDtypeStruct` with the run's
shardings): no weight is made, nothing is read or downloaded but the model's config.json
(or, for the hub models the shipped configs name, their shapes in
`config.model_shapes`). Each program is lowered and compiled by XLA:TPU; per chip it
reports the compiler's memory analysis (arguments, temporaries, peak against the chip's
HBM) and cost analysis, and a roofline time from the model's FLOPs and HBM traffic
(`roofline`). Exit status 2 with one line
when a program does not fit.

With `rollout.workers` = N > 0 the rollout runs in N worker worlds of their own
(docs/workers.md); `--compile_workers_for=v6e:2x4` names one worker's topology, and the
engine's programs are compiled for it on the worker's mesh (`mesh.rollout`), the
reference and the update for the trainer's topology: a disaggregated step from one CPU
process.

XLA's cost analysis counts a loop body once (the layer scan, the micro-batch scan, the
decode loop), so its FLOPs and bytes are those of one iteration: printed as the
compiler's, while the roofline uses the model's FLOPs (`trainer.perf.step_flops`, the
trainer's MFU numerator) and the weights and KV cache each phase must read.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm import config as config_lib
from jaxrl_llm import models, parallel
from jaxrl_llm.config.derived import ConfigError
from jaxrl_llm.config.model_shapes import model_config
from jaxrl_llm.parallel import target
from jaxrl_llm.tpu import roofline
from jaxrl_llm.tpu.chips import (
    GiB,
    Topology,
    TopologyError,
    parse_topology,
    topology_devices,
)
from jaxrl_llm.tpu.report import Program, Report, peak_bytes, print_report

__all__ = ["DoesNotFit", "Program", "Report", "compile_config", "print_report", "run"]


@dataclasses.dataclass(frozen=True)
class _Rollout:
    """Where the rollout engine's programs run: the trainer's mesh (or its split-mode
    rollout mesh) on its topology, or one rollout worker's world."""

    config: object  # the config the engine is built from (a worker's: `worker_config`)
    mesh: object
    devices: list
    topology: Topology
    workers: int = 0  # rollout.workers; 0: in the trainer's world


def compile_config(raw, topology: str, out=sys.stdout, only=None, workers=None) -> Report:
    """Compiles run config `raw`'s step for `topology` ('v6e:2x4'); prints and returns
    the report. only: the names of the programs to compile (default all); the others are
    lowered only, for the shapes of what they produce. workers: one rollout worker's
    topology (with `rollout.workers` > 0), where the engine's programs are compiled."""
    from jaxrl_llm.config import checks, tuning

    topo = parse_topology(topology)
    n = raw.rollout.get("workers", 0)
    if workers is not None and not n:
        raise ConfigError(
            f"--compile_workers_for={workers}: the config has no rollout workers "
            f"(rollout.workers=0); set rollout.workers=N (docs/workers.md)"
        )
    devices = topology_devices(topo)
    with target.compiling_for(devices):  # the checks that read no data, no model
        shape = checks.check_mesh(raw, len(devices))
        checks.check_rollout(raw, shape, 1)
        checks.check_algo(raw)
        checks.check_optim(raw)
    cfg = model_config(raw)
    c, line = tuning.resolve(raw, cfg, "tpu", batch_shards=shape[0] * shape[1] * shape[2])
    train_devices, rollout_devices = config_lib.split_devices(c, devices)
    mesh = parallel.make_mesh(config_lib.mesh_axes(c.mesh), train_devices)
    rollout = _Rollout(c, mesh, devices, topo)
    if rollout_devices:
        rollout_mesh = parallel.make_mesh(config_lib.mesh_axes(c.mesh.rollout), rollout_devices)
        rollout = _Rollout(c, rollout_mesh, devices, topo)
    print(
        f"{topo}: mesh {dict(mesh.shape)}; {cfg.architecture}, "
        f"{cfg.num_params() / 1e9:.2f}B parameters, {c.model.dtype}; the step compiled "
        f"(not run) by XLA:TPU",
        file=out,
        flush=True,
    )
    if line:
        print(f"  {line}", file=out, flush=True)
    if workers is not None:
        try:
            worker_topo = parse_topology(workers)
        except TopologyError as err:  # its message names the trainer's flag
            text = str(err).replace("--compile_for", "--compile_workers_for")
            raise TopologyError(text) from None
        rollout = _worker_rollout(raw, cfg, worker_topo, n)
        print(
            f"rollout workers: {n}, each {rollout.topology}: mesh "
            f"{dict(rollout.mesh.shape)}; the engine's programs compiled for it",
            file=out,
            flush=True,
        )
    build = functools.partial(_compile, out=out, only=only)
    report = _compile_step(c, cfg, mesh, rollout, topo, devices, build)
    print_report(report, out)
    return report


def _worker_rollout(raw, cfg, topo: Topology, n: int) -> _Rollout:
    """One rollout worker's world on `topo`, its mesh and config as `workers.serve` makes
    them (`worker_config`: the rollout mesh's shape over the worker's chips)."""
    from jaxrl_llm.config import checks, tuning
    from jaxrl_llm.workers.serve import worker_config

    devices = topology_devices(topo)
    wraw = worker_config(raw)
    with target.compiling_for(devices):
        shape = checks.check_mesh(wraw, len(devices))
        checks.check_rollout(wraw, shape, 1)
    wc, _ = tuning.resolve(wraw, cfg, "tpu", batch_shards=shape[0] * shape[1] * shape[2])
    mesh = parallel.make_mesh(config_lib.mesh_axes(wc.mesh), devices)
    return _Rollout(wc, mesh, devices, topo, workers=n)


def _compile_step(c, cfg, mesh, rollout: _Rollout, topo, devices, build) -> Report:
    """Sampler, reference, update: compiled in the order the step runs them, the
    engine's programs for `rollout`'s chips, the reference and update for `devices`."""
    from jaxrl_llm import rl, sampling
    from jaxrl_llm.rollout.sources import make_sampler
    from jaxrl_llm.startup.compilation import shaped
    from jaxrl_llm.trainer import perf
    from jaxrl_llm.trainer.programs import make_reference, make_update

    algo = config_lib.algo_config(c)
    skipped = _not_compiled(c, algo)
    r = c.rollout
    B, G = r.batch_size, r.num_generations
    width = sampling.bucket_length(c.data.max_prompt_len, config_lib.tuning.bucket_steps(c, "tpu"))
    spec = sampling.RolloutSpec(
        num_generations=G,
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        stop_ids=(0,),
    )
    params = abstract_params(cfg, mesh, c.model.dtype)
    rc, rmesh = rollout.config, rollout.mesh
    engine = make_sampler(rc, cfg, rmesh, pad_id=0)  # rollout.engine's
    rows = parallel.batch_sharding(rmesh, 2)
    ids = jax.ShapeDtypeStruct((B, width), jnp.int32, sharding=rows)
    mask = jax.ShapeDtypeStruct((B, width), jnp.bool_, sharding=rows)
    sample_params = params if rmesh is mesh else abstract_params(cfg, rmesh, c.model.dtype)
    # The first is "sampler", whose output the reference and the update read.
    with target.compiling_for(rollout.devices):
        programs = engine.device_programs(sample_params, ids, mask, spec)
        built = [build(*p) for p in programs]
    engine_programs = {b.name for b in built}
    sample_out = shaped(built[0].out_info, NamedSharding(mesh, P(parallel.BATCH_AXES)))
    ref = None
    with target.compiling_for(devices):
        reference = make_reference(c, algo, cfg, spec, mesh)
        if reference is not None:
            built.append(build("reference", reference, (params, sample_out), {}))
            ref = sample_out.logprobs
        opt = rl.optimizer_from_config(c.optim, c.train.num_steps)
        update = make_update(c, algo, cfg, opt, spec)
        state = abstract_state(params, opt, mesh)
        batch = parallel.batch_sharding(mesh, 1)
        rewards = jax.ShapeDtypeStruct((B * G,), jnp.float32, sharding=batch)
        rollouts = rl.RolloutBatch.from_sample(sample_out, rewards, ref)
        program, args = update.program(state, rollouts)
        built.append(build("update", program, args, {}))
    flops = perf.step_flops(
        cfg,
        rows=B * G,
        prompts=B,
        prompt_len=width,
        new_tokens=r.max_new_tokens,
        reference=reference is not None,
        update_forwards=update.forward_passes,
        update_shared_forwards=update.shared_prompt_passes,
        reference_shares_prompts=G > 1,
    )

    def costs_on(mesh, chips: int) -> dict:
        m = dict(mesh.shape)
        return roofline.phase_costs(
            cfg,
            flops,
            rows=B * G,
            prompt_len=width,
            new_tokens=r.max_new_tokens,
            chips=chips,
            weight_shards=m.get("tensor", 1) * m.get("expert", 1),
            row_shards=parallel.batch_size_multiple(mesh),
            itemsize=jnp.dtype(c.model.dtype).itemsize,
            micro_batches=c.optim.micro_batches * c.optim.mini_batches,
            update_forwards=update.forward_passes,
            reference=reference is not None,
        )

    costs = costs_on(mesh, topo.num_chips)
    phase_s = roofline.predicted_seconds(costs, topo.chip)
    if rollout.workers:  # a step sampled whole by one worker, on its chips
        costs["sample"] = costs_on(rmesh, rollout.topology.num_chips)["sample"]
        phase_s["sample"] = roofline.predicted_seconds(costs, rollout.topology.chip)["sample"]
    phase = {"sampler": "sample", "reference": "reference", "update": "update"}
    # The paged engine's chunks, one call each: a decode chunk's share of the sampler's
    # roofline; a prefill chunk's is left in the sampler's (0 here).
    T, chunk = r.max_new_tokens, rc.rollout.paged.chunk_steps
    share = {"paged decode": chunk / T, "paged prefill": 0.0}
    programs = []
    for b in (b for b in built if b.compiled is not None):
        cost = costs[phase.get(b.name, "sample")]
        if b.name in share:
            cost = roofline.Cost(cost.flops * share[b.name], cost.hbm_bytes * share[b.name])
        on = rollout.topology if b.name in engine_programs else topo
        programs.append(_measure(b, cost, on, on is not topo))
    if rollout.workers:
        skipped = [*skipped, "the weight sync to the workers (host path: docs/workers.md)"]
    elif c.rollout.workers:
        skipped = [
            *skipped,
            f"the rollout workers' engine (rollout.workers={c.rollout.workers}): its programs "
            f"were compiled for the trainer's chips instead; --compile_workers_for=TOPOLOGY "
            f"compiles them for a worker's",
        ]
    in_flight = 0
    if rollout.workers and r.max_staleness >= 1:
        in_flight = min(rollout.workers, r.max_staleness + 1)
    workers = rollout.topology if rollout.workers else None
    flops_all = sum(flops.values())
    m = dict(mesh.shape)
    return Report(
        topo, m, programs, skipped, flops_all, phase_s, workers, rollout.workers, in_flight
    )


class DoesNotFit(Exception):
    """XLA:TPU refused to compile a program: its buffers exceed the chip's HBM."""

    def __init__(self, program: str, reason: str):
        super().__init__(f"{program}: {reason}")
        self.program, self.reason = program, reason


@dataclasses.dataclass(frozen=True)
class _Built:
    name: str
    compiled: object  # jax.stages.Compiled (None: lowered only)
    out_info: object  # the program's output shapes
    seconds: float  # to lower and compile


def _compile(name, program, args, kwargs, out, only=None) -> _Built:
    """Lowers and (when `only` is None or names it) compiles one program."""
    start = time.perf_counter()
    lowered = program.lower(*args, **kwargs)
    if only is not None and name not in only:
        return _Built(name, None, lowered.out_info, time.perf_counter() - start)
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as err:  # XLA:TPU refuses what exceeds the HBM
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        raise DoesNotFit(name, str(err).strip().splitlines()[0]) from None
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()  # printed now: a long compile's figures survive it
    peak = peak_bytes(mem)
    temp = mem.temp_size_in_bytes / GiB
    print(
        f"  {name}: compiled in {seconds:.0f} s, {peak / GiB:.2f} GiB per chip at its peak "
        f"({temp:.2f} GiB temporaries)",
        file=out,
        flush=True,
    )
    return _Built(name, compiled, lowered.out_info, seconds)


def _measure(built: _Built, cost: roofline.Cost, topo: Topology, own_chip=False) -> Program:
    mem = built.compiled.memory_analysis()
    analysis = built.compiled.cost_analysis() or {}
    if isinstance(analysis, list):  # older jax: one dict per program
        analysis = analysis[0] if analysis else {}
    return Program(
        name=built.name,
        arguments=mem.argument_size_in_bytes,
        outputs=mem.output_size_in_bytes,
        aliased=mem.alias_size_in_bytes,
        temporaries=mem.temp_size_in_bytes,
        compiler_flops=float(analysis.get("flops", 0.0)),
        compiler_bytes=float(analysis.get("bytes accessed", 0.0)),
        model_flops=cost.flops,
        model_bytes=cost.hbm_bytes,
        seconds=roofline.roofline_s(cost.flops, cost.hbm_bytes, topo.chip),
        compile_s=built.seconds,
        kernels=mosaic_kernels(built.compiled.as_text()),
        chip=topo.chip if own_chip else None,
    )


# The names the Pallas kernels jaxrl_llm calls leave in a compiled program's metadata.
_KERNEL = re.compile(
    r"splash_m[hq]a_(?:fwd|dkv|dq)[a-z_]*|\bt?gmm\b|ragged_paged_attention[a-z_]*|"
    r"paged_flash_attention[a-z_]*"
)


def mosaic_kernels(hlo: str) -> tuple[str, ...]:
    """The Pallas kernels in a compiled TPU program's text, by name where the kernel
    leaves one (splash, megablox), else as 'N pallas_call' (the paged-attention kernel);
    none: the program has no Mosaic custom call."""
    calls = hlo.count('custom_call_target="tpu_custom_call"')
    if not calls:
        return ()
    return tuple(sorted(set(_KERNEL.findall(hlo)))) or (f"{calls} pallas_call",)


def abstract_params(cfg, mesh, dtype: str):
    """The model's parameters as ShapeDtypeStructs sharded by the rule table on `mesh`."""
    shardings = models.param_shardings(cfg, mesh)
    dt = jnp.dtype(dtype)
    shapes = models.params.unflatten(
        {path: jax.ShapeDtypeStruct(s.shape, dt) for path, s in models.param_specs(cfg).items()}
    )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


def abstract_state(params, opt, mesh):
    """`rl.TrainState` as `rl.init_train_state` places it, abstract: the subtrees shaped
    like the params (master copy, moments) sharded like them, the rest replicated."""
    from jaxrl_llm import rl

    structure, replicated = jax.tree.structure(params), NamedSharding(mesh, P())

    def like_params(x) -> bool:
        return jax.tree.structure(x) == structure

    def place(x):
        if like_params(x):
            return jax.tree.map(
                lambda a, p: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=p.sharding), x, params
            )
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), x
        )

    opt_state = jax.tree.map(place, jax.eval_shape(opt.init, params), is_leaf=like_params)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    return rl.TrainState(step=step, params=params, opt_state=opt_state)


def _not_compiled(c, algo) -> list[str]:
    """What the run executes that this compile-only run does not build, each with why."""
    skipped = []
    if algo.uses_critic:
        skipped.append("the critic (PPO's value model)")
    if config_lib.lora_config(c) is not None:
        skipped.append("LoRA (the full model's update compiled instead)")
    if c.teacher.path or c.teacher.field:
        skipped.append("the teacher's log-probs (the reference's program, over its params)")
    if any("judge" in str(k) for k in (c.rewards or {})):
        skipped.append("the judges' samplers")
    if c.eval.every > 0:
        skipped.append("evaluation's samplers (the rollout's program at temperature 0)")
    return skipped


def run(raw, topology: str, workers: str | None = None) -> int:
    """The command line's compile-only run: 0 when every program fits, 2 (and one line
    naming the first that does not) otherwise. workers: one rollout worker's topology."""
    try:
        report = compile_config(raw, topology, workers=workers)
    except DoesNotFit as err:  # the compiler's own line says how much it needed
        print(f"does not fit: {err.program}: {err.reason}", file=sys.stderr, flush=True)
        return 2
    big = report.too_big()
    if big is None:
        return 0
    chip = report.chip_of(big)
    print(
        f"does not fit: {big.name} needs {big.peak / GiB:.2f} GiB per chip, a {chip.name} "
        f"chip has {chip.hbm_bytes / GiB:.0f} GiB",
        file=sys.stderr,
        flush=True,
    )
    return 2
