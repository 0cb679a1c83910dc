"""A run's trained policy -> a Hugging Face model directory that `transformers` loads.

    python -m jaxrl_llm.export --workdir=DIR --out=HF_DIR [--step=N] [--dtype=bfloat16]
    python -m jaxrl_llm.export --workdir=DIR --out=ADAPTER_DIR --lora=peft   # a LoRA run

A LoRA run (`model.lora.rank` > 0) checkpoints only its adapters. `--lora=merged` (the
default for such a run) reads the base model from `model.path` and writes base + adapters
merged (W + (alpha/r) A B) as a full HF model; `--lora=peft` writes the adapters alone,
`adapter_config.json` + `adapter_model.safetensors`, which `peft.PeftModel.from_pretrained`
loads onto the base model. A run whose `model.path` is a `.gguf` file gets its base written
too, dequantized, as the HF directory `ADAPTER_DIR/base`, which `adapter_config.json` names
(by absolute path: `AutoPeftModelForCausalLM.from_pretrained(ADAPTER_DIR)` loads both).

What it reads from the run directory DIR (the trainer writes all of it):
  DIR/checkpoints/<step>/   orbax checkpoints; only `state.params` is read, so neither the
                            optimizer nor the algorithm needs to be known here
  DIR/hf_config.json        the policy's HF config (else `model.path`/config.json)
  DIR/config.json           the run config: `model.tokenizer` or `model.path` gives the
                            tokenizer files (and generation_config.json) to copy along;
                            a `.gguf` model's tokenizer is built from its metadata

The params are read straight into a mesh over all local devices (FSDP-sharded), then
written tensor by tensor, so no step needs the whole model in one device's memory. The
checkpoint need not come from the same topology: one host can export a pod's run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import jax

from jaxrl_llm import models, parallel
from jaxrl_llm.errors import UserError
from jaxrl_llm.models import builtin
from jaxrl_llm.models.params import unflatten
from jaxrl_llm.trainer.checkpoint import Checkpointer

CHECKPOINT_DIR = "checkpoints"
RUN_CONFIG = "config.json"
HF_CONFIG = "hf_config.json"
BASE_DIR = "base"  # --lora=peft of a GGUF-based run: the dequantized base, inside --out


LORA_MODES = ("merged", "peft")


def export(
    workdir,
    out,
    step: int | None = None,
    dtype: str | None = None,
    mesh=None,
    lora: str | None = None,
) -> int:
    """Writes the policy of checkpoint `step` (default: latest) to `out`; returns the step.

    `dtype` ("bfloat16", "float32", ...) defaults to the checkpoint's dtype. `mesh`
    defaults to all devices on the fsdp axis. `lora`: for a LoRA run, "merged" (default)
    or "peft" (see the module doc).
    """
    workdir = os.fspath(workdir)
    run_config = _read_json(os.path.join(workdir, RUN_CONFIG))
    check_out(os.fspath(out))
    model = run_config.get("model") or {}
    cfg = model_config(workdir, run_config)
    lora_cfg = _lora_config(model, lora, workdir)
    mesh = mesh or parallel.make_mesh()
    with Checkpointer(os.path.join(workdir, CHECKPOINT_DIR), read_only=True) as ckpt:
        step = ckpt.latest_step() if step is None else int(step)
        if step is None:
            raise FileNotFoundError(f"{ckpt.directory}: no checkpoint to export")
        params = restore_params(ckpt, cfg.replace(lora=lora_cfg), step, mesh)
    if lora_cfg is not None and lora == "peft":
        base_model = model["path"]
        if base_model.endswith(".gguf"):  # peft loads its base with transformers
            base_model = _write_base(cfg, model, params, mesh, dtype, os.fspath(out))
        models.lora.save_peft(cfg.replace(lora=lora_cfg), params, out, base_model, dtype)
        logging.info("exported the adapters of step %d of %s to %s", step, workdir, out)
        return step
    if lora_cfg is not None:
        adapted = cfg.replace(lora=lora_cfg)
        dtype_of = jax.tree.leaves(params)[0].dtype
        _, base = builtin.load_model(model["path"], mesh, dtype_of)
        params = models.lora.make_merge_fn(adapted, mesh)(models.lora.combine(base, params))
    tokenizer = model.get("tokenizer") or model.get("path")
    tokenizer_dir = tokenizer if tokenizer and os.path.isdir(tokenizer) else None
    models.save_hf(cfg, params, out, tokenizer_dir=tokenizer_dir, dtype=dtype)
    if jax.process_index() == 0:
        _copy_extras(model.get("path"), tokenizer, tokenizer_dir, os.fspath(out))
    logging.info("exported step %d of %s to %s", step, workdir, out)
    return step


def _write_base(cfg, model: dict, adapters, mesh, dtype, out: str) -> str:
    """A GGUF base, dequantized, as the HF model directory `out/base` (with its tokenizer):
    `adapter_config.json` names it, as `AutoPeftModelForCausalLM` cannot load a `.gguf`
    file. -> its absolute path."""
    base_dir = os.path.abspath(os.path.join(out, BASE_DIR))
    _, base = builtin.load_model(model["path"], mesh, jax.tree.leaves(adapters)[0].dtype)
    tokenizer = model.get("tokenizer") or model["path"]
    tokenizer_dir = tokenizer if os.path.isdir(tokenizer) else None
    models.save_hf(cfg, base, base_dir, tokenizer_dir=tokenizer_dir, dtype=dtype)
    if jax.process_index() == 0:
        _copy_extras(model["path"], tokenizer, tokenizer_dir, base_dir)
    return base_dir


def check_out(out: str) -> None:
    """Refuses an `--out` that would overwrite something: a file, a run directory (its
    config.json would become the HF one and a resume would bypass the config check), or
    any directory that is not empty; an empty `--out=`."""
    if not os.fspath(out).strip():
        raise UserError("--out", "empty", "give --out a new or empty directory")
    if not os.path.exists(out):
        return
    if not os.path.isdir(out):
        raise UserError(out, "--out is a file", "give --out a new or empty directory")
    entries = sorted(os.listdir(out))
    if CHECKPOINT_DIR in entries or "trainer.lock" in entries:
        raise UserError(
            out,
            "--out is a run directory; exporting there would overwrite its config.json",
            "give --out a new or empty directory",
        )
    if entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise UserError(
            out,
            f"--out is not empty ({len(entries)} entries: {shown})",
            "give --out a new or empty directory, or empty it first",
        )


def _lora_config(model: dict, lora: str | None, workdir: str):
    """The run's `models.LoraConfig` (None without adapters), checked against --lora."""
    spec = model.get("lora") or {}
    if lora is not None and lora not in LORA_MODES:
        raise ValueError(f"--lora={lora!r}: expected one of {LORA_MODES}")
    if not spec.get("rank"):
        if lora is not None:
            raise ValueError(f"--lora={lora}: the run in {workdir} trained no adapters")
        return None
    return models.LoraConfig(
        rank=int(spec["rank"]),
        alpha=float(spec["alpha"]),
        targets=tuple(spec["targets"]),
        dropout=float(spec.get("dropout", 0.0)),
    )


def model_config(workdir: str, run_config: dict) -> models.ModelConfig:
    """The policy's ModelConfig: DIR/hf_config.json, else the starting model's config."""
    path = os.path.join(workdir, HF_CONFIG)
    if os.path.isfile(path):
        return models.ModelConfig.from_hf_dict(_read_json(path), source=path)
    model_path = (run_config.get("model") or {}).get("path")
    if not model_path:
        raise FileNotFoundError(f"{workdir}: no {HF_CONFIG} and no model.path in {RUN_CONFIG}")
    return builtin.model_config(model_path)


def restore_params(ckpt: Checkpointer, cfg: models.ModelConfig, step: int, mesh=None) -> dict:
    """`state.params` of a checkpoint, checked against `cfg`, sharded over `mesh`. With
    `cfg.lora` the checkpoint holds the adapters alone."""
    saved = ckpt.abstract_state(step)
    if not isinstance(saved, dict) or "params" not in saved:
        raise ValueError(f"{ckpt.directory}/{step}: the saved state has no `params` entry")
    saved = _flat(saved["params"])
    expected = models.param_specs(cfg)
    if cfg.lora is not None:
        expected = {p: s for p, s in expected.items() if models.lora.is_adapter(p[-1])}
    for path, spec in expected.items():
        name = "params." + ".".join(path)
        if path not in saved:
            raise ValueError(f"{ckpt.directory}/{step}: {name} is missing ({cfg.architecture})")
        if tuple(saved[path].shape) != spec.shape:
            raise ValueError(
                f"{ckpt.directory}/{step}: {name} has shape {list(saved[path].shape)}, the "
                f"model config says {list(spec.shape)}"
            )
    unexpected = sorted(".".join(p) for p in saved if p not in expected)
    if unexpected:
        raise ValueError(f"{ckpt.directory}/{step}: params.{unexpected[0]} is not a parameter")
    shardings = _flat(models.param_shardings(cfg, mesh or parallel.make_mesh()))
    target = unflatten(
        {p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[p]) for p, s in saved.items()}
    )
    state, _ = ckpt.restore(step, target={"params": target}, partial=True)
    return state["params"]


def _flat(tree) -> dict[tuple[str, ...], object]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {tuple(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in leaves}


def _copy_extras(model_path, tokenizer, tokenizer_dir, out: str) -> None:
    """Tokenizer from the hub cache or a GGUF file when it is not a directory;
    generation_config.json."""
    if tokenizer and tokenizer_dir is None:
        builtin.load_tokenizer(tokenizer).save_pretrained(out)
    generation = os.path.join(model_path or "", "generation_config.json")
    if model_path and os.path.isfile(generation):
        if not os.path.exists(os.path.join(out, "generation_config.json")):
            shutil.copy2(generation, out)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: not found; is --workdir a jaxrl_llm run directory?")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def main(argv) -> None:
    from absl import app, flags
    from absl import logging as absl_logging

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    if not f["verbosity"].present:  # orbax logs its restore at INFO and WARNING
        absl_logging.set_verbosity(absl_logging.ERROR)
    step = export(f.workdir, f.out, step=f.step, dtype=f.dtype, lora=f.lora)
    print(f"exported step {step} of {f.workdir} to {f.out}")


def _define_flags() -> None:
    # Defined only when run as a program, so importing this module adds no global flags
    # (the trainer defines its own --workdir).
    from absl import flags

    flags.DEFINE_string("workdir", None, "run directory (holds checkpoints/ and config.json)")
    flags.DEFINE_string("out", None, "output Hugging Face model directory")
    flags.DEFINE_integer("step", None, "checkpoint step to export (default: the latest)")
    flags.DEFINE_string("dtype", None, "weight dtype, e.g. bfloat16 (default: as saved)")
    flags.DEFINE_enum(
        "lora",
        None,
        list(LORA_MODES),
        "a LoRA run: merged (a full HF model, the default) or peft (the adapters alone)",
    )
    flags.mark_flags_as_required(["workdir", "out"])


if __name__ == "__main__":
    from jaxrl_llm.errors import cli_main, run_absl

    _define_flags()
    cli_main(lambda: run_absl(main))
