"""What a run shows while it works: records done and decode steps, in a terminal or a log.

In a terminal, rich bars: the run's records (samples x methods) and the decode steps of the
record in progress, so a 64-step perplexity record moves too. Written to a log (CI, ``tee``,
``nohup``), a plain line at most every ``every`` seconds and one per finished record, never
the bars' control codes. Before the first certified step on a CPU whose numba kernels are not
compiled yet, one line says that the first run compiles them.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def kernels_compiled() -> bool:
    """Whether numba's cache holds the CPU step's kernel compiled from the current sources (a
    first run in a fresh checkout, or after an upgrade or an edit of any certkv file, compiles
    them: about a minute on two cores, then cached)."""
    from certkv.certify.numba_cache import is_cached
    from certkv.kernels import numba_step

    return is_cached(numba_step._step)


def announce_compile(console: Console | None = None) -> None:
    """Say, before the first step, that this run compiles the CPU kernels (when it will)."""
    from certkv.certify.fused_cpu import AVAILABLE

    if AVAILABLE and not kernels_compiled():
        (console or Console(stderr=True)).print(
            "first run in this checkout: compiling the CPU kernels (numba) during the first "
            "certified steps, about a minute on two cores; later runs reuse them.",
            highlight=False, soft_wrap=True)


class RunProgress:
    """Progress of ``total`` records (module docstring). ``enabled=False`` shows nothing."""

    def __init__(self, total: int, enabled: bool = True, every: float = 30.0,
                 console: Console | None = None) -> None:
        self.total, self.enabled, self.every = total, enabled, every
        self.console = console or Console(file=sys.stdout)
        self.done, self.steps, self.description = 0, 0, ""
        self._started = self._shown = time.monotonic()
        self._bar: Progress | None = None
        if enabled and self.console.is_terminal:
            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"),
                                 TimeRemainingColumn(), console=self.console)
            self._records = self._bar.add_task("samples x methods", total=total)
            self._steps = self._bar.add_task("decode steps", total=None)

    def __enter__(self) -> RunProgress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def skip(self, n: int) -> None:
        """``n`` records were done before (a resumed run)."""
        self.done += n
        if self._bar is not None:
            self._bar.advance(self._records, n)

    def start(self, description: str) -> None:
        """A record begins (``task #sample method``)."""
        self.description, self.steps = description, 0
        if self._bar is not None:
            self._bar.update(self._records, description=description)
            self._bar.reset(self._steps, total=None, description="decode steps")

    def step(self) -> None:
        """One decode step of the record in progress."""
        self.steps += 1
        if self._bar is not None:
            self._bar.update(self._steps, advance=1, description=f"decode step {self.steps}")
        elif self.enabled and time.monotonic() - self._shown >= self.every:
            self._line()

    def finish(self) -> None:
        """The record in progress is recorded."""
        self.done += 1
        if self._bar is not None:
            self._bar.advance(self._records)
        elif self.enabled:
            self._line()

    def _line(self) -> None:
        self._shown = time.monotonic()
        elapsed = int(self._shown - self._started)
        self.console.print(f"[{elapsed // 60}:{elapsed % 60:02d}] {self.done}/{self.total} "
                           f"records; {self.description}: {self.steps} decode steps",
                           highlight=False, soft_wrap=True, markup=False)
