"""``certkv bench``: decode-step timings, dense vs naive vs certified, in one process.

One module per benchmark (:mod:`~certkv.bench.attention`, :mod:`~certkv.bench.decode`), with
the timing and its statistics (:mod:`~certkv.bench.measure`), the tables and report directory
(:mod:`~certkv.bench.tables`) and the figures (:mod:`~certkv.bench.plots`) they share; the
names below are the package's API, as ``certkv bench`` and the tests use it.

* ``attention``: one decode step of one layer for each context length, head dim and GQA ratio:
  dense FP16 SDPA on a resident FP16 cache (the production baseline), naive quantized, and
  certified with each phase timed; achieved GB/s (bytes each method must read / time), and
  memory per tier.
* ``decode``: one whole-model decode step (the model's own weights on a book's text where they
  are installed, else random) for a model at several contexts, dense vs certified, one step of
  each in turn, with the phase breakdown of the paper's Table 16 (attention phases summed over
  layers; the rest is non-attention work).

Timing: warm-up, then ``repeats`` timed runs (CUDA-synchronised on GPU), reported as min /
median / max; a case whose runs disagree by more than 20% of the median is flagged (the machine
was busy). Each invocation writes markdown + JSON + a plot, with the device, versions and
command, to a new ``runs/bench/<name>-<YYYYmmdd-HHMMSS>/`` (or to ``--out DIR``).
"""

from __future__ import annotations

from certkv.bench.attention import (
    LAUNCH_METHODS,
    LAUNCH_NOTES,
    LAUNCH_SHAPES,
    AttentionCase,
    bench_attention_case,
    bench_launches_case,
    default_cases,
    launch_notes,
    tuning_notes,
)
from certkv.bench.decode import (
    MODEL_CONFIGS,
    WEIGHTS,
    bench_decode,
    decode_notes,
    decode_tables,
    model_spec,
    offline_weights,
    plot_decode,
)
from certkv.bench.measure import (
    METHOD_COLORS,
    PEAK_GBPS,
    PHASE_RUNS,
    Update,
    device_info,
    interleaved_timings,
    paired_ratio,
    progress,
    short,
    spread_warning,
    spread_warnings,
    stats,
    timed,
    timings,
    tokens,
)
from certkv.bench.plots import plot_attention, plot_launches
from certkv.bench.tables import (
    BenchReport,
    attention_notes,
    attention_tables,
    cpu_target_table,
    dispatch_tables,
    markdown,
    result_table,
    show,
    target_lines,
)

__all__ = [
    "LAUNCH_METHODS",
    "LAUNCH_NOTES",
    "LAUNCH_SHAPES",
    "METHOD_COLORS",
    "MODEL_CONFIGS",
    "PEAK_GBPS",
    "PHASE_RUNS",
    "WEIGHTS",
    "AttentionCase",
    "BenchReport",
    "Update",
    "attention_notes",
    "attention_tables",
    "bench_attention_case",
    "bench_decode",
    "bench_launches_case",
    "cpu_target_table",
    "decode_notes",
    "decode_tables",
    "default_cases",
    "device_info",
    "dispatch_tables",
    "interleaved_timings",
    "launch_notes",
    "markdown",
    "model_spec",
    "offline_weights",
    "paired_ratio",
    "plot_attention",
    "plot_decode",
    "plot_launches",
    "progress",
    "result_table",
    "short",
    "show",
    "spread_warning",
    "spread_warnings",
    "stats",
    "target_lines",
    "timed",
    "timings",
    "tokens",
    "tuning_notes",
]
