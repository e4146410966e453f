"""Reporting: run summaries, the rich console table (and later W&B and markdown)."""
