"""Tables as plain data, rendered to markdown and to a console of any width.

A :class:`Table` holds strings only. :func:`print_tables` fits it to the console: a cell of up
to ``WHOLE`` characters (a number, an ``a/b/c`` triple, an interval) never wraps, headers wrap
at spaces, and a table too wide is split into parts that repeat its key columns. Only rich is
needed here, so `certkv bench` can use it where the report's other dependencies are missing.
"""

from __future__ import annotations

import functools
import itertools
import os
from dataclasses import dataclass, field

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table as RichTable
from rich.text import Text


@dataclass
class Table:
    """A titled table of strings; ``note`` says how to read it, ``legend`` spells out the
    abbreviated column names, and the first ``keys`` columns name a row (a console too narrow
    for the whole table repeats them in each part it splits the table into)."""

    title: str
    head: list[str]
    rows: list[list[str]]
    note: str = ""
    legend: dict[str, str] = field(default_factory=dict)
    keys: int = 1

    def caption(self) -> str:
        """The legend (``K*: mean FP16-key blocks; ...``) followed by the note."""
        legend = "; ".join(f"{short}: {long}" for short, long in self.legend.items())
        return " ".join(x for x in (f"{legend}." if legend else "", self.note) if x)


def markdown_table(table: Table) -> list[str]:
    def cell(x: str) -> str:
        return x.replace("|", "\\|")

    return [f"## {table.title}", "", f"| {' | '.join(map(cell, table.head))} |",
            "|" + " --- |" * len(table.head),
            *[f"| {' | '.join(map(cell, row))} |" for row in table.rows], "", table.caption(),
            ""]


PIPED_WIDTH = 100  # the console's width when stdout is not a terminal (a pipe, a file)
WHOLE = 32  # a cell up to this long never wraps; a longer one (a message) wraps at spaces
GAP = 2  # columns between two cells: one divider and one (collapsed) padding


def make_console() -> Console:
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
    console = console or make_console()
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
