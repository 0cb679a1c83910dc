"""A tiny model's whole step compiled for TPU v5e chips by XLA:TPU, on this CPU machine.

libtpu (the test extra) describes a v5e 2x2 topology without hardware; the step's
programs (`jaxrl_llm.tpu.compile_for`: sampler, reference, update) are built by the
trainer's own builders on a mesh of those chips and compiled, the Pallas kernels through
Mosaic. A TPU-only regression (a kernel that does not lower, a Mosaic call left to XLA's
partitioner) fails here. Skipped where libtpu is not installed.
"""

import io
import json
import os

import pytest
from tiny_run import tiny_config, tiny_model_config

from jaxrl_llm.tpu import chips, compile_for, roofline

libtpu = pytest.importorskip("libtpu", reason="libtpu is not installed (pip install -e '.[test]')")


def model_dir(tmp_path, **fields) -> str:
    """A directory holding only the config.json of a tiny model whose attention the
    splash kernel takes (head_dim 128): a compile-only run reads nothing else."""
    cfg = tiny_model_config(head_dim=128, vocab_size=256, max_position_embeddings=512, **fields)
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    return str(path)


def small(c):
    """A step small enough to compile in seconds: 4 prompts x 2 rows on 4 chips."""
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.model.dtype = "bfloat16"
    c.data.max_prompt_len = 16
    c.rollout.batch_size, c.rollout.num_generations, c.rollout.max_new_tokens = 4, 2, 16
    c.optim.micro_batches = 1
    c.algo.beta = 0.04  # a reference program too
    c.eval.every = 0
    return c


def test_tiny_step_compiles_for_v5e_with_splash_attention(tmp_path):
    c = small(tiny_config(model_dir(tmp_path)))
    c.model.attention = "auto"  # on TPU: the splash kernel
    out = io.StringIO()
    report = compile_for.compile_config(c, "v5e:2x2", out=out)
    names = [p.name for p in report.programs]
    assert names == ["sampler", "reference", "update"], out.getvalue()
    for p in report.programs:
        assert 0 < p.peak < chips.CHIPS["v5e"].hbm_bytes, p
        assert p.compiler_flops > 0 and p.seconds > 0, p
    update = report.programs[-1]
    # The training forward and backward through splash: its forward and gradient kernels.
    assert any(k.startswith("splash_mqa_fwd") for k in update.kernels), update.kernels
    assert any("dkv" in k for k in update.kernels), update.kernels
    assert report.too_big() is None and 0 < report.mfu < 1
    assert "step:" in out.getvalue() and "MFU" in out.getvalue()


def test_tiny_moe_update_compiles_with_gmm_over_the_expert_axis(tmp_path):
    moe = dict(architecture="Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=128, hidden_size=256)  # fmt: skip
    c = small(tiny_config(model_dir(tmp_path, **moe)))
    c.mesh.fsdp, c.mesh.expert = 2, 2
    c.model.moe_impl = "auto"  # on TPU: megablox gmm, per device in shard_map
    c.algo.beta = 0.0
    report = compile_for.compile_config(c, "v5e:2x2", out=io.StringIO())
    update = report.programs[-1]
    assert update.name == "update"
    assert "gmm" in update.kernels and "tgmm" in update.kernels, update.kernels


def test_a_program_too_big_for_the_chip_exits_2(monkeypatch, capsys):
    GiB = chips.GiB

    def program(name, temporaries):
        return compile_for.Program(
            name=name, arguments=2 * GiB, outputs=2 * GiB, aliased=2 * GiB,
            temporaries=temporaries, compiler_flops=1.0, compiler_bytes=1.0, model_flops=1.0,
            model_bytes=1.0, seconds=1.0, compile_s=1.0,
        )  # fmt: skip

    v5e = chips.parse_topology("v5e:2x2")
    fits = compile_for.Report(v5e, {}, [program("sampler", 13 * GiB)], [], 1.0)
    big = compile_for.Report(v5e, {}, [program("sampler", GiB), program("update", 15 * GiB)],
                             [], 1.0)  # fmt: skip
    assert fits.too_big() is None  # 2 + 13 = 15 GiB of 16
    assert big.too_big().name == "update"  # 2 + 15 = 17 GiB
    monkeypatch.setattr(compile_for, "compile_config", lambda raw, topology: big)
    assert compile_for.run(None, "v5e:2x2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["does not fit: update needs 17.00 GiB per chip, a v5e chip has 16 GiB"]


def test_parse_topology():
    t = chips.parse_topology("v5p:4x4x4*2")
    assert (t.chip.name, t.shape, t.slices, t.num_chips) == ("v5p", (4, 4, 4), 2, 128)
    assert chips.parse_topology("v6e:2x4").num_chips == 8
    for bad, match in [("v6e:2x4x2", "2-D"), ("v5p:2x2", "3-D"), ("h100:8", "CHIP:SHAPE"),
                       ("v9z:2x2", "not one of")]:  # fmt: skip
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
        Cfg(), flops, rows=64, prompt_len=100, new_tokens=101, chips=8, weight_shards=1,
        row_shards=8, itemsize=2, micro_batches=4, update_forwards=3, reference=True,
    )  # fmt: skip
    kv = 2 * 10 * 2 * 64 * 2 * (100 + 50.5) * 8  # K and V bytes per token x context x rows
    assert costs["sample"].flops == 1e15
    assert costs["sample"].hbm_bytes == pytest.approx(101 * 2e9 + 100 * kv)
    assert costs["reference"].hbm_bytes == 4 * 2e9
    assert costs["update"].hbm_bytes == pytest.approx(3 * 4 * 2e9 + 32e9 / 8)
    v5e = chips.CHIPS["v5e"]
    assert chips.roofline_s(1e15, 1.0, v5e) == pytest.approx(1e15 / 197e12)
    assert chips.roofline_s(1.0, 819e9, v5e) == pytest.approx(1.0)


def test_libtpu_on_a_cpu_machine_keeps_jax_on_the_cpu(monkeypatch):
    env = {}
    monkeypatch.setattr(chips, "_has_accelerator", lambda: False)
    chips.set_platforms(env)
    assert env == {"JAX_PLATFORMS": "cpu"}  # libtpu is installed (this test needs it)
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
