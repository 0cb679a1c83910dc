"""Start-up says nothing the user cannot act on: no "PyTorch was not found" from
transformers, no TFDS download talk or progress bars for the locally generated sets; other
warnings still get through."""

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_NO_TORCH = """
import importlib.util, sys
find_spec = importlib.util.find_spec  # transformers asks find_spec whether torch exists
importlib.util.find_spec = lambda name, *a, **k: (
    None if name.split(".")[0] == "torch" else find_spec(name, *a, **k))
if sys.argv[1] == "ours":
    import jaxrl_llm
import transformers
transformers.AutoTokenizer  # the lazy module resolves what the trainer uses
from transformers.utils import logging
logging.get_logger("transformers").warning("a real transformers warning")
"""


def run(code, *args):
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_no_pytorch_notice_but_real_transformers_warnings_pass():
    bare = run(_NO_TORCH, "bare")  # the control: without the package the notice shows
    assert "PyTorch was not found." in bare.stderr
    ours = run(_NO_TORCH, "ours")
    assert "PyTorch was not found" not in ours.stderr
    assert ours.stderr.strip().splitlines() == ["[transformers] a real transformers warning"]


_GENERATE = """
import sys
from jaxrl_llm import data
from tensorflow_datasets.core.utils import tqdm_utils
cfg = data.default_config()
cfg.name, cfg.data_dir = "arithmetic/digits_1", sys.argv[1]
for _ in range(2):  # generated once, then read
    assert len(data.make_source(cfg)) == 20_000
assert tqdm_utils._active  # progress bars are back on for everything else
"""


def test_local_dataset_generation_says_one_line(tmp_path):
    proc = run(_GENERATE, tmp_path)
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"data: generating arithmetic/digits_1 in {tmp_path}/arithmetic/digits_1/1.1.0 (once)"
    ]
