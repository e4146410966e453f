"""The paper's tables (Section 9) from run directories alone, as plain data for the console,
markdown and W&B renderers.

Every comparison is paired: a method is compared with the run's dense variant on the samples
both finished (so a partial run renders too). Statistics (:mod:`certkv.eval.stats`): NIAH
accuracy deltas by paired bootstrap over trials, RULER deltas by bootstrap over whole slices,
deltas of pooled perplexity (the value column's) by a t-interval over windows, exact McNemar
tests on paired pass/fail (NIAH: all ten needles; RULER: a subtask trial fully right). One
sample gives no interval (printed as such).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from certkv.errors import CertKVError, require
from certkv.eval import stats
from certkv.eval.press import MODE as PRESS_MODE
from certkv.eval.results import RunDir, read_jsonl
from certkv.eval.summary import certificate_summary
from certkv.report.layout import Table


@dataclass
class RunData:
    """One run directory's records and provenance."""

    root: Path
    meta: dict
    config: dict
    samples: list[dict]
    certificates: list[dict]
    variants: list[str] = field(default_factory=list)
    modes: dict[str, str] = field(default_factory=dict)
    name: str = ""  # set by label_runs when two runs of a report share an experiment

    @classmethod
    def load(cls, path: str | Path) -> RunData:
        root = Path(path)
        require((root / RunDir.SAMPLES).exists() or (root / RunDir.CONFIG).exists(),
                CertKVError, f"{root} is not a run directory (no {RunDir.SAMPLES}); pass a "
                f"directory that `certkv run` wrote.")
        config = yaml.safe_load((root / RunDir.CONFIG).read_text()) \
            if (root / RunDir.CONFIG).exists() else {}
        meta = json.loads((root / RunDir.META).read_text()) \
            if (root / RunDir.META).exists() else {}
        run = cls(root, meta, config or {}, read_jsonl(root / RunDir.SAMPLES),
                  read_jsonl(root / RunDir.CERTIFICATES))
        listed = [v["name"] for v in run.config.get("variants", [])]
        seen = {r["variant"]: r.get("mode", "certified") for r in run.samples}
        run.variants = [v for v in listed if v in seen] + [v for v in seen if v not in listed]
        run.modes = seen
        return run

    @property
    def experiment(self) -> str:
        return self.meta.get("experiment") or self.config.get("experiment") or self.root.name

    @property
    def label(self) -> str:
        """How tables and figures name the run: its experiment, made unique among the runs of
        one report by :func:`label_runs` (the overrides that name its directory)."""
        return self.name or self.experiment

    @property
    def model(self) -> str:
        return self.meta.get("model") or self.config.get("model", {}).get("name", "?")

    @property
    def reference(self) -> str | None:
        """The dense variant every method is compared with (None: no dense variant)."""
        return next((v for v in self.variants if self.modes[v] == "dense"), None)

    @property
    def tasks(self) -> list[str]:
        return list(dict.fromkeys(r["task"] for r in self.samples))

    def context(self, task: str) -> int | str:
        return self.config.get("task", {}).get(task, {}).get("context", "?")

    def variant_entry(self, variant: str) -> dict:
        """``variant``'s entry in the run's config (its overrides; empty if not planned)."""
        return next((v for v in self.config.get("variants", []) if v.get("name") == variant),
                    {})

    def records(self, task: str, variant: str) -> dict[int, dict]:
        return {r["sample"]: r for r in self.samples
                if r["task"] == task and r["variant"] == variant}

    def pairs(self, task: str, variant: str) -> list[tuple[dict, dict]]:
        """(dense, method) records of the samples both finished, by sample index."""
        ref = self.records(task, self.reference) if self.reference else {}
        mine = self.records(task, variant)
        return [(ref[i], mine[i]) for i in sorted(mine) if i in ref]

    def certificate_records(self, variant: str) -> list[dict]:
        return [c for c in self.certificates if c["variant"] == variant]


def label_runs(runs: list[RunData]) -> None:
    """Give runs that share an experiment distinct labels: ``tiny [seed=1]``, from the overrides
    that name the run directories and differ between those runs (``default`` for none), then
    ``#2``, ``#3`` if still equal."""
    groups: dict[str, list[RunData]] = {}
    for run in runs:
        groups.setdefault(run.experiment, []).append(run)
    for experiment, group in groups.items():
        if len(group) < 2:
            continue
        items = [set(_dir_overrides(r)) for r in group]
        common = set.intersection(*items)
        seen: dict[str, int] = {}
        for run, mine in zip(group, items, strict=True):
            label = f"{experiment} [{','.join(sorted(mine - common)) or 'default'}]"
            seen[label] = seen.get(label, 0) + 1
            run.name = label if seen[label] == 1 else f"{label} #{seen[label]}"


def _dir_overrides(run: RunData) -> list[str]:
    """The overrides a run directory is named after (``a=1,b=2`` -> ``["a=1", "b=2"]``)."""
    name = run.root.name
    return [] if name in ("", run.experiment) else [i for i in name.split(",") if i]


def fmt(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` decimals; ``-`` for a missing or NaN value."""
    return "-" if _missing(x) else f"{x:.{digits}f}"


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def fmt_sci(x: float, sig: int = 2) -> str:
    """Short scientific notation with ``sig`` significant digits: ``3.1e-4``, ``1.2e0``,
    ``0`` for zero, ``-`` for a missing or NaN value."""
    if _missing(x):
        return "-"
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    mantissa, exponent = f"{x:.{sig - 1}e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def fmt_sig(x: float, sig: int = 3) -> str:
    """About ``sig`` significant digits, short: ``0.24``, ``12.5``, ``282``, ``1234``; below
    1e-3 in short scientific notation (``4.1e-5``); ``-`` for a missing or NaN value."""
    if _missing(x):
        return "-"
    if x != 0 and abs(x) < 1e-3:
        return fmt_sci(x, sig)
    if abs(x) >= 10 ** (sig - 1):
        return f"{x:.0f}"
    return f"{x:.{sig}g}"


def fmt_interval(iv: stats.Interval, digits: int = 3) -> str:
    """``+0.012 [-0.004, +0.020]``; an interval one sample cannot give (infinite bounds, from
    :mod:`certkv.eval.stats`) says so instead of printing ``[-inf, +inf]``."""
    if not iv.bounded:
        return f"{iv.estimate:+.{digits}f} [no CI: n={iv.n}]"
    return f"{iv.estimate:+.{digits}f} [{iv.low:+.{digits}f}, {iv.high:+.{digits}f}]"


def _ppl(records: list[dict]) -> float:
    tokens = sum(r["tokens"] for r in records)
    return math.exp(sum(r["nll"] for r in records) / tokens) if tokens else float("nan")


def _score(record: dict) -> float:
    """A record's retrieval quality: RULER score or NIAH fraction of needles."""
    return record["score"] if "score" in record else record["accuracy"]


def quality_delta(run: RunData, task: str, variant: str) -> dict | None:
    """Paired quality of ``variant`` against dense on ``task``: values, delta with its 95% CI,
    and (retrieval) the McNemar table; None without paired samples."""
    pairs = run.pairs(task, variant)
    if not pairs or variant == run.reference:
        return None
    ref, mine = [p[0] for p in pairs], [p[1] for p in pairs]
    context = run.context(task)
    seed = stats.seed_for(run.experiment, task, context, variant)
    if task == "perplexity":  # pooled over windows: the delta is value - dense exactly
        delta = stats.paired_perplexity_delta([(r["nll"], r["tokens"]) for r in ref],
                                              [(r["nll"], r["tokens"]) for r in mine])
        return {"metric": "ppl", "dense": _ppl(ref), "method": _ppl(mine), "n": len(pairs),
                "delta": delta, "mcnemar": None}
    dense_scores, scores = [_score(r) for r in ref], [_score(r) for r in mine]
    if task == "ruler":
        delta = stats.clustered_bootstrap_delta(dense_scores, scores,
                                                [r["slice"] for r in ref], seed=seed)
    else:
        delta = stats.paired_bootstrap_delta(dense_scores, scores, seed=seed)
    test = stats.mcnemar([bool(r["pass"]) for r in ref], [bool(r["pass"]) for r in mine])
    return {"metric": "accuracy", "dense": statistics.fmean(dense_scores),
            "method": statistics.fmean(scores), "n": len(pairs), "delta": delta,
            "mcnemar": test}


def quality_table(runs: list[RunData]) -> Table:
    """Tables 3, 4 and 14: every method against dense, per run and task (one run: its name in
    the title instead of a column)."""
    several = len(runs) > 1
    rows = []
    for run in runs:
        for task in run.tasks:
            for variant in run.variants:
                q = quality_delta(run, task, variant)
                if q is None:
                    continue
                test = q["mcnemar"]
                rows.append([*([run.label] if several else []), task,
                             str(run.context(task)), variant, fmt(q["dense"]), fmt(q["method"]),
                             fmt_interval(q["delta"]), str(q["n"]),
                             "-" if test is None else f"{test.critical}/{test.reverse}",
                             "-" if test is None else fmt_sig(test.p_value, 2)])
    where = "" if several else f"{runs[0].label}; " if runs else ""
    return Table(f"Quality against dense ({where}paired; Tables 3, 4, 14)",
                 [*(["run"] if several else []), "task", "ctx", "method", "dense", "value",
                  "delta [95% CI]", "n", "crit/rev", "p"], rows,
                 "delta = value - dense on the same prompts; perplexity is pooled over the "
                 "windows (exp of their total NLL over their total tokens), in both columns. "
                 "95% CI: perplexity, Student's t over windows on the mean per-token NLL "
                 "difference, mapped to perplexity; NIAH, percentile bootstrap over trials; "
                 "RULER, over whole slices (10,000 resamples, seed 20260425 + offsets); no CI: "
                 "one sample gives no interval. critical = dense passes and the "
                 "method fails (NIAH: all ten needles; RULER: a subtask trial fully right); "
                 "reverse = the converse; exact McNemar test on them.",
                 {"ctx": "context tokens", "dense, value": "perplexity (task perplexity) or "
                  "accuracy (niah, ruler) of dense and of the method", "n": "paired samples",
                  "crit/rev": "critical/reverse discordant pairs", "p": "McNemar p-value"},
                 keys=4 if several else 3)


def perplexity_table(run: RunData) -> Table | None:
    """Table 5: per-window dense and method perplexity."""
    methods = [v for v in run.variants if v != run.reference]
    ref = run.records("perplexity", run.reference) if run.reference else {}
    if not ref:
        return None
    rows = []
    for i, d in sorted(ref.items()):
        cells = [str(i), str(d.get("document", "")), fmt(d["ppl"])]
        for v in methods:
            m = run.records("perplexity", v).get(i)
            cells.append("-" if m is None else f"{fmt(m['ppl'])} ({m['ppl'] - d['ppl']:+.3f})")
        rows.append(cells)
    return Table(f"Perplexity per window ({run.label}; Table 5)",
                 ["window", "document", "dense", *methods], rows,
                 "Each window: the first half prefilled densely, the second half teacher-forced "
                 "through the method; in brackets the delta to dense.", keys=3)


def ruler_table(run: RunData) -> Table | None:
    """Tables 6-8: RULER accuracy per subtask (slice-bootstrap CI of each method's delta)."""
    if run.reference is None or "ruler" not in run.tasks:
        return None
    methods = [v for v in run.variants if v != run.reference]
    subtasks = list(dict.fromkeys(r["subtask"] for r in run.samples if r["task"] == "ruler"))
    rows = []
    for subtask in [*subtasks, "all"]:
        cells = [subtask]
        for v in [run.reference, *methods]:
            pairs = [p for p in run.pairs("ruler", v)
                     if subtask == "all" or p[1]["subtask"] == subtask]
            if v == run.reference:
                pairs = [(r, r) for r in run.records("ruler", v).values()
                         if subtask == "all" or r["subtask"] == subtask]
            if not pairs:
                cells.append("-")
                continue
            acc = statistics.fmean(p[1]["score"] for p in pairs)
            if v == run.reference:
                cells.append(fmt(acc))
                continue
            delta = stats.clustered_bootstrap_delta(
                [p[0]["score"] for p in pairs], [p[1]["score"] for p in pairs],
                [p[0]["slice"] for p in pairs],
                seed=stats.seed_for(run.experiment, "ruler", subtask, v))
            cells.append(f"{fmt(acc)} ({fmt_interval(delta, 2)})")
        rows.append(cells)
    return Table(f"RULER accuracy per subtask ({run.label}, context "
                 f"{run.context('ruler')}; Tables 6-8)", ["subtask", run.reference, *methods],
                 rows, "Score: the fraction of required references in the answer (RULER's "
                 "string_match_all). Methods: accuracy (delta to dense [95% CI], bootstrap over "
                 "slices).", keys=2)


def niah_table(run: RunData) -> Table | None:
    """Table 10: NIAH accuracy, pass rates and the McNemar 2x2 table per method."""
    if run.reference is None or "niah" not in run.tasks:
        return None
    rows = []
    for v in run.variants:
        if v == run.reference:
            continue
        pairs = run.pairs("niah", v)
        if not pairs:
            continue
        test = stats.mcnemar([bool(d["pass"]) for d, _ in pairs],
                             [bool(m["pass"]) for _, m in pairs])
        rows.append([v, str(len(pairs)),
                     fmt(statistics.fmean(d["accuracy"] for d, _ in pairs)),
                     fmt(statistics.fmean(m["accuracy"] for _, m in pairs)),
                     fmt(statistics.fmean(float(d["pass"]) for d, _ in pairs)),
                     fmt(statistics.fmean(float(m["pass"]) for _, m in pairs)),
                     str(test.both_pass), str(test.critical), str(test.reverse),
                     str(test.both_fail), fmt_sig(test.p_value, 2)])
    return Table(f"NIAH ({run.label}, context {run.context('niah')}; Table 10)",
                 ["method", "trials", "dense acc", "method acc", "dense pass", "method pass",
                  "both pass", "dense only", "method only", "both fail", "p"], rows,
                 "acc: fraction of needles retrieved; pass: all needles of a trial retrieved. "
                 "dense only = critical failures; method only = reverse discordant pairs.",
                 {"p": "McNemar p-value"})


def _triple(q: dict) -> str:
    """``median/p95/max`` in short scientific notation: ``4.9e-3/6.8e-3/1.2e-1``."""
    return "/".join(fmt_sci(q[k]) for k in ("median", "p95", "max"))


def certificate_table(run: RunData) -> Table | None:
    """Tables 11-12: the bounds each method returned (and the candidates before the ladder)."""
    rows = []
    for v in run.variants:
        cert = certificate_summary(run.certificate_records(v))
        if not cert.get("steps"):
            continue
        rows.append([v, _triple(cert["e_key"]), _triple(cert["e_val"]),
                     _triple(cert["e_arith"]), _triple(cert["candidate_e_key"]),
                     _triple(cert["candidate_e_val"]), _triple(cert["paper_e_key"]),
                     _triple(cert["paper_e_val"])])
    if not rows:
        return None
    return Table(f"Certificates ({run.label}; Tables 11-12)",
                 ["method", "E_key", "E_val", "E_arith", "cand. E_key", "cand. E_val",
                  "paper E_key", "paper E_val"],
                 rows, "Each cell: median/p95 of the per-step mean over every layer and head, "
                 "and the max over every head-step. Returned: what the output carries (dense "
                 "heads: E_arith alone).",
                 {"cand.": "candidate, the tight terms before the ladder",
                  "paper": "the paper's eq. 15 and Cor. 4.2 for the same candidates "
                  "(telemetry)"})


def median_step_ms(run: RunData, variant: str) -> float:
    """Median decode-step time of ``variant`` over the samples that decoded (NaN if none)."""
    ms = [r["ms_per_step"] for r in run.samples if r["variant"] == variant
          and r.get("decode_steps")]
    return statistics.median(ms) if ms else float("nan")


def batch_sizes(run: RunData, variant: str) -> str:
    """The batch sizes ``variant``'s records were decoded at (``1``, ``4``, ``1,4`` for a run
    resumed at another size; records made before batches count as 1)."""
    sizes = sorted({r.get("batch_size", 1) for r in run.samples if r["variant"] == variant})
    return ",".join(map(str, sizes)) or "-"


def _pct(x: float, digits: int) -> str:
    """``x`` as a percentage to ``digits`` decimals without trailing zeros (``12.5``, ``0``)."""
    text = f"{100 * x:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _rates(values, digits: int) -> str:
    """Percentages joined by ``/``: ``0.1/12.5/87.2/0.2/0``."""
    return "/".join(_pct(x, digits) for x in values)


def runtime_table(run: RunData) -> Table:
    """Table 15 and the latency column of Table 4: rungs, checks, cache traffic, speed."""
    rows = []
    base = None
    for v in run.variants:
        ms = median_step_ms(run, v)
        base = ms if v == run.reference else base
        cert = certificate_summary(run.certificate_records(v))
        pressed = run.modes[v] == PRESS_MODE  # kvpress, answered in its own venv
        if cert.get("steps"):
            checks = [cert[f"{n}_fail_rate"] for n in ("ranking", "boundary", "canary")]
            cells = [_rates(cert["rung_rates"], 1), _rates(checks, 2),
                     f"{cert['k_star_mean']:.1f}", f"{cert['value_promotions_per_step']:.1f}",
                     f"{100 * cert['scratch_hit_rate']:.0f}",
                     f"{cert['h2d_bytes_per_step'] / 2**20:.2f}",
                     f"{cert['tier1_over_dense']:.3f}"]
        else:  # dense; another tool's cache: kvpress's kept share, hf_quantized's not counted
            kept = cert.get("tier1_over_dense") if pressed else None
            cells = ["-"] * 6 + ["1.000" if v == run.reference else fmt(kept)]
        # kvpress is timed in its own process and venv: not set against this run's dense
        ratio = ms / base if base and not pressed else float("nan")
        rows.append([v, *cells, batch_sizes(run, v), fmt(ms, 1), fmt(ratio, 2)])
    return Table(f"Ladder, cache and speed ({run.label}; Tables 4, 15)",
                 ["method", "rungs % 0/1/2/3/4", "fails % rank/bnd/can", "K*", "VP", "hit %",
                  "H2D MiB", "T1", "B", "ms/step", "x dense"], rows,
                 "Rates per head-step over every layer; dense runs the model's own cache and "
                 "SDPA (no ladder). ms/step: median decode step of the whole model, one step "
                 "of up to B sequences decoded together (task.<name>.batch_size); a "
                 "sequence's certificates are its own at any B.",
                 {"rungs": "head-steps on rungs 0-4", "fails": "ranking/boundary/canary "
                  "check failures", "K*": "mean FP16-key blocks", "VP": "value promotions per "
                  "step", "hit": "scratch hit rate", "H2D": "host-to-device MiB per step",
                  "T1": "Tier-1 bytes / dense bytes (kvpress: the share of prompt tokens "
                        "kept; -: not counted, as for transformers' own QuantizedCache)",
                  "B": "sequences per decode step", "x dense": "median step / dense's (-: "
                  "kvpress, timed in its own process and venv)"})
