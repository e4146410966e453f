"""Issue 57: a committed sweep report is what ``certkv sweep`` aggregates from its committed
points' raw records, line for line."""

from __future__ import annotations

from pathlib import Path

from certkv.report.sweep import build_sweep_report

ROOT = Path(__file__).resolve().parents[2]
GROUP = ROOT / "reports/sweeps/group/pg19_4k"
COMMON = ["+experiment=pg19_4k", "task.perplexity.windows=4", "task.perplexity.decode_tokens=64",
          "out_dir=reports"]


def _table(text: str) -> list[str]:
    lines = text.split("\n")
    start = lines.index("## Sweep group")
    return [line for line in lines[start:] if line.startswith("|")]


def test_the_value_group_sweep_is_recomputed_from_its_points(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    wanted = [[*COMMON, f"quantizer.value_codec.group={g}"] for g in (8, 16, 32)]
    report = build_sweep_report("group", GROUP.relative_to(ROOT), ["quantizer.value_codec.group"],
                                tmp_path, wanted)
    assert report.points == 3 and report.failed == 0
    recomputed = _table((tmp_path / "README.md").read_text())
    assert len(recomputed) == 2 + 3 * 3
    assert recomputed == _table((GROUP / "README.md").read_text())
