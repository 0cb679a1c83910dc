"""LoRA in the trainer and out of it: config errors, one load of the base, checkpoints of
the adapters alone, resume, bfloat16 + PPO, and exports that transformers + peft load.

References: HF transformers (PyTorch) with `peft.PeftModel` on the same base weights,
and the plain HF model on the merged export.
"""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import peft
import pytest
import transformers
from hf_reference import hf_logits, hf_model, padded_batch
from tiny_run import make_model_dir, signal_config

from jaxrl_llm import config as config_lib
from jaxrl_llm import export, models, train
from jaxrl_llm.models import lora
from jaxrl_llm.trainer import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("tiny_model")))


def lora_config(model_dir, **algo):
    """`signal_config` (mixed rewards, so the adapters get gradients) with rank-4 LoRA."""
    c = signal_config(model_dir)
    for k, v in algo.items():
        c.algo[k] = v
    c.model.lora.rank = 4
    c.model.lora.alpha = 8.0
    c.optim.learning_rate = 3e-2  # the adapters must move for the export to mean something
    return c


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("targets", ("q", "qq"), "model.lora.targets"),
        ("rank", -1, "model.lora.rank=-1"),
        ("dropout", 1.0, "model.lora.dropout=1.0: must be a rate in [0, 1)"),
        ("sampler", "fused", "model.lora.sampler='fused'"),
    ],
)
def test_bad_lora_settings_name_the_key(model_dir, key, value, message):
    c = lora_config(model_dir)
    c.model.lora[key] = value
    with pytest.raises(config_lib.ConfigError, match=re.escape(message)):
        config_lib.validate(c, num_devices=8)


def test_unknown_lora_key_is_refused(model_dir):
    c = lora_config(model_dir)
    c.model.lora.rnak = 4
    with pytest.raises(config_lib.ConfigError, match="model.lora.rnak: unknown key; did you mean"):
        config_lib.validate(c, num_devices=8)


@pytest.mark.parametrize("targets", [lora.PEFT_MODULES, ("q", "v", "down")], ids=["all", "qvd"])
def test_peft_loads_our_adapters_and_reproduces_our_logits(tmp_path, targets):
    """Random HF Qwen2 (biases too) + adapters with B != 0: PEFT on the PyTorch model and
    the merged export in plain transformers give our logits."""
    hf = hf_model("qwen2", seed=0)
    hf.save_pretrained(tmp_path / "base")
    cfg, base = models.load_hf(tmp_path / "base")
    lcfg = cfg.replace(lora=models.LoraConfig(rank=4, alpha=8.0, targets=tuple(targets)))
    rng = np.random.default_rng(1)
    shapes = jax.eval_shape(lambda: lora.init_adapters(lcfg))
    adapters = jax.tree.map(lambda s: 0.3 * rng.standard_normal(s.shape, np.float32), shapes)
    params = lora.combine(base, adapters)
    ids, mask = padded_batch(seed=2)
    ours = np.asarray(models.logits(lcfg, params, ids, mask))
    ours = ours[mask]  # real tokens (padding queries differ by design)
    assert np.abs(ours - hf_logits(hf, ids, mask)[mask]).max() > 0.1  # the adapters matter

    lora.save_peft(lcfg, adapters, str(tmp_path / "adapter"), str(tmp_path / "base"))
    with_adapters = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    np.testing.assert_allclose(hf_logits(with_adapters, ids, mask)[mask], ours, atol=1e-4, rtol=0)

    models.save_hf(cfg, lora.merge(lcfg, params), tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(hf_logits(merged, ids, mask)[mask], ours, atol=1e-4, rtol=0)


def test_lora_run_loads_once_checkpoints_adapters_resumes_and_exports(
    model_dir, tmp_path, monkeypatch
):
    """GRPO with beta > 0 and adapter dropout: one load of the base (the reference is the
    base with the adapters off); checkpoints hold the adapters and their moments only;
    the run resumes; `export --lora=peft` (command line) and `--lora=merged` reproduce
    the trained policy."""
    loads = []
    load_model = models.builtin.load_model
    monkeypatch.setattr(
        models.builtin, "load_model", lambda *a, **k: loads.append(a[0]) or load_model(*a, **k)
    )
    c = lora_config(model_dir)
    c.model.lora.dropout = 0.1
    c.checkpoint.every = 1
    workdir = tmp_path / "run"
    last = train.train(c, str(workdir))
    assert len(loads) == 1 and last["optim/nonfinite"] == 0.0
    with checkpoint.Checkpointer(str(workdir / "checkpoints"), read_only=True) as ck:
        saved = ck.abstract_state()
    names = set(saved["params"]["layers"])
    assert names == {t + s for t in lora.PEFT_MODULES for s in lora.SUFFIXES}
    assert set(saved["params"]) == {"layers"}
    adapter_shapes = {x.shape for x in jax.tree.leaves(saved["params"])}
    assert {x.shape for x in jax.tree.leaves(saved["opt_state"]) if x.shape} == adapter_shapes
    c.train.num_steps = 3
    assert train.train(c, str(workdir))["optim/nonfinite"] == 0.0  # resumes at step 2

    peft_dir, merged_dir = tmp_path / "peft", tmp_path / "merged"
    command = [sys.executable, "-m", "jaxrl_llm.export", f"--workdir={workdir}", "--lora=peft"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    subprocess.run([*command, f"--out={peft_dir}"], check=True, env=env, cwd=ROOT)
    with open(peft_dir / "adapter_config.json") as f:
        assert json.load(f)["lora_dropout"] == 0.1
    assert export.export(str(workdir), str(merged_dir), lora="merged") == 3

    cfg, base = models.load_hf(model_dir)
    state, _ = checkpoint.Checkpointer(str(workdir / "checkpoints"), read_only=True).restore(3)
    lcfg = cfg.replace(lora=models.LoraConfig(rank=4, alpha=8.0))
    ids = np.array([[5, 6, 14, 7, 18, 3]])
    mask = np.ones_like(ids)
    ours = np.asarray(models.logits(lcfg, lora.combine(base, state["params"]), ids))
    assert np.abs(np.asarray(state["params"]["layers"]["q_lora_b"])).max() > 1e-3
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with_adapters = peft.PeftModel.from_pretrained(hf_base, peft_dir).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    for model in (with_adapters, merged):
        np.testing.assert_allclose(hf_logits(model, ids, mask), ours, atol=1e-4, rtol=0)
    _, exported = models.load_hf(merged_dir)  # the merge moved the weights
    assert (
        np.abs(np.asarray(exported["layers"]["q"]) - np.asarray(base["layers"]["q"])).max() > 1e-4
    )


@pytest.mark.slow
def test_lora_ppo_in_bfloat16_trains(model_dir, tmp_path):
    """PPO (a full critic copied from the base, LoRA with dropout on the policy) in
    bfloat16, the sampler applying the adapters unmerged (the GRPO run above merges)."""
    c = lora_config(model_dir, name="ppo")
    c.model.lora.dropout = 0.05
    c.model.dtype = "bfloat16"
    c.model.lora.sampler = "unmerged"
    c.rollout.num_generations = 1
    c.rollout.batch_size = 8
    last = train.train(c, str(tmp_path))
    assert np.isfinite(last["loss/total"]) and last["optim/nonfinite"] == 0.0
    assert "loss/value" in last


@pytest.mark.parametrize("sampler", ["merged", "unmerged"])
def test_lora_with_split_rollouts(model_dir, tmp_path, sampler):
    """LoRA with rollout.mode='split': the sampler's parameters (merged, or base + adapters
    unmerged) move to the rollout mesh after each update, and the run trains."""
    c = lora_config(model_dir)
    c.model.lora.sampler = sampler
    c.rollout.mode, c.rollout.max_staleness = "split", 1
    c.mesh.fsdp, c.mesh.tensor, c.mesh.rollout_devices = -1, 2, 4
    c.train.num_steps = 3
    last = train.train(c, str(tmp_path))
    assert np.isfinite(last["loss/total"]) and last["optim/nonfinite"] == 0.0
    assert last["rollout/staleness_max"] <= 1.0
