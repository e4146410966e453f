"""Bridges to other tools (lm-evaluation-harness)."""
