"""What a compile-only run reports: each program's memory and cost on its chip
(`Program`), the step's (`Report`: fits, roofline time, MFU), and the table printed.

    report.too_big()       # the first program over its chip's HBM, or None
    report.step_s, report.mfu
    print_report(report)
"""

from __future__ import annotations

import dataclasses
import sys

from jaxrl_llm.tpu.chips import Chip, GiB, Topology


def peak_bytes(mem) -> int:
    """Bytes live at a compiled program's peak (`Compiled.memory_analysis()`): its
    arguments, its outputs not written over donated arguments, and its temporaries."""
    return (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program's figures on one chip (bytes, FLOPs, seconds)."""

    name: str
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    compiler_flops: float  # XLA's cost analysis: loop bodies counted once
    compiler_bytes: float
    model_flops: float  # per chip, the whole program (`roofline.phase_costs`)
    model_bytes: float
    seconds: float  # roofline time on the chip
    compile_s: float
    kernels: tuple[str, ...] = ()  # the Mosaic (Pallas) kernels in the program
    chip: Chip | None = None  # the chip it was compiled for (None: the trainer's)

    @property
    def peak(self) -> int:
        """Bytes live at the program's peak: its arguments, its outputs not written over
        donated arguments, and its temporaries."""
        return self.arguments + self.outputs - self.aliased + self.temporaries


@dataclasses.dataclass(frozen=True)
class Report:
    """A config's step compiled for a topology (and its rollout workers' topology)."""

    topology: Topology
    mesh: dict
    programs: list[Program]
    not_compiled: list[str]  # what the step runs that was not compiled, and why
    step_flops: float  # model FLOPs of the whole step, all chips
    phase_s: dict  # {phase: roofline seconds} of every phase the step runs, compiled or not
    workers: Topology | None = None  # one rollout worker's topology (rollout.workers > 0)
    worker_count: int = 0
    # Steps the workers sample at once while the trainer updates: min(workers,
    # max_staleness + 1); 0: the rollout and the update take turns.
    in_flight: int = 0

    @property
    def step_s(self) -> float:
        """The step's roofline: sampler, reference, update, from the model's arithmetic,
        so a report of some of the programs (`only`) still predicts the whole step and
        its MFU. Rollout workers sample later steps while the trainer updates
        (`max_staleness` >= 1), each worker a whole step, `in_flight` steps at once: the
        step is the longer of the two sides."""
        if self.in_flight:
            trainer = sum(v for k, v in self.phase_s.items() if k != "sample")
            return max(self.phase_s.get("sample", 0.0) / self.in_flight, trainer)
        return sum(self.phase_s.values())

    @property
    def peak_flops(self) -> float:
        """bf16 FLOP/s of every chip the step runs on, the workers' included."""
        chips = self.topology.chip.bf16_flops * self.topology.num_chips
        if self.workers is not None:
            chips += self.workers.chip.bf16_flops * self.workers.num_chips * self.worker_count
        return chips

    @property
    def mfu(self) -> float:
        return self.step_flops / max(self.step_s, 1e-12) / self.peak_flops

    def too_big(self) -> Program | None:
        """The first program whose peak exceeds its chip's HBM (None: all fit)."""
        return next((p for p in self.programs if p.peak > self.chip_of(p).hbm_bytes), None)

    def chip_of(self, program: Program) -> Chip:
        return program.chip or self.topology.chip


def print_report(report: Report, out=sys.stdout) -> None:
    """The per-chip table: memory against HBM, the compiler's and the model's cost, the
    roofline time; then the step's predicted time and MFU. Programs compiled for the
    rollout workers' chips get a table of their own."""
    head = (
        f"  {'program':<13} {'args GiB':>9} {'temp GiB':>9} {'peak GiB':>9} {'of HBM':>7} "
        f"{'XLA GFLOP':>10} {'XLA GB':>8} {'model TFLOP':>12} {'model GB':>9} "
        f"{'roofline s':>11}"
    )
    trainer = [p for p in report.programs if p.chip is None]
    workers = [p for p in report.programs if p.chip is not None]
    for where, group in (("per chip", trainer), ("per rollout worker chip", workers)):
        if not group and (where != "per chip" or workers):  # an empty table is left out
            continue
        chip = report.chip_of(group[0]) if group else report.topology.chip
        hbm = chip.hbm_bytes / GiB
        print(
            f"{where} ({chip.name}: {hbm:.0f} GiB HBM, {chip.bf16_flops / 1e12:.0f} TFLOP/s "
            f"bf16, {chip.hbm_bandwidth / 1e9:.0f} GB/s):",
            file=out,
        )
        print(head, file=out)
        for p in group:
            print(
                f"  {p.name:<13} {p.arguments / GiB:>9.2f} {p.temporaries / GiB:>9.2f} "
                f"{p.peak / GiB:>9.2f} {p.peak / chip.hbm_bytes:>7.0%} "
                f"{p.compiler_flops / 1e9:>10.1f} {p.compiler_bytes / 1e9:>8.2f} "
                f"{p.model_flops / 1e12:>12.2f} {p.model_bytes / 1e9:>9.1f} "
                f"{p.seconds:>11.3f}",
                file=out,
            )
    for p in report.programs:
        if p.kernels:
            print(f"  {p.name} kernels: {', '.join(p.kernels)}", file=out)
    phases = ", ".join(f"{k} {v:.2f} s" for k, v in report.phase_s.items())
    if report.in_flight:
        phases += (
            f"; the workers sample {report.in_flight} steps at once beside the update, "
            f"the step the longer side"
        )
    print(
        f"step: {report.step_s:.2f} s predicted (roofline: {phases}), MFU {report.mfu:.1%}; "
        f"XLA's FLOPs and bytes count each loop body once",
        file=out,
    )
    for what in report.not_compiled:
        print(f"not compiled: {what}", file=out)
    out.flush()
