"""scripts/certificate_tightness.py: the committed ``reports/tightness.md`` is its JSON's rows
rendered, number for number (issue 57: a reader recomputes a report from its records)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import script

REPORTS = Path(__file__).resolve().parents[1] / "reports"


def test_the_committed_report_is_its_json_rendered():
    data = json.loads((REPORTS / "tightness.json").read_text())
    text = script("certificate_tightness.py").render(data["rows"], data["command"],
                                                     data["commit"], data["machine"])
    assert text == (REPORTS / "tightness.md").read_text()
