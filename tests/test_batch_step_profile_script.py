"""scripts/batch_step_profile.py: a batch decode step split into the parts it calls (issue 54's
profile: where the time of batch 1 and batch B goes)."""

from __future__ import annotations

import json
import re

import pytest
from helpers import script


def test_a_profile_splits_each_step_into_parts_that_add_up_and_writes_its_report(tmp_path):
    """Every (sequence, layer) step runs as one compiled call, so both are counted once per
    sequence and layer; the parts are disjoint, so they add up to the step; the report has one
    row per part and a column pair per batch."""
    pytest.importorskip("numba")
    mod = script("batch_step_profile.py")
    mod.main(["--context", "48", "--batch", "1", "--batch", "3", "--steps", "2",
              "--weights", "random", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "batch_step_profile.json").read_text())
    assert [r["batch"] for r in data["results"]] == [1, 3] and data["weights"] == "random"
    for r in data["results"]:
        layers = 30  # SmolLM2-135M's
        assert r["calls"]["steps"] == r["calls"]["compiled"] == layers * r["batch"]
        assert r["calls"]["append"] == layers * r["batch"]
        ms = r["ms"]
        assert min(ms.values()) >= 0 and ms["compiled"] > 0 and ms["python"] > 0
        parts = sum(ms[key] for _, key in mod.ROWS[1:])
        assert parts == pytest.approx(ms["total"], rel=1e-9)
    text = (tmp_path / "batch_step_profile.md").read_text()
    assert "Command: `python scripts/batch_step_profile.py --context 48 --batch 1" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(mod.ROWS)
    assert all(re.fullmatch(r"\| [^|]+( \| \d+\.\d \| -?\d+){2} \|", r) for r in rows[1:])


def test_bad_arguments_name_the_fix(capsys):
    mod = script("batch_step_profile.py")
    with pytest.raises(SystemExit):
        mod.main(["--batch", "0"])
    assert "e.g. --context 2048 --batch 1 --batch 8" in capsys.readouterr().err
