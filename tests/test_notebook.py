"""notebooks/quickstart.ipynb: stored clean, and run top to bottom in a fresh Jupyter kernel.

The run is the notebook itself with its parameters cell (tag "parameters") replaced by
tiny values: 4 steps of 8 prompts, evaluation every 2 steps on 8 held-out prompts.
"""

import ast
import base64
import os
import re

import pytest

from jaxrl_llm import config as config_lib
from jaxrl_llm import models
from jaxrl_llm.trainer.metrics import read_metrics

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "quickstart.ipynb")
BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"
BADGE_URL = (
    "https://colab.research.google.com/github/jaxrl-llm/jaxrl_llm/blob/main/"
    "notebooks/quickstart.ipynb"
)


def _read():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    return nb


def _parameters_cell(nb):
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged 'parameters'"
    assert tagged[0].cell_type == "code"
    return tagged[0]


def _assigned_names(source: str) -> set[str]:
    return {
        target.id
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def _text(cell) -> str:
    """stdout, stderr and text/plain of a code cell's outputs, joined."""
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif "data" in out:
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


def _kernel_env() -> dict:
    """The kernel's environment: one CPU device, the inline plot backend, this checkout.

    conftest.py gives the pytest process 8 fake CPU devices; the kernel gets what a
    laptop or a Colab CPU runtime has, one. This checkout goes first on PYTHONPATH so that
    the install cell finds jaxrl_llm and never reaches for the network.
    """
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("MPLBACKEND", None)  # the kernel then sets the inline backend, which makes PNGs
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return env


def test_notebook_is_stored_clean():
    nb = _read()
    assert nb.nbformat == 4
    assert nb.metadata.kernelspec.name == "python3"
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    assert f"[![Open In Colab]({BADGE_IMAGE})]({BADGE_URL})" in first.source
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.id
    assert {"NUM_STEPS", "EVAL_EVERY", "WORKDIR"} <= _assigned_names(_parameters_cell(nb).source)
    assert "NUM_STEPS = 300" in _parameters_cell(nb).source  # as configs/quickstart.py


@pytest.mark.slow
def test_notebook_runs_shortened(tmp_path):
    nb = _read()
    cell = _parameters_cell(nb)
    workdir = tmp_path / "run"
    tiny = {
        "NUM_STEPS": 4,
        "BATCH_SIZE": 8,
        "NUM_GENERATIONS": 4,
        "EVAL_EVERY": 2,
        "EVAL_PROMPTS": 8,
        "LOG_EVERY": 2,
        "PRINT_SAMPLES_EVERY": 2,
        "WORKDIR": str(workdir),
    }
    # Every parameter of the notebook is shrunk here: a new one must be added above.
    assert _assigned_names(cell.source) == set(tiny)
    cell.source = "\n".join(f"{name} = {value!r}" for name, value in tiny.items())

    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=300,  # per cell
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    client.execute(env=_kernel_env())  # raises CellExecutionError naming a failing cell

    cells = {c.id: c for c in nb.cells}
    for c in nb.cells:
        if c.cell_type == "code":
            assert not [o for o in c.outputs if o.output_type == "error"], c.id
    assert "nothing to install" in _text(cells["install"])
    assert "rollout.num_generations = 4" in _text(cells["config"])
    assert "data.name = 'arithmetic/digits_2'" in _text(cells["config"])
    model_cfg = models.ModelConfig.from_hf_dir(config_lib.resolve_model_path("quickstart"))
    summary = _text(cells["summary"])
    assert f"{model_cfg.num_params():,} parameters" in summary
    assert "devices: 1 x" in summary

    records = read_metrics(workdir / "metrics.jsonl")
    train_steps = [r["step"] for r in records if "reward/mean" in r]
    eval_records = [r for r in records if "eval/pass@1" in r]
    assert train_steps == [2, 4]
    assert [r["step"] for r in eval_records] == [0, 2, 4]  # eval.at_start: the initial policy
    for r in eval_records:
        assert 0.0 <= r["eval/pass@1"] <= 1.0 and 0.0 <= r["eval/pass@8"] <= 1.0
    assert "eval/pass@1" in _text(cells["train"]) and "eval/pass@8" in _text(cells["train"])
    assert (workdir / "config.json").is_file() and (workdir / "samples.jsonl").is_file()

    images = [
        o.data["image/png"] for o in cells["plot"].outputs if "image/png" in o.get("data", {})
    ]
    assert len(images) == 1, [o.output_type for o in cells["plot"].outputs]
    png = base64.b64decode(images[0])
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
