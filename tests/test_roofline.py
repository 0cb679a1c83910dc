"""The compile-only run's arithmetic, without libtpu: the roofline of each phase worked
out by hand, the exit status of a step that does not fit, topology names, and the
platform kept on the CPU where libtpu is installed on a machine without a TPU."""

import dataclasses
import os

import pytest

from jaxrl_llm.tpu import chips, compile_for, roofline


def test_a_program_too_big_for_the_chip_exits_2(monkeypatch, capsys):
    GiB = chips.GiB

    def program(name, temporaries):
        return compile_for.Program(
            name=name,
            arguments=2 * GiB,
            outputs=2 * GiB,
            aliased=2 * GiB,
            temporaries=temporaries,
            compiler_flops=1.0,
            compiler_bytes=1.0,
            model_flops=1.0,
            model_bytes=1.0,
            seconds=1.0,
            compile_s=1.0,
        )

    v5e = chips.parse_topology("v5e:2x2")
    fits = compile_for.Report(v5e, {}, [program("sampler", 13 * GiB)], [], 1.0, {})
    big = compile_for.Report(
        v5e, {}, [program("sampler", GiB), program("update", 15 * GiB)], [], 1.0, {}
    )
    assert fits.too_big() is None  # 2 + 13 = 15 GiB of 16
    assert big.too_big().name == "update"  # 2 + 15 = 17 GiB
    monkeypatch.setattr(compile_for, "compile_config", lambda raw, topology, workers: big)
    assert compile_for.run(None, "v5e:2x2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["does not fit: update needs 17.00 GiB per chip, a v5e chip has 16 GiB"]


def test_the_step_counts_every_phase_compiled_or_not():
    """A report of the update alone (`only`) still predicts the whole step: its time is
    every phase's roofline, so its MFU is the step's, not the step's FLOPs over the one
    program's time."""
    v5e = chips.parse_topology("v5e:2x2")
    phases = {"sample": 3.0, "reference": 0.5, "update": 1.5}
    report = compile_for.Report(v5e, {}, [], [], 4 * 197e12, phases)
    assert report.step_s == 5.0
    assert report.mfu == pytest.approx(0.2)  # 4 chips x 197 TFLOP/s for 5 s, a fifth used


def test_workers_sampling_beside_the_update_take_the_longer_side():
    """Two rollout workers on one v6e chip each, max_staleness 1: two steps sampled at
    once beside the trainer's reference + update; MFU over every chip's peak."""
    v5e, v6e = chips.parse_topology("v5e:2x2"), chips.parse_topology("v6e:1x1")
    phases = {"sample": 3.0, "reference": 0.5, "update": 1.5}
    report = compile_for.Report(v5e, {}, [], [], 1e15, phases, v6e, 2, in_flight=2)
    assert report.step_s == 2.0  # max(3.0 / 2, 0.5 + 1.5)
    assert report.peak_flops == 4 * 197e12 + 2 * 918e12
    assert report.mfu == pytest.approx(1e15 / 2.0 / (4 * 197e12 + 2 * 918e12))
    taking_turns = compile_for.Report(v5e, {}, [], [], 1e15, phases, v6e, 2, in_flight=0)
    assert taking_turns.step_s == 5.0  # max_staleness 0: sample, then reference, update
    # A program is held against its own chip's HBM: 20 GiB fits a v6e, not a v5e.
    GiB = chips.GiB
    sampler = compile_for.Program("sampler", 0, 0, 0, 20 * GiB, 1, 1, 1, 1, 1, 1, (), v6e.chip)
    assert compile_for.Report(v5e, {}, [sampler], [], 1.0, {}).too_big() is None
    on_v5e = dataclasses.replace(sampler, chip=None)
    assert compile_for.Report(v5e, {}, [on_v5e], [], 1.0, {}).too_big() is on_v5e


def test_workers_topology_without_workers_is_one_line():
    from jaxrl_llm.config import base_config
    from jaxrl_llm.config.derived import ConfigError

    with pytest.raises(ConfigError, match=r"--compile_workers_for=v6e:2x4: .*rollout.workers=0"):
        compile_for.compile_config(base_config(), "v5e:2x2", workers="v6e:2x4")


def test_a_program_the_compiler_refuses_exits_2(monkeypatch, capsys):
    def refuse(raw, topology, workers):
        raise compile_for.DoesNotFit("update", "RESOURCE_EXHAUSTED: Ran out of memory on HBM")

    monkeypatch.setattr(compile_for, "compile_config", refuse)
    assert compile_for.run(None, "v5p:2x2x4") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["does not fit: update: RESOURCE_EXHAUSTED: Ran out of memory on HBM"]


def test_parse_topology():
    t = chips.parse_topology("v5p:4x4x4*2")
    assert (t.chip.name, t.shape, t.slices, t.num_chips) == ("v5p", (4, 4, 4), 2, 128)
    assert chips.parse_topology("v6e:2x4").num_chips == 8
    for bad, match in [
        ("v6e:2x4x2", "2-D"),
        ("v5p:2x2", "3-D"),
        ("h100:8", "CHIP:SHAPE"),
        ("v9z:2x2", "not one of"),
    ]:
        with pytest.raises(chips.TopologyError, match=match):
            chips.parse_topology(bad)


def test_roofline_against_hand_arithmetic():
    """A model of 1e9 parameters whose attention is negligible: the roofline of each
    phase, worked out by hand."""

    class Cfg:
        num_layers, num_kv_heads, head_dim = 10, 2, 64

        def num_params(self):
            return 10**9

    flops = {"sample": 8e15, "reference": 4e15, "update": 12e15}
    costs = roofline.phase_costs(
        Cfg(),
        flops,
        rows=64,
        prompt_len=100,
        new_tokens=101,
        chips=8,
        weight_shards=1,
        row_shards=8,
        itemsize=2,
        micro_batches=4,
        update_forwards=3,
        reference=True,
    )
    kv = 2 * 10 * 2 * 64 * 2 * (100 + 50.5) * 8  # K and V bytes per token x context x rows
    assert costs["sample"].flops == 1e15
    assert costs["sample"].hbm_bytes == pytest.approx(101 * 2e9 + 100 * kv)
    assert costs["reference"].hbm_bytes == 4 * 2e9
    assert costs["update"].hbm_bytes == pytest.approx(3 * 4 * 2e9 + 32e9 / 8)
    v5e = chips.CHIPS["v5e"]
    assert roofline.roofline_s(1e15, 1.0, v5e) == pytest.approx(1e15 / 197e12)
    assert roofline.roofline_s(1.0, 819e9, v5e) == pytest.approx(1.0)
    seconds = roofline.predicted_seconds(costs, v5e)
    assert seconds["sample"] == pytest.approx(max(1e15 / 197e12, (101 * 2e9 + 100 * kv) / 819e9))
    assert seconds["update"] == pytest.approx(12e15 / 8 / 197e12)  # compute-bound


def test_chip_of_device_kinds():
    assert chips.chip_of("TPU v6 lite").name == "v6e"
    assert chips.chip_of("TPU v5").name == "v5p"
    assert chips.chip_of("NVIDIA H200").name == "h200"
    assert chips.chip_of("NVIDIA H100 80GB HBM3").name == "h100"
    assert chips.chip_of("cpu") is None


def test_libtpu_on_a_cpu_machine_keeps_jax_on_the_cpu(monkeypatch):
    env = {}
    monkeypatch.setattr(chips, "_has_accelerator", lambda: False)
    monkeypatch.setattr(chips, "_installed", lambda module: module == "libtpu")
    chips.set_platforms(env)
    assert env == {"JAX_PLATFORMS": "cpu"}
    monkeypatch.setattr(chips, "_installed", lambda module: False)
    env = {}
    chips.set_platforms(env)
    assert env == {}  # no libtpu: jax's own choice
    monkeypatch.setattr(chips, "_installed", lambda module: module == "libtpu")
    env = {"JAX_PLATFORMS": "tpu"}
    chips.set_platforms(env)
    assert env == {"JAX_PLATFORMS": "tpu"}  # the user's choice stands
    monkeypatch.setattr(chips, "_has_accelerator", lambda: True)
    env = {}
    chips.set_platforms(env)
    assert env == {}
    chips.set_platforms(env, compile_only=True)
    assert env["JAX_PLATFORMS"] == "cpu" and env["TPU_SKIP_MDS_QUERY"] == "1"
    assert os.environ.get("JAX_PLATFORMS") == "cpu"  # conftest's, unchanged
