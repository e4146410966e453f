"""What ``certkv bench`` writes: the report directory (markdown + JSON + plot, with the device,
versions and command) and its console and markdown tables."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from certkv.bench.measure import PHASE_RUNS, RUNS_DIR, device_info, short, spread_warnings
from certkv.errors import CertKVError
from certkv.files import fresh_dir, writable_dir, write_atomic
from certkv.report.layout import Table, make_console, markdown_table, print_tables


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
                f"Device: {self.info['device']} (peak {self.info['peak_gbps'] or 'n/a'} GB/s"
                f"{_copied(self.info)}); "
                f"torch {self.info['torch']}, transformers {self.info['transformers']}", "",
                f"![{self.name}]({self.name}.png)", ""]
        try:
            plot(folder / f"{self.name}.png")
        except ImportError:  # matplotlib is absent on some lent GPU machines: keep the numbers
            head[-2] = "(plot skipped: matplotlib is not installed)"
        write_atomic(folder / f"{self.name}.md", "\n".join(head + table) + "\n")
        return folder / f"{self.name}.md"


def provenance(command: str, info: dict, copy: bool = False, threads: bool = False,
               extra: str = "") -> list[str]:
    """The Command, Commit and Device lines a script's markdown report opens with (markdown
    line breaks): ``info`` as :func:`~certkv.bench.measure.device_info` gives it (with its
    ``commit``); ``copy``: the measured copy bandwidth beside the device; ``threads``: torch's
    thread count beside its version; ``extra``: appended to the Device line."""
    device = info["device"] + (f" (copy {info.get('copy_gbps', 'n/a')} GB/s measured)"
                               if copy else "")
    versions = f"torch {info['torch']}" + (f", {torch.get_num_threads()} threads"
                                           if threads else "")
    return [f"Command: `{command}`  ", f"Commit: `{info['commit']}`  ",
            f"Device: {device}; {versions}{extra}"]


def _copied(info: dict) -> str:
    """The header's measured copy bandwidth (:func:`~certkv.bench.measure.copy_gbps`), where
    the report has one."""
    return f"; copy {info['copy_gbps']} GB/s measured" if info.get("copy_gbps") else ""


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
    """Min / median / max step time per case and method, the ratio to dense, (steps timed in
    turn with dense's) the median of the steps' ratios and (attention) achieved GB/s."""
    runs = len(records[0]["ms_stats"]["dense"]["runs"]) if records else 0
    columns = [key, ("method", ""), ("min", ""), ("med", "median"), ("max", ""),
               ("×dense", "median / dense median")]
    paired = bool(records) and "paired" in records[0]
    if paired:
        columns.append(("paired", "median of each step / the dense step timed beside it"))
    gbps = bool(records) and "gbps" in records[0]
    if gbps:
        columns.append(("GB/s", "bytes the method must read / median time"))
    table = result_table(f"{what}: step time, ms ({runs} timed runs after 2 warm-up calls)",
                         columns, keys=2)
    for r in records:
        for method, s in r["ms_stats"].items():
            row = [r["short_label"], method, short(s["min"]), short(s["median"]),
                   short(s["max"]), short(s["median"] / r["ms"]["dense"])]
            row += [short(r["paired"][method])] if paired else []
            table.rows.append(row + ([short(r["gbps"][method])] if gbps else []))
    return table


CASE = ("case", "N context, d head dim, G:1 query heads per kv head")


def attention_tables(records: list[dict], peak_gbps: float | None = None,
                     copy_gbps: float | None = None) -> list[Table]:
    """The console's and the report's tables: step times, certified phases, per-case
    certified figures, and the targets: the GPU's with a known peak, the CPU's (issue 55)
    with a measured copy bandwidth ``copy_gbps``."""
    phases = result_table(f"Certified step by phase, ms (median of {PHASE_RUNS} synchronised runs)",
                         [CASE, *((h, m) for h, _, m in PHASES)])
    for r in records:
        phases.rows.append([r["short_label"],
                            *(short(r["phases_ms"].get(p, 0.0)) for _, p, _ in PHASES)])
    summary = result_table("Certified step per case", [
        CASE, ("ph2/d", "phase 2 / dense step"), ("ph2 GB/s", "phase 2 bytes / phase 2 time"),
        *([("% peak", "phase 2 GB/s / the device's peak")] if peak_gbps else []),
        *([("% copy", "phase 2 GB/s / the measured copy bandwidth")] if copy_gbps else []),
        ("chk %", "checks' share of the step"), ("K*", "mean FP16-key blocks per head"),
        ("T1/d", "Tier-1 bytes / dense FP16 bytes"),
        ("mir/d", "decoded mirror bytes (a CPU speed aid) / dense FP16 bytes")])
    for r in records:
        p2, mem = r["phase2"], r["memory_bytes"]
        summary.rows.append([r["short_label"], short(p2["ratio_vs_dense"]), short(p2["gbps"]),
                             *([f"{100 * p2['gbps'] / peak_gbps:.0f}"] if peak_gbps else []),
                             *([f"{100 * p2['gbps'] / copy_gbps:.0f}"] if copy_gbps else []),
                             short(100 * r["checks_share"]), short(r["k_star_mean"]),
                             short(mem["tier1"] / mem["dense"]),
                             short(mem.get("workspace", 0) / mem["dense"])])
    tables = [step_table(records, "One layer", CASE), phases, summary,
              *dispatch_tables(records)]
    target = target_table(records, peak_gbps)
    cpu = cpu_target_table(records, copy_gbps) if copy_gbps else None
    return tables + [t for t in (target, cpu) if t and t.rows]


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


CPU_TARGET = (16384, 128, 4, 0.8)  # issue 55: N >= 16K, d = 128, 4:1 (32q/8kv): <= 0.8x dense


def cpu_target_table(records: list[dict], copy_gbps: float) -> Table:
    """Issue 55's CPU target for one layer step (certified <= 0.8x dense at 16K and beyond,
    d = 128, 32 query / 8 kv heads), with the bytes each method reads per second as a share
    of the measured copy bandwidth."""
    least, head_dim, group, limit = CPU_TARGET
    table = result_table("CPU targets (one layer step)", [
        ("target", ""), ("case", ""), ("measured", ""), ("met", ""),
        ("dense % copy", "dense GB/s / the measured copy bandwidth"),
        ("cert % copy", "certified GB/s / the measured copy bandwidth")], keys=2)
    for r in records:
        case = r["case"]
        if (case["head_dim"], case["group"]) != (head_dim, group) or case["context"] < least:
            continue
        ratio = r["ratio_vs_dense"]["certified"]
        table.rows.append([f"step <= {limit}x dense", r.get("short_label", r["label"]),
                           f"{ratio:.2f}x", "yes" if ratio <= limit else "no",
                           *(f"{100 * r['gbps'][m] / copy_gbps:.0f}"
                             for m in ("dense", "certified"))])
    return table


def target_lines(records: list[dict], peak_gbps: float | None) -> list[str]:
    """The targets as markdown table lines, or one sentence when there is no known peak."""
    table = target_table(records, peak_gbps)
    if table is None:
        return ["Targets (Phase 2 <= 0.75x dense at >= 60% of peak; whole step at 64K <= 1.5x "
                "dense, checks <= 5% of it) apply to the GPU kernels; this device has no known "
                "peak bandwidth, so they are not evaluated here."]
    return markdown_table(table)[2:]


def share_rows(parts: list[tuple], columns: list[dict], labels: list[str], total,
               digits: int = 3) -> list[str]:
    """A markdown table of where time goes: a row per part ``(name, value(column) -> ms)``, for
    each column (a profile's record, headed ``labels[i]``) its milliseconds and its share of
    ``total(column)`` in percent (the profiling scripts' reports)."""
    head = " | ".join(f"{label}: ms | %" for label in labels)
    lines = [f"| part | {head} |", "| --- |" + " --- | --- |" * len(columns)]
    for name, value in parts:
        cells = " | ".join(f"{value(c):.{digits}f} | {100 * value(c) / total(c):.0f}"
                           for c in columns)
        lines.append(f"| {name} | {cells} |")
    return lines
