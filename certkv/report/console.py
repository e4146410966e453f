"""The ``console`` logger: a rich table of a run summary."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table


def _triple(q: dict) -> str:
    return f"{q['median']:.1e}/{q['p95']:.1e}/{q['max']:.1e}"


def summary_table(summary: dict) -> Table:
    """One row per variant: quality, certificate quantiles, rungs, K*, memory, speed."""
    table = Table(title=f"{summary['experiment']}: {summary['model']} "
                        "(E_key/E_val: median / p95 of step means, max)")
    task_names = sorted({t for v in summary["variants"].values() for t in v["tasks"]})
    columns = ["variant", "KV", *task_names, "E_key", "E_val", "rungs % 0/1/2/3/4", "K*",
               "Tier-1/dense", "ms/step", "x dense"]
    for col in columns:
        table.add_column(col, justify="left" if col == "variant" else "right")
    for name, v in summary["variants"].items():
        cert = v["certificate"]
        quality = [_quality(v["tasks"].get(t)) for t in task_names]
        rungs = "/".join(f"{100 * r:.0f}" for r in cert["rung_rates"])
        ratio = v["step_time_vs_dense"]
        table.add_row(name, "FP16" if v["mode"] == "dense" else v["quantizer"], *quality,
                      _triple(cert["e_key"]), _triple(cert["e_val"]), rungs,
                      f"{cert['k_star_mean']:.1f}",
                      "1.000" if v["mode"] == "dense" else f"{cert['tier1_over_dense']:.3f}",
                      f"{v['ms_per_step']:.0f}", "-" if ratio is None else f"{ratio:.2f}")
    return table


def _quality(entry: dict | None) -> str:
    if entry is None:
        return "-"
    if "ppl" in entry:
        return f"ppl {entry['ppl']:.3f}"
    return f"acc {entry['accuracy']:.2f} ({entry['trials']})"


@dataclass
class ConsoleLogger:
    """Prints the summary table (results are always written to the run directory)."""

    def log(self, summary: dict, run_dir: str) -> None:
        console = Console(width=None if Console().is_terminal else 160)
        console.print(summary_table(summary))
        console.print(f"results: {run_dir}")
