"""benchmarks/device_check.py runs end to end on CPU with its tiny preset (so it cannot rot)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def test_device_check_tiny_preset_writes_its_tables(tmp_path):
    import device_check

    out = tmp_path / "check.md"
    device_check.main(["--preset=tiny", f"--out={out}"])
    text = out.read_text()
    for title in ("## GRPO step", "## Decode", "## Attention", "## Packed vs padded update"):
        assert title in text, title
    assert "| sample " in text and "| update " in text
    # the attention table at T = 128: xla and blockwise, float32, as equal as rounding
    rows = [line for line in text.splitlines() if line.startswith("| 128 ")]
    diffs = [float(r.split("|")[-2]) for r in rows]
    assert len(diffs) == 2 and max(diffs) <= 1e-5, rows
