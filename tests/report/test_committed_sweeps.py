"""Issue 57: a committed sweep report is what ``certkv sweep`` aggregates from its committed
points' raw records, line for line."""

from __future__ import annotations

from pathlib import Path

import pytest

from certkv.report.sweep import build_sweep_report

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["+experiment=pg19_4k", "task.perplexity.windows=4", "task.perplexity.decode_tokens=64",
          "out_dir=reports"]
# name -> (swept key, values) of each committed sweep under reports/sweeps/<name>/pg19_4k
SWEEPS = {"group": ("quantizer.value_codec.group", (8, 16, 32)),
          "vtol": ("value_policy.v_tol", (0.02, 0.05, 0.1)),
          "kmax": ("selector.k_max", (64, 128, 256, 512)),
          "scratch": ("cache.scratch_key_blocks", (0, 128, 256, 512, 1024))}


def _table(text: str, name: str) -> list[str]:
    lines = text.split("\n")
    start = lines.index(f"## Sweep {name}")
    return [line for line in lines[start:] if line.startswith("|")]


@pytest.mark.parametrize("name", sorted(SWEEPS))
def test_a_committed_sweep_is_recomputed_from_its_points(name, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    key, values = SWEEPS[name]
    root = Path("reports/sweeps") / name / "pg19_4k"
    wanted = [[*COMMON, f"{key}={v}"] for v in values]
    report = build_sweep_report(name, root, [key], tmp_path, wanted)
    assert report.points == len(values) and report.failed == 0
    recomputed = _table((tmp_path / "README.md").read_text(), name)
    assert len(recomputed) == 2 + 3 * len(values)
    assert recomputed == _table((ROOT / root / "README.md").read_text(), name)
