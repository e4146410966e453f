"""Markdown rendering of a run summary (for reports/)."""

from __future__ import annotations

from certkv.eval.summary import table_rows
from certkv.provenance import source_commit


def summary_markdown(summary: dict, command: str, machine: str) -> str:
    """A markdown table with one row per variant, headed by the command, commit and machine."""
    head, rows = table_rows(summary, digits=2)
    lines = [f"# {summary['experiment']}: {summary['model']}", "",
             f"Command: `{command}`  ", f"Commit: `{source_commit()}`  ", f"Machine: {machine}", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
