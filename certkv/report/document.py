"""A report of one or more run directories: the paper's tables, figures and provenance,
rendered to the console and to ``README.md`` (with ``figures/*.png`` and ``report.json``).

Built from the run directories alone, so any run, finished or partial, can be re-rendered
(``certkv report RUN_DIR ...``); ``certkv run`` writes one into its run directory when it ends.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.text import Text

from certkv.files import write_atomic
from certkv.report import evict, faults, plots, tables
from certkv.report.layout import Table, make_console, markdown_table, print_tables
from certkv.report.tables import RunData


@dataclass
class Report:
    title: str
    runs: list[RunData]
    tables: list[Table]

    def run_dirs(self) -> list[str]:
        """The run directories, absolute and sorted (what identifies a report's content)."""
        return sorted(str(Path(r.root).resolve()) for r in self.runs)

    def provenance(self) -> list[str]:
        """One line per run: what ran, where, with which code, how long."""
        lines = []
        for run in self.runs:
            m = run.meta
            done = f"{m.get('records', len(run.samples))}/{m.get('planned', '?')} records"
            wall = f", wall time {m['wall_s'] / 60:.1f} min" if "wall_s" in m else ""
            lines.append(
                f"`{run.label}` ({run.model}): `{m.get('command', '?')}`; "
                f"{_environment(m)}; seed {m.get('seed', '?')}; {done}{wall}; "
                f"run directory `{run.root}`")
        return lines


    def partial(self) -> list[str]:
        """One sentence per run holding fewer records than it planned (interrupted, or still
        running): its tables cover only what is recorded."""
        lines = []
        for run in self.runs:
            planned, done = run.meta.get("planned"), len(run.samples)
            if planned and done < planned:
                lines.append(f"`{run.label}` is partial: {done} of {planned} records, and its "
                             "tables cover only those; its command (below) resumes it.")
        return lines


def _environment(meta: dict) -> str:
    """Commit, machine, threads and versions; a run resumed in another environment lists each
    session's with the record it started at."""
    sessions = meta.get("sessions") or [meta]

    def one(m: dict) -> str:
        return (f"commit `{m.get('commit', '?')}`; {m.get('device', '?')}, "
                f"{m.get('threads', '?')} threads; torch {m.get('torch', '?')}, transformers "
                f"{m.get('transformers', '?')}")
    if len(sessions) == 1:
        return one(sessions[0])
    return "; then ".join(f"records {s['from_record']}+: {one(s)}" for s in sessions)


def slug(text: str) -> str:
    """``tiny [seed=1] #2`` -> ``tiny_seed=1_2``: a label as a file or directory name."""
    return "_".join("".join(c if c.isalnum() or c in "=.-+" else " " for c in text).split())


def build_report(paths: list[str | Path]) -> Report:
    """The tables of the run directories ``paths`` (Tables 3-5, 6-8, 10-12, 15 as they apply)."""
    runs = [RunData.load(p) for p in paths]
    tables.label_runs(runs)
    found: list[Table | None] = [tables.quality_table(runs)]
    for run in runs:
        found += [tables.perplexity_table(run) if "perplexity" in run.tasks else None,
                  tables.ruler_table(run), tables.niah_table(run),
                  tables.certificate_table(run), tables.runtime_table(run),
                  faults.faults_table(run), evict.evict_table(run)]
    title = ", ".join(dict.fromkeys(f"{r.label}: {r.model}" for r in runs))
    return Report(title, runs, [t for t in found if t is not None and t.rows])


def markdown_lines(report: Report) -> list[str]:
    """The README's text before its figures: title, partial-run notes, provenance, tables
    (what ``tests/report/test_committed_reports.py`` recomputes from committed raw records)."""
    partial = [f"> **Partial.** {line}" for line in report.partial()]
    lines = [f"# {report.title}", "", *partial, *([""] if partial else []),
             *[f"* {line}" for line in report.provenance()], ""]
    for table in report.tables:
        lines += markdown_table(table)
    return lines


def write_report(report: Report, out_dir: str | Path) -> Path:
    """Write ``README.md``, ``figures/*.png`` and ``report.json`` under ``out_dir``; returns
    the README's path. Figures need matplotlib (skipped, and said so, without it)."""
    out = Path(out_dir)
    lines = markdown_lines(report)
    figures = []
    try:
        for run in report.runs:
            for name, draw in {**plots.FIGURES, "faults": faults.perplexity_vs_rate,
                                "evict": evict.quality_vs_budget,
                                "frontier": evict.frontier}.items():
                path = out / "figures" / f"{slug(run.label)}_{name}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                if draw(run, path):
                    figures.append(path.relative_to(out))
    except ImportError:
        lines.append("(figures skipped: matplotlib is not installed)")
    lines += [f"![{f.stem}]({f.as_posix()})" for f in figures]
    write_atomic(out / "README.md", "\n".join(lines) + "\n")
    write_atomic(out / "report.json", json.dumps(
        {"title": report.title, "runs": [os.path.relpath(r, out.resolve())
                                          for r in report.run_dirs()],  # portable: relative
         "provenance": report.provenance(),
         "tables": [asdict(t) for t in report.tables]}, indent=2) + "\n")
    return out / "README.md"


def holds_other_report(out_dir: str | Path, report: Report) -> bool:
    """Whether ``out_dir`` already holds a report of other run directories (re-rendering the
    same runs' report refreshes it; anything else would be lost by writing there)."""
    out = Path(out_dir)
    if not (out / "README.md").exists() and not (out / "report.json").exists():
        return False
    try:
        earlier = json.loads((out / "report.json").read_text())
    except (OSError, ValueError):
        return True
    if earlier.get("runs"):  # relative to the report (absolute in older reports)
        runs = [(out / r).resolve() for r in earlier["runs"]]
    else:  # older still: the provenance's run directories, relative to where it was run
        runs = [Path(r).resolve() for r in re.findall(r"run directory `([^`]*)`",
                                                      " ".join(earlier.get("provenance", [])))]
    return sorted(str(r) for r in runs) != report.run_dirs()


def print_report(report: Report, console: Console | None = None) -> None:
    """The tables on the console, each fitted to its width (see :func:`print_tables`)."""
    console = console or make_console()
    console.print(Text(report.title, style="bold"))
    for line in report.partial():
        console.print(f"[bold yellow]partial:[/] {line.replace('(below)', '(in README.md)')}",
                      highlight=False)
    print_tables(report.tables, console)
