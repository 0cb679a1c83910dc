"""Roofline estimates of a step's programs on one chip, from the model's arithmetic.

    costs = phase_costs(cfg, flops, rows=..., ...)   # {phase: Cost(flops, hbm_bytes)} per chip
    seconds = predicted_seconds(costs, chip)          # {phase: roofline seconds}

FLOPs are the trainer's model FLOPs (`trainer.perf.step_flops`: the MFU numerator)
divided evenly over the chips. HBM traffic counts what each phase must read: the weights
(gathered from their fsdp shards, so a chip reads every weight not split over `tensor` or
`expert`) once per decode step, once per micro-batch and forward pass of the reference
and the update; the KV cache each decode step attends over; the update's float32 master
copy and Adam moments, read and written once. Activations, collectives (ICI/DCN) and
kernel efficiency are not modelled: a roofline is the time no implementation beats.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Cost:
    """One program's work on one chip."""

    flops: float
    hbm_bytes: float


def kv_bytes_per_token(cfg, itemsize: int) -> int:
    """Bytes of K and V one token keeps in the cache, over all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def phase_costs(
    cfg,
    flops: dict,
    *,
    rows: int,
    prompt_len: float,
    new_tokens: float,
    chips: int,
    weight_shards: int,
    row_shards: int,
    itemsize: int,
    micro_batches: int,
    update_forwards: int,
    reference: bool,
) -> dict[str, Cost]:
    """{phase: Cost per chip} for 'sample', 'reference' (when `reference`) and 'update'.

    flops: `perf.step_flops`'s {phase: model FLOPs of the whole step}; rows: sequences
    (prompts x G); weight_shards: how many ways a chip's weights are split for compute
    (tensor x expert); row_shards: how many ways the rows are (data x fsdp x expert);
    itemsize: bytes of a weight; update_forwards: `UpdateFn.forward_passes` (3 for a
    forward + backward)."""
    weights = cfg.num_params() * itemsize / weight_shards
    P, T = float(prompt_len), float(new_tokens)
    kv = kv_bytes_per_token(cfg, itemsize) * (P + T / 2) * (rows / row_shards)
    sample = (1 + max(T - 1, 0)) * weights + max(T - 1, 0) * kv
    passes = micro_batches * weights
    # float32 master copy + two moments + the gradient, read and written once.
    optimizer = 2 * 16 * cfg.num_params() / chips
    costs = {
        "sample": Cost(flops["sample"] / chips, sample),
        "update": Cost(flops["update"] / chips, passes * update_forwards + optimizer),
    }
    if reference:
        costs["reference"] = Cost(flops["reference"] / chips, passes)
    return costs


def roofline_s(flops: float, hbm_bytes: float, chip) -> float:
    """The roofline time of a program on one chip (`tpu.chips.Chip`): the longer of its
    FLOPs at the chip's peak bf16 rate and its HBM traffic at the chip's bandwidth."""
    return max(flops / chip.bf16_flops, hbm_bytes / chip.hbm_bandwidth)


def predicted_seconds(costs: dict[str, Cost], chip) -> dict[str, float]:
    """{phase: roofline seconds on `chip`} of `phase_costs`' costs."""
    return {phase: roofline_s(c.flops, c.hbm_bytes, chip) for phase, c in costs.items()}
