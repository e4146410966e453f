"""The ``console`` logger: a rich table of a run summary."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from certkv.report.summary import table_rows


def summary_table(summary: dict) -> Table:
    """One row per variant: quality, certificate quantiles, rungs, K*, memory, speed."""
    table = Table(title=f"{summary['experiment']}: {summary['model']} "
                        "(E_key / E_val: median and p95 of step means, max)")
    head, rows = table_rows(summary)
    for col in head:
        table.add_column(col, justify="left" if col == "variant" else "right")
    for row in rows:
        table.add_row(*row)
    return table


@dataclass
class ConsoleLogger:
    """Prints the summary table (results are always written to the run directory)."""

    def log(self, summary: dict, run_dir: str) -> None:
        console = Console(width=None if Console().is_terminal else 160)
        console.print(summary_table(summary))
        console.print(f"results: {run_dir}")
