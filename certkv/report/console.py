"""The ``console`` logger: the run's report on the console."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console


@dataclass
class ConsoleLogger:
    """Prints the run's report (results and the report are always written to the run
    directory)."""

    def log(self, report, summary: dict, run_dir: str) -> None:
        from certkv.report.document import print_report

        print_report(report)
        Console().print(f"results and report: {run_dir}")
