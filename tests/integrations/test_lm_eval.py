"""The lm-eval model `certkv` and certkv's offline lm-eval tasks, end to end on the tiny model
(no network): a generate task, a loglikelihood task and a rolling-loglikelihood task through
the certified decode path, and the dense method against lm-eval's own `hf` model."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import lm_eval
import pytest
import wandb
from lm_eval.tasks import TaskManager
from typer.testing import CliRunner

from certkv.errors import ConfigError
from certkv.integrations.lm_eval import CertKVLM
from certkv.integrations.lm_eval_tasks import TASKS, write_tasks
from certkv.models.loading import load_tokenizer

TINY = "model=tiny_random"


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, books):
    return write_tasks(tmp_path_factory.mktemp("tasks"), load_tokenizer(), context=1024,
                       samples=2, windows=2, book_tokens=48)


def evaluate(tasks, names, model_args, limit=2, log_samples=False, gen_kwargs=None,
             batch_size=1):
    return lm_eval.simple_evaluate(model="certkv", model_args=model_args, tasks=names,
                                   task_manager=TaskManager(include_path=str(tasks),
                                                            include_defaults=False),
                                   limit=limit, log_samples=log_samples, bootstrap_iters=0,
                                   gen_kwargs=gen_kwargs, batch_size=batch_size)


def certificates(run_dir):
    """The evaluation's certificate statistics: its one ``certificates_<time>.json``."""
    found = list(run_dir.glob("certificates_*.json"))
    assert len(found) == 1, found
    return json.loads(found[0].read_text())


def test_the_task_folder_holds_every_task(tasks):
    written = {p.stem for p in tasks.glob("*.yaml")}
    assert set(TASKS) | {"certkv_ruler"} == written
    rows = [json.loads(line) for line in (tasks / "certkv_ruler_vt.jsonl").read_text()
            .splitlines()]
    assert len(rows) == 2 and all(r["answers"] for r in rows)


def test_ten_needle_niah_rows_and_scoring(tasks):
    from certkv.integrations.lm_eval_tasks import process_niah

    rows = [json.loads(line) for line in (tasks / "certkv_niah.jsonl").read_text()
            .splitlines()]
    assert len(rows) == 20 and [r["needle"] for r in rows[:10]] == list(range(10))
    assert all(r["answer"] in r["input"] for r in rows)
    assert process_niah(rows[0], [f" It is {rows[0]['answer'].upper()}."]) == {"acc": 1.0}
    assert process_niah(rows[0], [" no idea"]) == {"acc": 0.0}


def test_certified_generate_loglikelihood_and_rolling_tasks(tasks, tmp_path):
    """Each score is what the task's rule gives on the model's own outputs, recomputed here
    from the logged samples: RULER's string match on the generations, the arg-max choice
    against the gold one, word perplexity from the rolling log-likelihoods."""
    run_dir = tmp_path / "run"
    out = evaluate(tasks, ["certkv_ruler_niah_single", "certkv_needle_choice", "certkv_books"],
                   f"{TINY},mode=certified,run_dir={run_dir},value_policy.v_tol=0.02",
                   log_samples=True)
    results, samples = out["results"], out["samples"]
    ruler = samples["certkv_ruler_niah_single"]
    found = [[a.lower() in s["filtered_resps"][0].lower() for a in s["doc"]["answers"]]
             for s in ruler]
    assert len(ruler) == 2 and all(s["doc"]["metric"] == "all" for s in ruler)
    assert results["certkv_ruler_niah_single"]["score,none"] == pytest.approx(
        sum(sum(f) / len(f) for f in found) / 2, abs=1e-12)
    choice = samples["certkv_needle_choice"]
    picks = [max(range(4), key=lambda i, s=s: s["filtered_resps"][i][0]) for s in choice]
    assert len(choice) == 2 and all(math.isfinite(r[0]) for s in choice
                                    for r in s["filtered_resps"])
    assert results["certkv_needle_choice"]["acc,none"] == pytest.approx(
        sum(p == s["doc"]["gold"] for p, s in zip(picks, choice, strict=True)) / 2, abs=1e-12)
    books = samples["certkv_books"]
    loglik = sum(s["filtered_resps"][0] for s in books)
    words = sum(len(re.split(r"\s+", s["doc"]["text"])) for s in books)
    assert len(books) == 2 and loglik < 0
    assert results["certkv_books"]["word_perplexity,none"] == pytest.approx(
        math.exp(-loglik / words), rel=1e-9)
    certs = certificates(run_dir)
    # 2 generations, 2 x 4 choices, 2 rolling windows: one certificate record per request
    assert certs["mode"] == "certified" and certs["requests"] == 12 and certs["steps"] > 0
    assert sum(certs["rung_rates"]) == pytest.approx(1.0)


def test_batch_size_decodes_requests_together_with_the_answers_of_one_at_a_time(tasks,
                                                                                 tmp_path):
    """lm-eval's ``batch_size``: generations and multiple-choice picks as at batch size 1,
    log-likelihoods up to a batch's rounding, a certificate record per request either way."""
    names = ["certkv_ruler_niah_single", "certkv_needle_choice", "certkv_books"]
    out = {size: evaluate(tasks, names, f"{TINY},mode=certified,run_dir={tmp_path / str(size)}",
                          log_samples=True, gen_kwargs="max_gen_toks=6", batch_size=size)
           for size in (1, 3)}
    one, three = (out[size]["samples"] for size in (1, 3))
    for name in names:
        for a, b in zip(one[name], three[name], strict=True):
            if name == "certkv_ruler_niah_single":
                assert a["filtered_resps"] == b["filtered_resps"]
            else:  # (log-likelihood, greedy) per choice; a rolling window's sum
                first = [r[0] if isinstance(r, list | tuple) else r for r in a["filtered_resps"]]
                assert [r[0] if isinstance(r, list | tuple) else r
                        for r in b["filtered_resps"]] == pytest.approx(first, rel=1e-3)
    assert out[1]["results"]["certkv_needle_choice"]["acc,none"] == \
        out[3]["results"]["certkv_needle_choice"]["acc,none"]
    assert certificates(tmp_path / "1")["requests"] == certificates(tmp_path / "3")["requests"]


def test_a_batch_size_that_is_not_a_count_is_one_sentence():
    from certkv.integrations.lm_eval import batch_sequences

    assert batch_sequences("auto") == batch_sequences("auto:8") == 4 and batch_sequences(2) == 2
    with pytest.raises(ConfigError, match="batch_size='0' must be a positive number"):
        batch_sequences("0")


def test_dense_method_scores_what_lm_evals_hf_model_scores(tasks, tmp_path):
    """The harness is the judge: certkv's dense path (prefill, then one step per token) gives
    lm-eval's `hf` model's log-likelihoods (one forward pass) within rounding."""
    model = CertKVLM(model="tiny_random", mode="dense", run_dir=str(tmp_path / "run"))
    saved = tmp_path / "tiny"
    model.lm.model.save_pretrained(saved)
    model.tokenizer.save_pretrained(saved)
    manager = TaskManager(include_path=str(tasks))
    names = ["certkv_needle_choice", "certkv_books"]
    ours = lm_eval.simple_evaluate(model=model, tasks=names, task_manager=manager, limit=2,
                                   bootstrap_iters=0)["results"]
    hf = lm_eval.simple_evaluate(model="hf",
                                 model_args=f"pretrained={saved},dtype=float32,device=cpu",
                                 tasks=names, task_manager=manager, limit=2,
                                 bootstrap_iters=0)["results"]
    assert ours["certkv_needle_choice"]["acc,none"] == hf["certkv_needle_choice"]["acc,none"]
    assert ours["certkv_books"]["word_perplexity,none"] == pytest.approx(
        hf["certkv_books"]["word_perplexity,none"], rel=1e-4)


def test_a_config_group_option_picks_a_quantizer():
    from certkv.integrations.lm_eval import method_config
    from certkv.quant import InnerQKeyCodec

    _, built = method_config("tiny_random", "naive", overrides={"quantizer": "innerq"})
    assert isinstance(built.variants[0].quantizer.key_codec, InnerQKeyCodec)


@pytest.mark.parametrize("evict", ["snapkv", "heavy_hitter"])
def test_an_eviction_policy_runs_under_lm_eval(tasks, tmp_path, evict):
    """``evict=<policy>`` in the model arguments: SnapKV gets the prompt's queries from the
    dense prefill (as in ``certkv run``; without them its first eviction raises), and the
    certificate statistics count the evicted blocks paged back in."""
    run_dir = tmp_path / "run"
    out = evaluate(tasks, ["certkv_ruler_niah_single"],  # 8 decode steps a request suffice
                   f"{TINY},mode=certified,run_dir={run_dir},evict={evict},evict.budget=0.3",
                   gen_kwargs="max_gen_toks=8")
    assert 0.0 <= out["results"]["certkv_ruler_niah_single"]["score,none"] <= 1.0
    certs = certificates(run_dir)
    assert certs["requests"] == 2 and certs["steps"] > 0
    assert certs["page_in_steps_rate"] >= 0.0 and "paged_evicted_per_step" in certs


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "fast"}, "mode='fast' is unknown"),
    ({"temperature": 0.5}, "unknown model argument"),
])
def test_bad_model_arguments_are_one_sentence(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        CertKVLM(model="tiny_random", **kwargs)


def test_import_certkv_registers_the_model_next_to_lm_evals_own():
    import subprocess
    import sys

    code = ("import certkv; from lm_eval.api.registry import get_model; "
            "print(get_model('certkv').__name__, get_model('hf').__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["CertKVLM", "HFLM"]


def test_lm_eval_command_writes_its_run_dir_and_logs_certificates_to_wandb(
        tmp_path, monkeypatch, data_dir_with_tasks):
    """`certkv lm-eval` registers the model, writes lm-eval's results and the certificates to
    the configuration's run directory, and logs both to W&B when asked."""
    import functools

    import lm_eval.tasks

    from certkv.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    # lm-eval's CLI indexes its thousands of built-in tasks (15 s here); certkv's come from
    # --include_path either way
    monkeypatch.setattr(lm_eval.tasks, "TaskManager",
                        functools.partial(lm_eval.tasks.TaskManager, include_defaults=False))
    summaries = []
    finish = wandb.sdk.wandb_run.Run.finish
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "finish",
                        lambda self, *a, **k: (summaries.append(dict(self.summary)),
                                               finish(self, *a, **k))[1])
    result = CliRunner().invoke(app, ["lm-eval", "--model_args", f"{TINY},mode=certified",
                                      "--tasks", "certkv_needle_choice", "--limit", "1",
                                      "--certkv_context", "1024", "--certkv_samples", "2",
                                      "--wandb_args", "project=certkv-test,mode=offline"])
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "runs" / "lm_eval" / "tiny_random_certified"
    assert certificates(run_dir)["requests"] == 4
    assert list(run_dir.rglob("results_*.json"))
    ours = next(s for s in summaries if "certificate/requests" in s)
    assert ours["certificate/requests"] == 4 and "lm_eval/certkv_needle_choice/acc,none" in ours


def test_every_configuration_has_its_own_results_directory():
    """A 2-bit naive run and an 8-bit one used to share runs/lm_eval/<model>_<mode>/ (and one's
    certificates replaced the other's): every model argument that can change a result now
    names the directory, joined with `+` (lm-eval splits model arguments at commas)."""
    from certkv.integrations.lm_eval import run_name

    plain = run_name("smollm2_135m", "naive", {})
    two_bit = run_name("smollm2_135m", "naive", {"quantizer.key_codec.bits": 2})
    assert plain == "smollm2_135m_naive"
    assert two_bit == "smollm2_135m_naive+quantizer.key_codec.bits=2"
    both = run_name("m", "certified", {"experiment": "ruler_4k", "max_length": 2048,
                                       "value_policy.v_tol": 0.02, "batch_size": 1})
    assert both == "m_certified_ruler_4k+max_length=2048+value_policy.v_tol=0.02"
    assert "," not in run_name("m", "naive", {"variants": "[a,b]"})


def test_ls_tasks_lists_certkvs_tasks(data_dir_with_tasks, monkeypatch):
    """`certkv lm-eval ls tasks` hands lm-eval's own `ls` the folder of certkv's tasks
    (`--include_path`, which lm-eval's ls lists next to its own; indexing all of lm-eval's
    tasks takes half a minute, so lm-eval's listing itself is not run here)."""
    import sys

    import lm_eval.__main__

    from certkv.cli import app

    seen = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.append(list(sys.argv)))
    result = CliRunner().invoke(app, ["lm-eval", "ls", "tasks", "--model_args",
                                      "model=tiny_random", "--certkv_context", "1024",
                                      "--certkv_samples", "2"])
    assert result.exit_code == 0, result.output
    (argv,) = seen
    assert argv[:3] == ["lm_eval", "ls", "tasks"]
    folder = Path(argv[argv.index("--include_path") + 1])
    assert {p.stem for p in folder.glob("certkv_*.yaml")} >= set(TASKS)


def test_a_context_too_short_names_the_task_and_the_smallest_context(data_dir_with_tasks):
    """`--certkv_context 512` used to fail with an internal `context_tokens` and `cwe`: the
    sentence names each task that does not fit, the smallest context that works for all of
    them (found by search), in the caller's syntax (`--certkv_context N` on the command line)."""
    from certkv.integrations.lm_eval import task_manager

    with pytest.raises(ConfigError) as caught:
        task_manager("tiny_random", context=512, samples=1)
    message = str(caught.value)
    needs = re.findall(r"(certkv_\w+) \(needs (\d+)\)", message)
    assert ("certkv_ruler_cwe", needs[0][1]) in needs
    smallest = max(int(n) for _, n in needs)
    assert f"use task_manager(context={smallest}) or more" in message
    task_manager("tiny_random", context=smallest, samples=1, include_defaults=False)
