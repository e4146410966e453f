"""The aggregate of a sweep (``certkv sweep``): one row per point and method with the quality
delta to dense (95% CI), fallback rate, K*, value promotions, Tier-1 bytes, scratch traffic and
step time, as a table (console, markdown, JSON) and a figure of each against the knob.

Built from the point directories alone (finished, partial or failed), like ``certkv report``.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from certkv.errors import CertKVError, require
from certkv.eval.results import RunDir
from certkv.eval.summary import certificate_summary
from certkv.files import write_atomic
from certkv.report.tables import (
    RunData,
    Table,
    fmt,
    fmt_interval,
    median_step_ms,
    quality_delta,
)


@dataclass
class Point:
    """One point of a sweep: its label (the swept values, ``k_max=64``), all its overrides,
    its directory, and its data or failure (``error``; a point with neither ran no job)."""

    label: str
    root: Path
    run: RunData | None
    error: str | None
    order: tuple = ()
    overrides: tuple[str, ...] = ()


def _lookup(config: dict, key: str):
    node = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _order(value) -> tuple:
    """Numbers in numeric order, anything else after them as text."""
    try:
        return (0, float(value), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(value))


def _normal(items) -> frozenset:
    """Overrides as a set of ``(key, value)`` that ignores how a value was written
    (``0.10`` = ``0.1``) and the overrides that do not name a run directory (logger ...)."""
    from certkv.config import names_run_dir, override_key

    out = set()
    for item in items:
        if "=" in item and names_run_dir(item):
            value = item.partition("=")[2]
            with contextlib.suppress(yaml.YAMLError):
                value = yaml.safe_load(value)
            out.add((override_key(item), json.dumps(value, sort_keys=True, default=str)))
    return frozenset(out)


def load_points(root: Path, keys: list[str], wanted: list[list[str]]) -> list[Point]:
    """The points ``wanted`` (each a list of overrides: the sweep command's own and one value
    per swept key) under a sweep directory, ordered by the swept values. Directories of other
    grids or other overrides under ``root`` are left out; a wanted point without a directory is
    reported as not run."""
    require(root.is_dir(), CertKVError,
            f"no sweep directory {root}; run `certkv sweep ...` first or pass the directory "
            "it printed.")
    found = {_normal(_overrides_file(p)): p for p in sorted(root.iterdir()) if p.is_dir()}
    points = []
    for items in wanted:
        given = dict(i.lstrip("+").split("=", 1) for i in items if "=" in i)
        values = [given.get(k) for k in keys]
        label = ",".join(f"{k.split('.')[-1]}={v}" for k, v in zip(keys, values, strict=True))
        path = found.get(_normal(items))
        run = error = None
        if path is None:
            error, path = "not run (no point directory; see the launcher's log)", root
        elif (error := RunDir.failure(path)) is None:
            if not (path / RunDir.SAMPLES).exists():
                error = "no record yet (the job was killed before its first sample)"
            else:
                run = RunData.load(path)
        points.append(Point(label, path, run, error, tuple(_order(v) for v in values),
                            tuple(items)))
    return sorted(points, key=lambda p: p.order)


def _overrides_file(path: Path) -> list[str]:
    """The overrides Hydra recorded for a point directory (``.hydra/overrides.yaml``)."""
    file = path / ".hydra" / "overrides.yaml"
    return list(yaml.safe_load(file.read_text()) or []) if file.exists() else []


def common_overrides(points: list[Point], keys: list[str]) -> list[str]:
    """The overrides every point shares apart from the swept keys (``seed=1``)."""
    from certkv.config import override_key

    shared = [o for o in points[0].overrides if override_key(o) not in keys] if points else []
    return [o for o in shared if all(o in p.overrides for p in points)]


def point_rows(point: Point) -> list[dict]:
    """Per non-dense method of one point: the numbers the table and the figure show."""
    if point.run is None:
        return [{"point": point.label, "method": "-", "error": point.error}]
    run, rows = point.run, []
    dense_ms = median_step_ms(run, run.reference) if run.reference else float("nan")
    for variant in run.variants:
        if variant == run.reference:
            continue
        cert = certificate_summary(run.certificate_records(variant))
        rates = cert["rung_rates"]
        quality = {t: quality_delta(run, t, variant) for t in run.tasks}
        ms = median_step_ms(run, variant)
        rows.append({"point": point.label, "method": variant, "error": None,
                     "quality": {t: q for t, q in quality.items() if q is not None},
                     "fallback": rates[3] + rates[4], "rung2": rates[2],
                     "k_star": cert["k_star_mean"],
                     "value_promotions": cert["value_promotions_per_step"],
                     "tier1": cert["tier1_over_dense"], "hit": cert["scratch_hit_rate"],
                     "h2d_mib": cert["h2d_bytes_per_step"] / 2**20, "ms": ms,
                     "x_dense": ms / dense_ms if dense_ms == dense_ms and dense_ms else
                     float("nan")})
    return rows


def sweep_table(name: str, rows: list[dict]) -> Table:
    """One row per point and method (a failed point: one row with its error); the point and
    the method are the key columns a narrow console repeats."""
    tasks = list(dict.fromkeys(t for r in rows for t in r.get("quality", {})))
    head = ["point", "method", *[f"{t} delta [95% CI]" for t in tasks], "fallback %",
            "rung 2 %", "K*", "VP", "T1", "hit %", "H2D MiB", "ms/step", "x dense"]
    body = []
    for r in rows:
        if r["error"] is not None:
            body.append([r["point"], "failed", r["error"], *[""] * (len(head) - 3)])
            continue
        cells = [fmt_interval(r["quality"][t]["delta"]) if t in r["quality"] else "-"
                 for t in tasks]
        body.append([r["point"], r["method"], *cells, f"{100 * r['fallback']:.2f}",
                     f"{100 * r['rung2']:.1f}", f"{r['k_star']:.1f}",
                     f"{r['value_promotions']:.1f}", f"{r['tier1']:.3f}",
                     f"{100 * r['hit']:.0f}", f"{r['h2d_mib']:.2f}", fmt(r["ms"], 1),
                     fmt(r["x_dense"], 2)])
    return Table(f"Sweep {name}", head, body,
                 "delta = method - dense on the same prompts of the point (CI as in `certkv "
                 "report`); fallback = rungs 3-4 per head-step; ms/step: median decode step.",
                 {"K*": "mean FP16-key blocks", "VP": "value promotions per step",
                  "T1": "Tier-1 bytes / dense bytes", "hit": "scratch hit rate",
                  "H2D": "host-to-device MiB per step"}, keys=2)


def sweep_figure(name: str, rows: list[dict], path: Path) -> bool:
    """Quality deltas (with CIs; perplexity and accuracy on panels of their own), fallback
    rate, K*, value promotions, Tier-1 bytes and step time against the swept point, one line
    per method (:func:`certkv.report.plots.sweep_panels`); False when no point finished."""
    from certkv.report.plots import _save, sweep_panels

    fig = sweep_panels(name, rows)
    return fig is not None and _save(fig, path)


@dataclass
class SweepReport:
    name: str
    root: Path
    table: Table
    figure: Path | None
    points: int
    failed: int
    common: list[str]  # overrides every point shares (besides the swept keys)


def build_sweep_report(name: str, root: Path, keys: list[str], out: Path,
                       wanted: list[list[str]]) -> SweepReport:
    """Aggregate exactly the points ``wanted`` (each its list of overrides) under ``root`` and
    write ``README.md``, the figure and ``sweep.json`` under ``out``."""
    points = load_points(root, keys, wanted)
    require(bool(points), CertKVError, "the sweep has no points; give it at least one value.")
    rows = [row for p in points for row in point_rows(p)]
    table = sweep_table(name, rows)
    figure = out / "figures" / f"sweep_{name}.png"
    figure.parent.mkdir(parents=True, exist_ok=True)
    try:
        drawn = sweep_figure(name, rows, figure)
    except ImportError:
        drawn = False
    report = SweepReport(name, root, table, figure if drawn else None, len(points),
                         sum(p.run is None for p in points), common_overrides(points, keys))
    _write(report, points, out)
    return report


def _write(report: SweepReport, points: list[Point], out: Path) -> None:
    from certkv.report.layout import markdown_table

    provenance, listed = [], []
    for p in points:
        m = p.run.meta if p.run else {}
        if p.run is None:  # nothing ran: no commit or device to state
            provenance.append(f"* `{p.label}` (`{' '.join(p.overrides)}`): failed: "
                              f"{p.error.rstrip('.')}; `{p.root}`")
        else:
            done = f"{m.get('records', len(p.run.samples))}/{m.get('planned', '?')} records"
            provenance.append(f"* `{p.label}` (`{' '.join(p.overrides)}`): {done}; commit "
                              f"`{m.get('commit', '?')}`; {m.get('device', '?')}; `{p.root}`")
        listed.append({"label": p.label, "overrides": list(p.overrides), "dir": str(p.root),
                       "error": p.error, "command": m.get("command")})
    shared = " ".join(report.common) or "none"
    lines = [f"# Sweep {report.name}", "", f"Every point also sets: `{shared}`. Points under "
             f"`{report.root}`:", "", *provenance, "", *markdown_table(report.table)]
    if report.figure is not None:
        lines.append(f"![sweep_{report.name}]({report.figure.relative_to(out).as_posix()})")
    write_atomic(out / "README.md", "\n".join(lines) + "\n")
    write_atomic(out / "sweep.json", json.dumps(
        {"name": report.name, "root": str(report.root), "common_overrides": report.common,
         "points": listed, "table": asdict(report.table)}, indent=2) + "\n")
