"""Export: a run directory's checkpoint -> HF directory with the same logits in transformers."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import transformers
from flax import struct
from hf_reference import VOCAB, hf_config, hf_logits, padded_batch
from safetensors.numpy import load_file
from tokenizers import Tokenizer
from tokenizers import models as tok_models

from jaxrl_llm import models
from jaxrl_llm.export import export
from jaxrl_llm.models.params import unflatten
from jaxrl_llm.trainer.checkpoint import Checkpointer


@struct.dataclass
class TrainState:
    params: dict
    opt_state: optax.OptState
    step: jax.Array


def _params(cfg, seed):
    """Random params of every shape the model expects (norms around 1), built on the host:
    no compile, and nothing shared with the code under test but the shapes."""
    rng = np.random.RandomState(seed)
    flat = {
        path: (1.0 if "norm" in path[-1] else 0.0) + 0.1 * rng.standard_normal(spec.shape)
        for path, spec in models.param_specs(cfg).items()
    }
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), unflatten(flat))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as the trainer leaves it: checkpoints at steps 2 and 4 (params plus
    an adam state), config.json, hf_config.json; the base model dir holds the tokenizer."""
    root = tmp_path_factory.mktemp("export")
    cfg = models.ModelConfig.from_hf_dict(hf_config("qwen3").to_dict())
    base = root / "base"
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(tok_models.WordLevel({f"t{i}": i for i in range(VOCAB)}, "t0"))
    )
    tok.save_pretrained(base)
    (base / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    (base / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    workdir = root / "run"
    tx = optax.adam(1e-3)
    by_step = {}
    with Checkpointer(workdir / "checkpoints", save_interval_steps=2) as ckpt:
        for step in (2, 4):
            params = _params(cfg, seed=step)
            state = TrainState(params, tx.init(params), jnp.asarray(step))
            assert ckpt.save(step, state, {"step": step, "data": {"index": 8 * step}})
            by_step[step] = jax.tree.map(np.asarray, params)
    (workdir / "config.json").write_text(
        json.dumps({"model": {"path": str(base), "tokenizer": ""}, "algo": {"name": "grpo"}})
    )
    (workdir / "hf_config.json").write_text(json.dumps(cfg.to_hf_dict()))
    return cfg, workdir, by_step


def test_export_matches_the_checkpoint_in_transformers(run_dir, tmp_path):
    cfg, workdir, by_step = run_dir
    assert export(workdir, tmp_path / "hf") == 4  # the latest
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids, mask = padded_batch(seed=3)
    ours = models.logits(cfg, jax.tree.map(jnp.asarray, by_step[4]), ids, mask)
    diff = np.abs(np.asarray(ours) - hf_logits(model, ids, mask))[mask]
    assert diff.max() <= 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.convert_tokens_to_ids(["t5", "t17"]) == [5, 17]
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {
        "do_sample": False
    }


def _sibling_run(workdir, path, hf_config=None):
    """Another run directory over the same checkpoints, with or without hf_config.json."""
    path.mkdir()
    os.symlink(workdir / "checkpoints", path / "checkpoints")
    (path / "config.json").write_text((workdir / "config.json").read_text())
    if hf_config is not None:
        (path / "hf_config.json").write_text(json.dumps(hf_config))
    return path


def test_cli_exports_an_older_step_in_bfloat16(run_dir, tmp_path):
    _, workdir, by_step = run_dir
    run = _sibling_run(workdir, tmp_path / "run")  # model config from model.path
    out = tmp_path / "hf"
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "jaxrl_llm.export", f"--workdir={run}", f"--out={out}"]
    proc = subprocess.run(
        [*cmd, "--step=2", "--dtype=bfloat16"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"exported step 2 of {run} to {out}" in proc.stdout
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    weights = load_file(out / "model.safetensors")
    expected = by_step[2]["embed"].astype(jnp.bfloat16)
    assert weights["model.embed_tokens.weight"].tobytes() == expected.tobytes()


def test_errors_name_the_problem(run_dir, tmp_path):
    cfg, workdir, _ = run_dir
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 3; saved steps: \[2, 4\]"):
        export(workdir, tmp_path / "hf", step=3)
    with pytest.raises(FileNotFoundError, match="config.json: not found"):
        export(tmp_path, tmp_path / "hf")
    other = _sibling_run(workdir, tmp_path / "run", {**cfg.to_hf_dict(), "hidden_size": 32})
    with pytest.raises(ValueError, match=r"params\.embed has shape \[96, 64\], the model config"):
        export(other, tmp_path / "hf")


def test_export_refuses_an_out_that_would_overwrite(run_dir, tmp_path):
    """Issue 40 row 6: the run's own directory (its config.json would become the HF one),
    a non-empty directory and a file are refused before anything is written."""
    from jaxrl_llm.errors import UserError

    _, workdir, _ = run_dir
    before = (workdir / "config.json").read_text()
    with pytest.raises(UserError, match="--out is a run directory; exporting there would"):
        export(workdir, workdir)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"--out is not empty \(1 entries: notes.txt\)"):
        export(workdir, tmp_path / "full")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="--out is a file"):
        export(workdir, tmp_path / "file")
    assert (workdir / "config.json").read_text() == before
    (tmp_path / "empty").mkdir()
    assert export(workdir, tmp_path / "empty") == 4


def test_export_command_prints_only_its_own_lines(run_dir, tmp_path):
    """Issue 40 row 15: one line on success, one `error:` line on failure; no orbax log."""
    _, workdir, _ = run_dir
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", "PYTHONPATH": repo}
    args = [sys.executable, "-m", "jaxrl_llm.export", f"--workdir={workdir}"]
    ok = subprocess.run(
        [*args, f"--out={tmp_path / 'hf'}"], env=env, capture_output=True, text=True, timeout=300
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.strip() == f"exported step 4 of {workdir} to {tmp_path / 'hf'}"
    assert ok.stderr.strip() == ""
    bad = subprocess.run(
        [*args, "--out=x", "--step=3"], env=env, capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr[-2000:]


def test_peft_export_of_a_gguf_based_run_loads_in_peft(tmp_path):
    """Issue 40 row 15: a LoRA run whose model.path is a GGUF file. The adapters' config
    must name a base that peft can load: the dequantized base, written beside them.
    Reference: transformers' GGUF loader for the base, peft for the adapters."""
    import peft
    from gguf import GGMLQuantizationType as Q
    from gguf_reference import write_model
    from hf_reference import hf_model
    from tiny_run import TOKENIZER

    tiny = dict(vocab_size=33, hidden_size=32, intermediate_size=64, head_dim=8)
    gguf_path = tmp_path / "t.gguf"
    write_model(hf_model("qwen3", tie_word_embeddings=True, **tiny), gguf_path, "qwen3", Q.F32)
    cfg, base = models.load_gguf(gguf_path)
    lcfg = cfg.replace(lora=models.LoraConfig(rank=4, alpha=8.0))
    rng = np.random.RandomState(0)
    adapters = {
        path: 0.1 * rng.standard_normal(spec.shape).astype(np.float32)
        for path, spec in models.param_specs(lcfg).items()
        if models.lora.is_adapter(path[-1])
    }
    adapters = jax.tree.map(jnp.asarray, unflatten(adapters))
    workdir = tmp_path / "run"
    with Checkpointer(workdir / "checkpoints", save_interval_steps=1) as ckpt:
        ckpt.save(1, {"params": adapters}, {"step": 1})
    lora = {"rank": 4, "alpha": 8.0, "targets": list(lcfg.lora.targets), "dropout": 0.0}
    model = {"path": str(gguf_path), "tokenizer": TOKENIZER, "lora": lora}
    (workdir / "config.json").write_text(json.dumps({"model": model}))
    (workdir / "hf_config.json").write_text(json.dumps(cfg.to_hf_dict()))

    assert export(workdir, tmp_path / "adapter", lora="peft") == 1
    named = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert named["base_model_name_or_path"] == str(tmp_path / "adapter" / "base")
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()

    ids = np.array([[5, 6, 14, 7, 18, 3]])
    mask = np.ones_like(ids, dtype=bool)
    ours = np.asarray(models.logits(lcfg, models.lora.combine(base, adapters), ids))
    np.testing.assert_allclose(hf_logits(loaded, ids, mask), ours, atol=1e-4, rtol=0)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "adapter" / "base")
    assert len(tok) == 33


def test_an_empty_out_is_one_line():
    """`export --out=` names the flag, not an empty path."""
    from jaxrl_llm.errors import UserError, format_error
    from jaxrl_llm.export import check_out

    with pytest.raises(UserError) as err:
        check_out("")
    assert format_error(err.value) == ("error: --out: empty; give --out a new or empty directory")
