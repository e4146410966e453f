"""A new user's first runs (issue 52): bad input refused at once in one sentence, before any
directory exists; sweeps that say when points failed; an interrupt that says how to resume; a
partial report marked as such; help that lists what to run; progress in a log too."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

import pytest
import torch
from helpers.cli import TINY, runner
from rich.console import Console

from certkv.attention import CertifiedAttention
from certkv.cache.store import TieredKVStore
from certkv.certify.fused_cpu import AVAILABLE
from certkv.cli import app
from certkv.eval import progress
from certkv.eval.progress import RunProgress
from certkv.kernels import numba_step


def cli(*args):
    return runner.invoke(app, list(args), catch_exceptions=False)


def refused(result, *needles):
    """Exit 2 with one short message holding every needle, no traceback."""
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.splitlines()) <= 6, text
    for needle in needles:
        assert needle in text, text


@pytest.mark.parametrize(("override", "needle"), [
    ("threads=two", "threads='two' must be a positive number of CPU threads"),
    ("threads=0", "threads=0 must be a positive number of CPU threads"),
    ("seed=x", "seed='x' must be an integer"),
    ("graphs=maybe", "graphs='maybe' must be true or false"),
    ("evict=age evict.budget=2", "evict.budget=2 must be a fraction in (0, 1]"),
    ("quantizer=int9", "did you mean one of quantizer=int2_int4, quantizer=int8_fp16, "
                       "quantizer=int8_int4?"),
    ("quantizer=kivi3", "did you mean one of quantizer=kivi2, quantizer=kivi4?"),
])
def test_a_bad_run_field_is_one_sentence_before_any_directory(override, needle, tmp_path):
    refused(cli("run", *TINY, *override.split(), f"out_dir={tmp_path / 'runs'}"), needle)
    assert not (tmp_path / "runs").exists()


def test_online_wandb_without_a_key_is_refused_before_the_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    refused(cli("run", *TINY, "logger=wandb", "logger.mode=online",
                f"out_dir={tmp_path / 'runs'}"), "logger.mode=online needs a W&B API key")
    assert not (tmp_path / "runs").exists()


@pytest.mark.usefixtures("books")
def test_a_budget_no_policy_can_meet_is_refused_before_any_record(tmp_path):
    result = cli("run", *TINY, "evict=age", "evict.budget=0.1", f"out_dir={tmp_path}")
    refused(result, "evict.budget=0.1 is below what age eviction can reach",
            "use evict.budget=0.22 or more")
    assert not list(tmp_path.rglob("samples.jsonl"))  # not even the dense records


@pytest.mark.usefixtures("books")
def test_a_multirun_with_a_failed_point_exits_1_naming_it(tmp_path):
    result = cli("run", "-m", *TINY, "evict=age", "evict.budget=0.3,0.1", f"out_dir={tmp_path}")
    text = " ".join(result.output.split())
    assert result.exit_code == 1, result.output
    assert "1 sweep point(s) failed" in text and "evict.budget=0.1" in text
    assert "run the same command again" in text
    (failed,) = tmp_path.rglob("failed.json")
    assert "use evict.budget=0.22 or more" in json.loads(failed.read_text())["error"]


def test_an_interrupted_run_says_a_rerun_resumes(tmp_path, monkeypatch):
    import certkv.eval.runner

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(certkv.eval.runner, "run_experiment", interrupted)
    result = cli("run", *TINY, f"out_dir={tmp_path}")
    assert result.exit_code == 130
    assert "run the same command again to resume" in " ".join(result.output.split())


def test_run_help_lists_the_experiments_and_every_group():
    text = " ".join(cli("run", "--help").output.split())
    for needle in ("Experiments: compression_4k", "innerq_modes_4k", "tiny",
                   "quantizer: innerq", "evict: age", "certkv info"):
        assert needle in text


@pytest.mark.parametrize("command", [["report"], ["bench", "decode"], ["bench", "codecs"],
                                     ["sweep", "vtol"], ["info"], []])
def test_help_shows_what_a_user_types_not_python_types(command):
    """Values show click's names (PATH, INTEGER..., [a|b]), flags none, arguments NAME...:
    no ``<bool>``, ``<list[Path]>`` or ``{run_dirs}``."""
    text = cli(*command, "--help").output
    assert not re.search(r"<(bool|str|int|float|path|list\[\w+\])>|\{\w+\}", text), text
    if command == ["report"]:
        assert "RUN_DIR..." in text and "PATH" in text
    if command == ["bench", "decode"]:
        assert "INTEGER..." in text


def test_the_cli_answers_a_config_typo_without_loading_torch():
    code = ("import sys; from certkv.cli import app; from certkv.config import compose_config\n"
            "try: compose_config(['quantizer=int9'])\nexcept Exception: pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_progress_in_a_log_is_plain_lines_per_record_and_decode_steps():
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=False, width=100)
    with RunProgress(2, every=0.0, console=console) as shown:
        shown.start("perplexity #0 certified")
        shown.step()
        shown.step()
        shown.finish()
    lines = buffer.getvalue().splitlines()
    assert "\x1b" not in buffer.getvalue()  # no control codes in a log
    assert "0/2 records; perplexity #0 certified: 1 decode steps" in lines[0]
    assert "1/2 records; perplexity #0 certified: 2 decode steps" in lines[-1]


@pytest.mark.skipif(not AVAILABLE, reason="numba is not installed")
def test_a_run_announces_the_kernel_compile_until_the_current_kernels_are_cached(monkeypatch):
    """Silent once the CPU step's kernel is cached from these sources; announced where the
    cache holds it from other sources only (an upgrade or an edit since: numba would compile
    again), as where it holds nothing."""
    attention = CertifiedAttention()
    store = TieredKVStore(2, 16, decoded_mirror=attention.decoded_mirror(torch.device("cpu")))
    store.append(torch.randn(2, 40, 16, dtype=torch.float16),
                 torch.randn(2, 40, 16, dtype=torch.float16))
    attention(torch.randn(4, 16), store)  # runs (so compiles or loads, and caches) its kernel
    buffer = io.StringIO()
    progress.announce_compile(Console(file=buffer))
    assert buffer.getvalue() == ""
    index = numba_step._step._cache._cache_file  # its stamp: the sources at import
    own, _ = index._source_stamp
    monkeypatch.setattr(index, "_source_stamp", (own, "the sources after an edit"))
    progress.announce_compile(Console(file=buffer))
    assert "compiling the CPU kernels" in buffer.getvalue()


@pytest.mark.usefixtures("books")
def test_a_report_of_a_partial_run_says_it_is_partial(tmp_path):
    out = tmp_path / "runs"
    assert cli("run", *TINY, f"out_dir={out}").exit_code == 0
    (samples,) = out.rglob("samples.jsonl")
    first = samples.read_text().splitlines()[0]
    samples.write_text(first + "\n")  # as if interrupted after one record
    result = cli("report", str(samples.parent), "--out", str(tmp_path / "report"))
    assert result.exit_code == 0, result.output
    assert "is partial: 1 of 6 records" in " ".join(result.output.split())
    assert "**Partial.**" in (tmp_path / "report" / "README.md").read_text()


def test_lm_eval_help_names_certkvs_own_options_before_lm_evals():
    result = runner.invoke(app, ["lm-eval", "--help"])
    text = " ".join(result.output.split())
    assert "--certkv_context N" in text and "--certkv_samples N" in text
    assert text.index("--certkv_context") < text.index("--tasks")  # lm-eval's help follows
