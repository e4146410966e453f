"""Timing and its statistics for ``certkv bench``: warm-up, interleaved timed runs (CUDA-
synchronised on GPU), min / median / max, the spread check (a case whose runs disagree by more
than 20% of the median is flagged), phase breakdowns, progress bars and number formats."""

from __future__ import annotations

import math
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from certkv.attention import CertifiedAttention
from certkv.provenance import device_name, source_commit
from certkv.timing import PhaseTimer, _sync

# Peak DRAM bandwidth (GB/s) of GPUs this project is measured on; None elsewhere.
PEAK_GBPS = {"H100 80GB HBM3": 3350.0, "H100 PCIe": 2000.0, "H200": 4800.0}
RUNS_DIR = Path("runs/bench")  # default parent of each invocation's directory (cwd-relative)
SPREAD_LIMIT = 0.2  # (max - min) / median above this: the timings are not trustworthy
PHASE_RUNS = 3  # synchronised runs behind each phase breakdown
METHOD_COLORS = {"dense": "C0", "naive": "C1", "certified": "C2",
                 "certified-host": "C3"}  # one colour per method

Update = Callable[..., None]  # update(description, advance=0): progress report


def _quiet(text: str, advance: int = 0) -> None:
    """The default progress report: nothing."""


def device_info() -> dict:
    """Device name, peak bandwidth if known, and library versions."""
    import transformers

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_GBPS.items() if k in name), None)
        measured = {}
    else:
        name, peak = device_name(), None
        measured = {"copy_gbps": round(copy_gbps(), 2)}
    return {"device": name, "peak_gbps": peak, **measured, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "commit": source_commit()}


def copy_gbps(mib: int = 256, repeats: int = 5) -> float:
    """The host memory bandwidth a large copy reaches with torch's threads (a CPU has no
    known peak): bytes read plus bytes written by the fastest of ``repeats`` copies of ``mib``
    MiB, in GB/s. What a step's GB/s is compared with on a CPU."""
    src = torch.ones(mib * 2**18)  # FP32: mib MiB
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(repeats + 1):  # the first copy touches dst's pages
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best / 1e9


def _call_ms(fn) -> float:
    """Milliseconds of one (synchronised) call of ``fn()``."""
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return 1e3 * (time.perf_counter() - start)


def timings(fn, repeats: int, warmup: int = 2) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``fn()``, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return [_call_ms(fn) for _ in range(repeats)]


WARMUP = 2  # untimed rounds before the timed ones (compiles, first-touch allocations)


def interleaved_timings(fns: dict[str, Callable[[], object]], repeats: int,
                        warmup: int = WARMUP) -> dict[str, list[float]]:
    """:func:`timings` of several functions called in turn (one call of each per round, after
    ``warmup`` untimed rounds), so that a slow spell of the machine falls on every one of
    them rather than on whichever happened to run then."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_call_ms(fn))
    return times


@contextmanager
def timing_calls(owners: list[tuple], times: dict[str, list[float]]):
    """Within the block, each function ``owner.name`` of ``owners`` (``(owner, name)`` or
    ``(owner, name, label)``) appends its milliseconds per call to ``times[label]`` (default
    label ``"<owner's name>.<name>"``); a call made inside another call of the same label
    (a method that calls its sibling, a recursion) is not counted again. An inherited function
    is timed for ``owner`` and its subclasses only, and inherited again afterwards."""
    originals = [(owner, name, getattr(owner, name), rest[0] if rest else None,
                  name in vars(owner)) for owner, name, *rest in owners]
    active: set[str] = set()

    def timer(key, fn):
        def call(*args, **kwargs):
            if key in active:
                return fn(*args, **kwargs)
            active.add(key)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times.setdefault(key, []).append(1e3 * (time.perf_counter() - start))
                active.discard(key)
        return call

    try:
        for owner, name, fn, label, _ in originals:
            setattr(owner, name, timer(label or f"{owner.__name__}.{name}", fn))
        yield
    finally:
        for owner, name, fn, _, own in originals:
            if own:
                setattr(owner, name, fn)
            else:  # inherited: the subclass's lookup goes to its base again
                delattr(owner, name)


def timed(fn, repeats: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` after ``warmup`` calls."""
    return statistics.median(timings(fn, repeats, warmup))


def stats(times: list[float]) -> dict:
    """``{"min", "median", "max", "runs"}`` of a list of milliseconds (``runs``: the list)."""
    return {"min": min(times), "median": statistics.median(times), "max": max(times),
            "runs": list(times)}


def paired_ratio(runs: list[float], base: list[float]) -> float:
    """The median of ``runs[i] / base[i]``: of calls made in turn
    (:func:`interleaved_timings`), each pair ran in the same spell of the machine, so a drift
    that moves both medians (a noisy neighbour, a clock change) cancels in each ratio."""
    return statistics.median(r / b for r, b in zip(runs, base, strict=True))


def spread(s: dict) -> float:
    """How far a timing's runs disagree: (max - min) / median."""
    return (s["max"] - s["min"]) / s["median"] if s["median"] > 0 else 0.0


def spread_warning(label: str, by_method: dict[str, dict],
                   limit: float = SPREAD_LIMIT) -> str | None:
    """One warning sentence when any method's runs of case ``label`` spread more than ``limit``
    of their median (naming the worst method), else None."""
    worst = max(by_method, key=lambda m: spread(by_method[m]))  # ties: the first method
    s = by_method[worst]
    if spread(s) <= limit:
        return None
    return (f"timings of {label} spread more than {limit:.0%} ({worst}: min {short(s['min'])} / "
            f"median {short(s['median'])} / max {short(s['max'])} ms): something else used the "
            "machine or its clocks changed; rerun with more --repeats.")


def spread_warnings(records: list[dict]) -> list[str]:
    """The spread warnings of every record (``short_label`` and ``ms_stats`` per method)."""
    found = (spread_warning(r["short_label"], r["ms_stats"]) for r in records)
    return [w for w in found if w]


def phase_stats(run: Callable[[], object], attention: CertifiedAttention,
                runs: int = PHASE_RUNS) -> dict[str, dict]:
    """Per-phase :func:`stats` over ``runs`` calls of ``run()``, each timed by a fresh
    :class:`PhaseTimer` on ``attention`` (a phase absent from a run counts 0 ms there)."""
    per_run = []
    for _ in range(runs):
        timer = attention.timer = PhaseTimer()
        run()
        per_run.append(dict(timer.ms))
    names = dict.fromkeys(name for ms in per_run for name in ms)
    return {name: stats([ms.get(name, 0.0) for ms in per_run]) for name in names}


def medians(by_name: dict[str, dict]) -> dict[str, float]:
    """``{name: median}`` of a dict of :func:`stats`."""
    return {name: s["median"] for name, s in by_name.items()}


@contextmanager
def progress(total: int, description: str) -> Iterator[Update]:
    """A rich progress bar on stderr over ``total`` steps; yields ``update(text, advance=0)``,
    which sets the bar's description and advances it."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    console = Console(stderr=True)  # no bar (nor its blank line) in a log file
    with Progress(*columns, console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task(description, total=total)
        yield lambda text, advance=0: bar.update(task, description=text, advance=advance)


def short(x: float) -> str:
    """About 3 significant digits, no exponent above 1: 1,876 / 301 / 12.3 / 0.498 / 0.0123."""
    if x == 0:
        return "0"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def tokens(n: int) -> str:
    """A context length as people write it: 512, 4K, 128K."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)
