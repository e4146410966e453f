"""Issue 57: ``reports/faults/README.md``'s table against the seed's Table 3 is what the
committed run's raw records give, cell by cell (the variants tables below it have their own
test in ``test_committed_reports.py``)."""

from __future__ import annotations

import re
from pathlib import Path

from helpers.committed import NUMBER, agrees, tables

from certkv.eval.summary import certificate_summary
from certkv.report.tables import RunData, quality_delta

ROOT = Path(__file__).resolve().parents[2] / "reports" / "faults"
CODES = {"INT4, no code": "none", "Hamming(7,4)": "hamming74", "Hamming(8,4)": "hamming84",
         "H(8,4) + interp": "hamming84_interp", "Golay(24,12)": "golay24"}


def check(cell: str, q: dict, with_value: bool) -> None:
    """``value, delta [lo, hi]`` (or ``delta [lo, hi]``) at the digits printed."""
    tokens = NUMBER.findall(cell.replace("*", ""))
    delta = q["delta"]
    values = ([q["method"]] if with_value else []) + [delta.estimate, delta.low, delta.high]
    assert len(tokens) == len(values), cell
    for token, value in zip(tokens, values, strict=True):
        assert agrees(token, value), (cell, token, value)


def test_the_seed_table_is_its_raw_records():
    run = RunData.load(ROOT / "faults_pg19_4k" / "run")
    text = (ROOT / "README.md").read_text()
    heading = "## Perplexity against the seed's Table 3 (p = 1e-2)"
    (_, rows), *_ = tables(text[text.index(heading):])
    assert [r[0] for r in rows][:2] == ["FP16 (dense)", "INT4, no code, p = 0"]
    dense = quality_delta(run, "perplexity", "none-p0-naive")["dense"]
    assert agrees(rows[0][2], dense)
    for row in rows[1:]:
        exact = row[0].endswith("p = 0")
        code = CODES[row[0].removesuffix(", p = 0")]
        naive = f"{code}-p0-naive" if exact else f"{code}-p1e-2-naive"
        check(row[2], quality_delta(run, "perplexity", naive), True)
        cert = certificate_summary(run.certificate_records(naive))
        assert row[3] == f"{cert['violations']} / {cert['head_steps']}", row[0]
        certified = f"{code}-p0-certified" if exact else f"{code}-p1e-2-certified-check"
        check(re.sub(r"^\(.*?\)", "", row[4]), quality_delta(run, "perplexity", certified), False)
