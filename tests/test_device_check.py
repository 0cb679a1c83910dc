"""benchmarks/device_check.py runs end to end on CPU with its tiny preset (so it cannot rot).

The benchmarks' directory is on sys.path only during the test, and its modules leave
sys.modules after it: its top-level names (`verifiers`, `packing`, ...) would otherwise
shadow installed packages of the same name for later tests in the process."""

import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


def _section(text: str, title: str) -> list[list[str]]:
    """The cells of the data rows of the markdown table under the heading `title`."""
    lines = text[text.index(title) :].splitlines()[2:]
    rows = []
    for line in lines:
        if rows and not line.startswith("|"):
            break
        if line.startswith("| ") and not line.startswith("|-"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows[1:]  # the header row off


def test_device_check_tiny_preset_writes_its_tables(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)  # sys.path restored after the test
    before = set(sys.modules)
    try:
        _check(tmp_path)
    finally:
        here = os.path.realpath(BENCHMARKS)
        for name in set(sys.modules) - before:
            where = getattr(sys.modules[name], "__file__", None) or ""
            if os.path.dirname(os.path.realpath(where)) == here:
                del sys.modules[name]


def _check(tmp_path):
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
    # packed vs padded: measured seconds for the update and the reference, every
    # micro-batch of the long-tailed batch packed, and the two updates' losses equal
    packed = _section(text, "## Packed vs padded update")
    assert [r[1] for r in packed] == ["update", "reference"], packed
    assert "50% padding" in packed[0][0], packed
    for r in packed:
        padded_s, packed_s = (float(c.split()[0]) for c in r[2:4])
        assert padded_s > 0 and packed_s > 0 and float(r[4].rstrip("x")) > 0, r
        assert r[-1] == "2/2", r
    loss_padded, loss_packed = (float(x) for x in packed[0][5].split("/"))
    assert abs(loss_padded - loss_packed) <= 1e-3 * abs(loss_padded) + 1e-7, packed[0]
