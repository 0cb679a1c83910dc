"""A tiny model's whole step compiled for TPU v5e chips by XLA:TPU, on this CPU machine.

libtpu (the test extra) describes a v5e 2x2 topology without hardware; the step's
programs (`jaxrl_llm.tpu.compile_for`: sampler, reference, update) are built by the
trainer's own builders on a mesh of those chips and compiled, the Pallas kernels through
Mosaic. A TPU-only regression (a kernel that does not lower, a Mosaic call left to XLA's
partitioner) fails here. Skipped where libtpu is not installed.
"""

import io
import json

import pytest
from tiny_run import tiny_config, tiny_model_config

from jaxrl_llm.tpu import chips, compile_for

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


def test_tiny_step_compiles_for_v5e_with_the_kernels(tmp_path):
    """Sampler, the paged engine's chunks, reference and update on 4 chips: splash
    attention in the reference and the update, the paged-attention kernel in decode."""
    c = small(tiny_config(model_dir(tmp_path)))
    c.model.attention = "auto"  # on TPU: the splash kernel
    c.rollout.engine = "paged"  # paged.attention 'auto': the Pallas kernel (bf16, head 128)
    out = io.StringIO()
    report = compile_for.compile_config(c, "v5e:2x2", out=out)
    names = [p.name for p in report.programs]
    assert names == ["sampler", "paged decode", "paged prefill", "reference", "update"], names
    (decode_kernels,) = report.programs[1].kernels  # the paged-attention kernel's calls
    assert decode_kernels.endswith(" pallas_call"), report.programs[1]
    assert any(k.startswith("splash_mqa_fwd") for k in report.programs[3].kernels)
    for p in report.programs:
        assert 0 < p.peak < chips.CHIPS["v5e"].hbm_bytes, p
        if p.name != "sampler":  # the paged engine's output shapes: its work is the chunks'
            assert p.compiler_flops > 0 and (p.seconds > 0 or p.name == "paged prefill"), p
    update = report.programs[-1]
    # The training forward and backward through splash: its forward and gradient kernels.
    assert any(k.startswith("splash_mqa_fwd") for k in update.kernels), update.kernels
    assert any("dkv" in k for k in update.kernels), update.kernels
    assert report.too_big() is None and 0 < report.mfu < 1
    assert "step:" in out.getvalue() and "MFU" in out.getvalue()


def test_static_sampler_compiles_for_v5e(tmp_path):
    """rollout.engine='static': its one sampling program (prefill and the decode loop)."""
    c = small(tiny_config(model_dir(tmp_path)))
    c.rollout.engine = "static"
    report = compile_for.compile_config(c, "v5e:2x2", out=io.StringIO(), only={"sampler"})
    (sampler,) = report.programs
    assert sampler.name == "sampler" and sampler.compiler_flops > 0, sampler
    assert 0 < sampler.peak < chips.CHIPS["v5e"].hbm_bytes, sampler


def test_disaggregated_step_compiles_the_engine_for_the_workers_chips(tmp_path):
    """rollout.workers=2: the engine's programs for one worker's v6e chip (its own world,
    `workers.serve.worker_config`'s mesh), reference and update for the trainer's 4 v5e
    chips; the step is the longer side (the workers sample 2 steps at once)."""
    c = small(tiny_config(model_dir(tmp_path)))
    c.rollout.mode, c.rollout.max_staleness = "split", 1
    c.rollout.workers, c.rollout.worker_addresses = 2, "w0:7070,w1:7070"
    out = io.StringIO()
    report = compile_for.compile_config(c, "v5e:2x2", out=out, workers="v6e:1x1")
    by_name = {p.name: p for p in report.programs}
    assert list(by_name) == ["sampler", "reference", "update"], list(by_name)
    assert by_name["sampler"].chip is chips.CHIPS["v6e"]
    assert by_name["update"].chip is None and by_name["reference"].chip is None
    assert report.chip_of(by_name["update"]) is chips.CHIPS["v5e"]
    assert (report.workers.num_chips, report.worker_count, report.in_flight) == (1, 2, 2)
    phases = report.phase_s
    trainer = phases["reference"] + phases["update"]
    assert report.step_s == max(phases["sample"] / 2, trainer)
    assert report.peak_flops == 4 * 197e12 + 2 * 918e12
    text = out.getvalue()
    assert "rollout workers: 2, each v6e:1x1" in text and "per rollout worker chip (v6e:" in text
    assert "weight sync to the workers" in text


def test_tiny_moe_update_compiles_with_gmm_over_the_expert_axis(tmp_path):
    moe = dict(
        architecture="Qwen3MoeForCausalLM",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        hidden_size=256,
    )
    c = small(tiny_config(model_dir(tmp_path, **moe)))
    c.mesh.fsdp, c.mesh.expert = 2, 2
    c.model.moe_impl = "auto"  # on TPU: megablox gmm, per device in shard_map
    c.algo.beta = 0.0
    report = compile_for.compile_config(c, "v5e:2x2", out=io.StringIO(), only={"update"})
    (update,) = report.programs  # the sampler lowered only: its output's shapes
    assert "gmm" in update.kernels and "tgmm" in update.kernels, update.kernels


@pytest.mark.parametrize(
    "topology, sizes", [("v5e:2x2*2", {"fsdp": -1}), ("v5p:2x2x2*2", {"data": 2, "fsdp": -1})]
)
def test_multi_slice_mesh_splits_the_batch_between_slices(topology, sizes):
    """Two slices: each half of the outermost batch axis they divide lies in one slice
    (only the gradient reduction crosses the data-center network)."""
    from jaxrl_llm import parallel

    devices = chips.topology_devices(chips.parse_topology(topology))
    mesh = parallel.make_mesh(sizes, devices)
    grid = mesh.devices.reshape(mesh.devices.shape[0], mesh.devices.shape[1], -1)
    if grid.shape[0] > 1:  # split over data
        first, second = grid[:1], grid[1:]
    else:  # over fsdp
        half = grid.shape[1] // 2
        first, second = grid[:, :half], grid[:, half:]
    assert {d.slice_index for d in first.flat} == {0}
    assert {d.slice_index for d in second.flat} == {1}
