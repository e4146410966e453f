"""Issue 57: every committed ``certkv bench`` report's tables are what its JSON records give.

A bench report is ``<name>.json`` (the command, commit, machine and every measured record) and
``<name>.md`` (a header, the tables and notes the command renders from those records, then any
section written by hand). The tables are rendered again here from the JSON, as the command
renders them, and must be the markdown's lines that follow the header. Reports of lent GPU
machines made by older code (whose records lack fields today's tables print) cannot be made
again here; :data:`HISTORICAL` lists them with the reason, and that list is checked too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from certkv import bench, bench_codecs
from certkv.bench import batch as batching

ROOT = Path(__file__).resolve().parents[2]
GPU_BEFORE = "a lent GPU's run, rendered by the code of its day (records lack today's fields)"
HISTORICAL = {
    "reports/bench/attention_cuda.json": GPU_BEFORE,
    "reports/bench/decode_llama31_8b_cuda.json": GPU_BEFORE,
    "reports/bench/eager_segments/attention_cuda.json": GPU_BEFORE,
    "reports/bench/h100_2026-11-24/attention_cuda.json": GPU_BEFORE,
    "reports/bench/h100_2026-11-24/decode_llama31_8b_cuda.json": GPU_BEFORE,
    "reports/bench/h200_2026-11-27/decode_llama31_8b_cuda.json": GPU_BEFORE,
}


def rendered(payload: dict) -> list[str]:
    """The tables and notes the ``certkv bench`` command that made ``payload`` renders."""
    records, words = payload["records"], payload["command"].split()
    kind = words[words.index("bench") + 1]
    if kind == "codecs":
        case = bench_codecs.CodecCase(**records["case"])
        return bench.markdown(bench_codecs.codec_tables(records, case),
                              bench_codecs.codec_notes(records))
    if kind == "attention":
        peak = payload.get("peak_gbps")
        return bench.markdown(bench.attention_tables(records, peak, payload.get("copy_gbps")),
                              bench.attention_notes(records, peak))
    if kind == "launches":
        return bench.markdown(bench.dispatch_tables(records), bench.launch_notes(records))
    assert kind == "decode", payload["command"]
    if any(w.startswith("--batch") for w in words):
        return bench.markdown(batching.batch_tables(records), batching.batch_notes(records))
    return bench.markdown(bench.decode_tables(records), bench.decode_notes(records))


REPORTS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "reports").rglob("*.json")
                 if p.with_suffix(".md").is_file()
                 and p.with_suffix(".md").read_text().startswith("# certkv bench "))


def test_the_historical_reports_exist_and_say_why():
    assert set(HISTORICAL) <= set(REPORTS)
    assert all(HISTORICAL.values())


@pytest.mark.parametrize("path", [p for p in REPORTS if p not in HISTORICAL])
def test_a_committed_bench_report_is_its_records_rendered(path):
    js = ROOT / path
    payload = json.loads(js.read_text())
    lines = rendered(payload)
    text = js.with_suffix(".md").read_text().split("\n")
    assert text[2] == f"Command: `{payload['command']}`  "
    assert text[3] == f"Commit: `{payload['commit']}`  "
    body = text[5:]  # after the header: its figure (where the report keeps it), the tables
    while body[0] == "" or body[0].startswith("!["):
        body.pop(0)
    assert body[:len(lines)] == lines
