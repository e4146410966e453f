"""Evaluation: corpora, tasks, metrics."""
