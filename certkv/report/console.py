"""The ``console`` logger: the run's report on the console."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console


@dataclass
class ConsoleLogger:
    """Prints the run's report (results and the report are always written to the run
    directory)."""

    def log(self, report, summary: dict, run_dir: str, brief: bool = False) -> None:
        """The whole report, or with ``brief`` (a sweep point, whose sweep ends with its own
        table) its first table (quality against dense) only."""
        from dataclasses import replace

        from certkv.report.document import print_report

        print_report(replace(report, tables=report.tables[:1]) if brief else report)
        where = f"{run_dir}/README.md" if brief else run_dir
        Console().print(f"{'full report' if brief else 'results and report'}: {where}",
                        soft_wrap=True)
