"""Issue 57: the lm-eval reports' hand-made tables are what their committed raw records give.

``reports/lm_eval/`` holds lm-eval's own results and per-sample logs (``results_*.json``,
``samples_*.jsonl``) and certkv's certificate summaries (``certificates*.json``) of every run;
each table cell below is recomputed from them and compared with the README's text."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers.committed import tables

ROOT = Path(__file__).resolve().parents[2] / "reports" / "lm_eval"


def table(path: Path) -> tuple[list[str], list[list[str]]]:
    """The README's first markdown table: its header and rows of cells."""
    return tables(path.read_text())[0]


def one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.rglob(pattern))
    assert len(found) == 1, (folder, pattern, found)
    return found[0]


def samples(folder: Path, task: str) -> dict[int, dict]:
    """lm-eval's per-sample log of ``task`` in a run folder, by document id."""
    path = one(folder, f"samples_{task}_*.jsonl")
    return {s["doc_id"]: s for s in map(json.loads, path.read_text().splitlines())}


def metric(folder: Path, task: str, name: str) -> float:
    return json.loads(one(folder, "results_*.json").read_text())["results"][task][f"{name},none"]


def loglikelihoods(folder: Path) -> list[float]:
    """The 20 log-likelihoods of ``certkv_needle_choice`` (4 choices x 5 documents), in order."""
    docs = samples(folder, "certkv_needle_choice")
    return [float(r[0]) for i in sorted(docs) for r in docs[i]["filtered_resps"]]


def answers(folder: Path, task: str) -> dict[int, object]:
    return {i: s["filtered_resps"] for i, s in samples(folder, task).items()}


def equal_answers(folder: Path, reference: Path, task: str) -> str:
    mine, theirs = answers(folder, task), answers(reference, task)
    assert mine.keys() == theirs.keys()
    return f"{sum(mine[i] == theirs[i] for i in mine)}/{len(mine)}"


def test_the_harness_table_is_its_raw_records():
    """``reports/lm_eval/README.md``: accuracy and score from lm-eval's results, the largest
    log-likelihood differences and the equal generations from its per-sample logs."""
    header, rows = table(ROOT / "README.md")
    hf, dense = ROOT / "hf", ROOT / "certkv_dense"
    assert [row[0] for row in rows] == ["hf", "certkv_dense", "certkv_naive", "certkv_certified"]
    for row in rows:
        run = ROOT / row[0]
        diff = [max(abs(a - b) for a, b in zip(loglikelihoods(run), loglikelihoods(ref),
                                               strict=True)) for ref in (hf, dense)]
        assert row[1:] == [f"{metric(run, 'certkv_needle_choice', 'acc'):.2f}",
                           f"{metric(run, 'certkv_ruler_niah_single', 'score'):.2f}",
                           f"{diff[0]:.2e}", f"{diff[1]:.2e}",
                           equal_answers(run, hf, "certkv_ruler_niah_single")], (row, header)


def test_the_harness_certificate_sentence_is_its_raw_records():
    """The bullet on ``certkv_certified/certificates.json`` (and the naive medians beside it)."""
    text = " ".join((ROOT / "README.md").read_text().split())
    cert = json.loads((ROOT / "certkv_certified" / "certificates.json").read_text())
    naive = json.loads((ROOT / "certkv_naive" / "certificates.json").read_text())
    rungs = [100 * r for r in cert["rung_rates"][:4]]
    quoted = (f"{cert['requests']} requests, {cert['steps']} decode steps",
              "rungs 0/1/2/3 = " + " / ".join([*(f"{r:.1f}" for r in rungs[:3]),
                                               f"{rungs[3]:.2f}"]) + " %",
              f"E_key median {cert['e_key']['median']:.1e}".replace("e-0", "e-"),
              f"E_val median {cert['e_val']['median']:.2f}",
              f"{cert['value_promotions_per_step']:.0f} value promotions per layer step",
              f"E_key median {naive['e_key']['median']:.2f}, "
              f"E_val {naive['e_val']['median']:.2f}")
    for phrase in quoted:
        assert phrase in text, phrase


def rungs(rates: list[float]) -> str:
    """``100/0/0/0/0`` or ``0.0/21.2/39.1/37.4/2.4``: percent per rung, whole where exact."""
    return "/".join(f"{100 * r:.0f}" if r in (0.0, 1.0) and rates[0] == 1.0 else
                    f"{100 * r:.1f}" for r in rates)


@pytest.mark.parametrize("row", table(ROOT / "innerq_direction" / "README.md")[1],
                         ids=lambda row: row[0])
def test_the_innerq_direction_table_is_its_raw_records(row):
    """``innerq_direction/README.md``: accuracy from lm-eval's results, the answers equal to
    dense's from the per-sample logs, the rest from the run's certificate summary."""
    folder = ROOT / "innerq_direction"
    run = folder / row[0]
    cert = json.loads(one(run, "certificates_*.json").read_text())
    acc = metric(run, "certkv_niah", "acc")
    stderr = metric(run, "certkv_niah", "acc_stderr")
    expected = [f"{acc:.2f} ± {stderr:.2f}",
                equal_answers(run, folder / "dense", "certkv_niah")]
    if cert["mode"] == "dense":
        expected += ["-"] * 4 + ["1.000"]
    else:
        expected += [str(cert["steps"]), rungs(cert["rung_rates"]),
                     f"{cert['e_key']['median']:.3g}", f"{cert['e_val']['median']:.2f}",
                     f"{cert['tier1_over_dense']:.3f}"]
    assert row[1:] == expected
    assert math.isclose(acc, sum(s["acc"] for s in samples(run, "certkv_niah").values()) / 20)
