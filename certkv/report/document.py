"""A report of one or more run directories: the paper's tables, figures and provenance,
rendered to the console and to ``README.md`` (with ``figures/*.png`` and ``report.json``).

Built from the run directories alone, so any run, finished or partial, can be re-rendered
(``certkv report RUN_DIR ...``); ``certkv run`` writes one into its run directory when it ends.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table as RichTable
from rich.text import Text

from certkv.files import write_atomic
from certkv.report import plots, tables
from certkv.report.tables import RunData, Table


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
                  tables.certificate_table(run), tables.runtime_table(run)]
    title = ", ".join(dict.fromkeys(f"{r.label}: {r.model}" for r in runs))
    return Report(title, runs, [t for t in found if t is not None and t.rows])


def markdown_table(table: Table) -> list[str]:
    def cell(x: str) -> str:
        return x.replace("|", "\\|")

    return [f"## {table.title}", "", f"| {' | '.join(map(cell, table.head))} |",
            "|" + " --- |" * len(table.head),
            *[f"| {' | '.join(map(cell, row))} |" for row in table.rows], "", table.caption(),
            ""]


def write_report(report: Report, out_dir: str | Path) -> Path:
    """Write ``README.md``, ``figures/*.png`` and ``report.json`` under ``out_dir``; returns
    the README's path. Figures need matplotlib (skipped, and said so, without it)."""
    out = Path(out_dir)
    lines = [f"# {report.title}", "", *[f"* {line}" for line in report.provenance()], ""]
    for table in report.tables:
        lines += markdown_table(table)
    figures = []
    try:
        for run in report.runs:
            for name, draw in plots.FIGURES.items():
                path = out / "figures" / f"{slug(run.label)}_{name}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                if draw(run, path):
                    figures.append(path.relative_to(out))
    except ImportError:
        lines.append("(figures skipped: matplotlib is not installed)")
    lines += [f"![{f.stem}]({f.as_posix()})" for f in figures]
    write_atomic(out / "README.md", "\n".join(lines) + "\n")
    write_atomic(out / "report.json", json.dumps(
        {"title": report.title, "runs": report.run_dirs(), "provenance": report.provenance(),
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
    runs = earlier.get("runs") or re.findall(r"run directory `([^`]*)`",
                                             " ".join(earlier.get("provenance", [])))
    return sorted(str(Path(r).resolve()) for r in runs) != report.run_dirs()


def free_dir(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3`` ... whichever does not exist yet."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


PIPED_WIDTH = 100  # the console's width when stdout is not a terminal (a pipe, a file)
WHOLE = 32  # a cell up to this long never wraps; a longer one (a message) wraps at spaces
GAP = 2  # columns between two cells: one divider and one (collapsed) padding


def print_report(report: Report, console: Console | None = None) -> None:
    """The tables on the console, each fitted to its width (see :func:`print_tables`)."""
    console = console or _console()
    console.print(Text(report.title, style="bold"))
    print_tables(report.tables, console)


def _console() -> Console:
    """A console as wide as the terminal, or ``PIPED_WIDTH`` when piped (``COLUMNS`` sets the
    width either way)."""
    if Console().is_terminal or os.environ.get("COLUMNS", "").isdigit():
        return Console()
    return Console(width=PIPED_WIDTH)


def print_tables(tables: list[Table], console: Console | None = None) -> None:
    """Print ``tables`` within the console's width: no cell of up to ``WHOLE`` characters (a
    number, an ``a/b/c`` triple, an interval) ever wraps, headers wrap at spaces, and a table
    too wide is split into parts that each repeat its key columns; the legend and the note
    follow the last part."""
    console = console or _console()
    for table in tables:
        parts = fit_columns(table, console.width)
        for k, (columns, widths) in enumerate(parts, 1):
            part = "" if len(parts) == 1 else f", part {k}/{len(parts)}"
            console.print(Text(table.title + part, style="bold"))
            console.print(_rich_table(table, columns, widths))
        if table.caption():
            console.print(Text(table.caption(), style="dim"))
        console.print()


def _rich_table(table: Table, columns: list[int], widths: list[int]) -> RichTable:
    """The ``columns`` of ``table`` at the given widths (key columns left, numbers right);
    cells are plain text (``[no CI: n=1]`` is not console markup)."""
    rich = RichTable(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                     collapse_padding=True)
    for i, width in zip(columns, widths, strict=True):
        rich.add_column(Text(table.head[i]), justify="left" if i < table.keys else "right",
                        width=width, overflow="fold")
    for row in table.rows:
        rich.add_row(*[Text(row[i] if i < len(row) else "") for i in columns])
    return rich


def _cell_width(cell: str) -> int:
    """Columns a cell needs: all of it up to ``WHOLE`` characters, else its longest word."""
    if cell_len(cell) <= WHOLE:
        return cell_len(cell)
    return max(map(cell_len, cell.split()), default=0)


def column_widths(table: Table) -> tuple[list[int], list[int]]:
    """Per column, the narrowest width that breaks no cell and no header word, and the width
    that shows the header and every cell on one line."""
    narrow, wide = [], []
    for i, head in enumerate(table.head):
        cells = [row[i] for row in table.rows if i < len(row)]
        narrow.append(max([_cell_width(c) for c in cells] + [cell_len(w) for w in head.split()]
                          + [1]))
        wide.append(max([narrow[-1], cell_len(head)] + [cell_len(c) for c in cells]))
    return narrow, wide


def fit_columns(table: Table, width: int) -> list[tuple[list[int], list[int]]]:
    """Split ``table`` into parts no wider than ``width``: each part's column indices (the key
    columns first) and widths. The fewest parts, the others' columns spread evenly over them;
    room left over widens columns whose header would wrap."""
    narrow, wide = column_widths(table)
    keys = list(range(min(table.keys, len(narrow))))
    rest = list(range(len(keys), len(narrow)))
    budget = width + GAP - sum(narrow[i] + GAP for i in keys)
    groups = _balanced_groups([narrow[i] + GAP for i in rest], budget)
    parts = []
    for group in groups:
        columns = keys + [rest[j] for j in group]
        widths = [narrow[i] for i in columns]
        room = width - sum(widths) - GAP * (len(columns) - 1)
        for k in sorted(range(len(columns)), key=lambda k: wide[columns[k]] - widths[k]):
            grow = max(0, min(room, wide[columns[k]] - widths[k]))
            widths[k] += grow
            room -= grow
        parts.append((columns, widths))
    return parts


def _balanced_groups(costs: list[int], budget: int) -> list[list[int]]:
    """Consecutive groups of the indices of ``costs`` whose sums stay within ``budget``: as
    few groups as possible, and among those the one whose largest sum is smallest."""
    if not costs:
        return [[]]
    prefix = [0, *itertools.accumulate(costs)]
    n = len(costs)

    @functools.cache
    def best(start: int, groups: int) -> tuple[int, tuple[int, ...]]:
        """(largest sum, group ends) of the best split of ``costs[start:]``."""
        if groups == 1:
            return prefix[n] - prefix[start], (n,)
        return min((max(prefix[end] - prefix[start], best(end, groups - 1)[0]),
                    (end, *best(end, groups - 1)[1]))
                   for end in range(start + 1, n - groups + 2))

    fewest = next(g for g in range(1, n + 1) if best(0, g)[0] <= budget or g == n)
    bounds = [0, *best(0, fewest)[1]]
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
