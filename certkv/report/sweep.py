"""The aggregate of a sweep (``certkv sweep``): one row per point and method with the quality
delta to dense (95% CI), fallback rate, K*, value promotions, Tier-1 bytes, scratch traffic and
step time, as a table (console, markdown, JSON) and a figure of each against the knob.

Built from the point directories alone (finished, partial or failed), like ``certkv report``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from certkv.errors import CertKVError, require
from certkv.eval.results import RunDir
from certkv.files import write_atomic
from certkv.report.summary import certificate_summary
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
    """One point of a sweep: its label (``k_max=64``), directory, and data or failure."""

    label: str
    root: Path
    run: RunData | None
    error: str | None
    order: tuple = ()


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


def load_points(root: Path, keys: list[str]) -> list[Point]:
    """The point directories under a sweep directory, ordered by the swept values."""
    require(root.is_dir(), CertKVError,
            f"no sweep directory {root}; run `certkv sweep ...` first or pass the directory "
            "it printed.")
    points = []
    for path in sorted(p for p in root.iterdir() if p.is_dir()):
        error = RunDir.failure(path)
        has_run = (path / RunDir.SAMPLES).exists()
        if not has_run and error is None:
            continue
        config = yaml.safe_load((path / RunDir.CONFIG).read_text()) \
            if (path / RunDir.CONFIG).exists() else {}
        overrides = _overrides(path)
        values = [_lookup(config, k) if config else overrides.get(k) for k in keys]
        label = ",".join(f"{k.split('.')[-1]}={v}" for k, v in zip(keys, values, strict=True))
        points.append(Point(label, path, RunData.load(path) if has_run and not error else None,
                            error,
                            tuple(_order(v) for v in values)))
    return sorted(points, key=lambda p: p.order)


def _overrides(path: Path) -> dict[str, str]:
    """A failed point has no resolved config: its values come from Hydra's overrides file."""
    file = path / ".hydra" / "overrides.yaml"
    items = yaml.safe_load(file.read_text()) if file.exists() else []
    return dict(item.lstrip("+").split("=", 1) for item in items or [] if "=" in item)


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
    tasks = list(dict.fromkeys(t for r in rows for t in r.get("quality", {})))
    head = ["point", "method", *[f"{t} delta [95% CI]" for t in tasks], "fallback %",
            "rung 2 %", "K* mean", "value promotions/step", "Tier-1/dense", "scratch hit %",
            "H2D MiB/step", "ms/step", "x dense"]
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
                 "report`); fallback = rungs 3-4 per head-step; ms/step: median decode step.")


def sweep_figure(name: str, rows: list[dict], path: Path) -> bool:
    """Quality delta (with CIs), fallback rate, K*, value promotions, Tier-1 bytes and step
    time against the swept point, one line per method."""
    done = [r for r in rows if r["error"] is None]
    if not done:
        return False
    from certkv.report.plots import _pyplot, _save

    plt = _pyplot()
    labels = list(dict.fromkeys(r["point"] for r in rows))
    panels = [("quality delta to dense", None), ("fallback %", "fallback"),
              ("K* mean", "k_star"), ("value promotions/step", "value_promotions"),
              ("Tier-1 / dense bytes", "tier1"), ("ms/step", "ms")]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (title, field) in zip(axes.flat, panels, strict=True):
        for method in dict.fromkeys(r["method"] for r in done):
            mine = [r for r in done if r["method"] == method]
            xs = [labels.index(r["point"]) for r in mine]
            if field is None:
                for task in dict.fromkeys(t for r in mine for t in r["quality"]):
                    sel = [(x, r["quality"][task]["delta"]) for x, r in zip(xs, mine,
                                                                             strict=True)
                           if task in r["quality"]]
                    est = [d.estimate for _, d in sel]
                    err = [[max(d.estimate - d.low, 0) if d.low == d.low and abs(d.low) < 1e9
                            else 0 for _, d in sel],
                           [max(d.high - d.estimate, 0) if abs(d.high) < 1e9 else 0
                            for _, d in sel]]
                    ax.errorbar([x for x, _ in sel], est, yerr=err, marker="o", capsize=3,
                                label=f"{method} {task}")
                ax.axhline(0, color="grey", lw=0.8)
            else:
                scale = 100 if field == "fallback" else 1
                ax.plot(xs, [scale * r[field] for r in mine], marker="o", label=method)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(labels)), labels, rotation=30, fontsize=7)
        ax.legend(fontsize=6)
    fig.suptitle(f"Sweep {name}")
    fig.tight_layout()
    return _save(fig, path)


@dataclass
class SweepReport:
    name: str
    root: Path
    table: Table
    figure: Path | None
    points: int
    failed: int


def build_sweep_report(name: str, root: Path, keys: list[str], out: Path) -> SweepReport:
    """Aggregate the points under ``root`` and write ``README.md``, the figure and
    ``sweep.json`` under ``out``."""
    points = load_points(root, keys)
    require(bool(points), CertKVError,
            f"{root} holds no finished, partial or failed point yet; run the sweep first.")
    rows = [row for p in points for row in point_rows(p)]
    table = sweep_table(name, rows)
    figure = out / "figures" / f"sweep_{name}.png"
    figure.parent.mkdir(parents=True, exist_ok=True)
    try:
        drawn = sweep_figure(name, rows, figure)
    except ImportError:
        drawn = False
    report = SweepReport(name, root, table, figure if drawn else None, len(points),
                         sum(p.run is None for p in points))
    _write(report, points, out)
    return report


def _write(report: SweepReport, points: list[Point], out: Path) -> None:
    from certkv.report.document import markdown_table

    provenance = []
    for p in points:
        m = p.run.meta if p.run else {}
        state = "failed" if p.run is None else \
            f"{m.get('records', len(p.run.samples))}/{m.get('planned', '?')} records"
        provenance.append(f"* `{p.label}`: {state}; commit `{m.get('commit', '?')}`; "
                          f"{m.get('device', '?')}; `{p.root}`")
    lines = [f"# Sweep {report.name}", "", f"Points under `{report.root}`:", "", *provenance,
             "", *markdown_table(report.table)]
    if report.figure is not None:
        lines.append(f"![sweep_{report.name}]({report.figure.relative_to(out).as_posix()})")
    write_atomic(out / "README.md", "\n".join(lines) + "\n")
    write_atomic(out / "sweep.json", json.dumps({"name": report.name, "root": str(report.root),
                                                 "table": asdict(report.table)}, indent=2)
                 + "\n")
