"""Every `certkv ...` example in README.md and docs/ runs as documented: fully where it is quick and
offline (info, demo at a short context, the `task_manager()` snippet on the tiny model), and
where it would train for an hour, need a GPU or the network, up to the point where it would
start: the run's config composed and every component checked (`--cfg job`), a sweep's points
previewed (`--cfg job`), lm-eval's model arguments built, `--help` for the rest."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from certkv.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# the front page and the docs site; "Adding a component" runs its commands in its own test
# (tests/test_adding_a_component.py), with the directory of components the page writes
PAGES = [README, *sorted(p for p in (ROOT / "docs").glob("*.md")
                         if p.name != "adding-a-component.md")]
runner = CliRunner()


def documented() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def commands() -> list[list[str]]:
    """The `certkv ...` lines of the README and the docs as argument lists (comments dropped,
    $HOME expanded)."""
    found = []
    for block in bash_blocks(documented()):
        for line in block.splitlines():
            if line.startswith("certkv "):
                args = shlex.split(os.path.expandvars(line), comments=True)[1:]
                if args not in found:  # the front page repeats a few of the docs' lines
                    found.append(args)
    return found


COMMANDS = commands()


def test_the_docs_document_every_command():
    assert {c[0] for c in COMMANDS} >= {"run", "sweep", "lm-eval", "report", "info", "bench",
                                        "demo"}
    assert len(COMMANDS) >= 40


def local_paths(args: list[str], tiny_model_dir: Path) -> list[str]:
    """The README's placeholder model directories point at the tiny model."""
    out = []
    for a in args:
        a = re.sub(r"model\.path=/\S+", f"model.path={tiny_model_dir}", a)
        out.append(re.sub(r"model=/path/to/hf_model_dir", f"model={tiny_model_dir}", a))
    return out


def first_point(args: list[str]) -> list[str]:
    """A `certkv run -m` line as its first job (Hydra shows one job's config)."""
    from certkv.config import first_choices

    rest = [a for a in args if a not in ("-m", "--multirun")]
    return [a if "=" not in a else first_choices([a])[0] for a in rest]


@pytest.mark.parametrize("args", [c for c in COMMANDS if c[0] == "run"],
                         ids=lambda c: " ".join(c)[:60])
def test_readme_run_lines_compose_and_validate(args, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)  # the online W&B line assumes `wandb login`
    args = local_paths(first_point(args) if "-m" in args else args, tiny_model_dir)
    if "--cfg" not in args:
        args = [*args, "--cfg", "job"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "variants:" in result.output and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args", [c for c in COMMANDS if c[0] == "sweep"],
                         ids=lambda c: " ".join(c)[:60])
def test_readme_sweep_lines_preview_their_points(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if "--cfg" not in args:
        args = [*args, "--cfg", "job"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "points (under runs/sweeps/" in " ".join(result.output.split())
    assert not (tmp_path / "runs").exists() and not (tmp_path / "reports").exists()


@pytest.mark.parametrize("args", [c for c in COMMANDS if c[0] == "lm-eval"],
                         ids=lambda c: " ".join(c)[:60])
def test_readme_lm_eval_lines_build_their_model_arguments(args, tiny_model_dir):
    """lm-eval lines with the certkv model: their model arguments compose and validate
    (the evaluation itself is tested in test_lm_eval.py); every line's options parse."""
    from certkv.cli import _pop
    from certkv.integrations import lm_eval as ours

    args = local_paths(list(args[1:]), tiny_model_dir)
    if args[:1] == ["ls"]:
        return  # run fully in test_lm_eval_cli_lists_certkv_tasks
    model = _pop(args, "model") or "certkv"
    model_args = dict(a.split("=", 1) for a in (_pop(args, "model_args") or "").split(",")
                      if "=" in a)
    assert _pop(args, "tasks")
    batch_size = _pop(args, "batch_size")
    assert batch_size is None or ours.batch_sequences(batch_size) > 0
    if model != "certkv":
        assert model == "hf" and "pretrained" in model_args
        return
    _, built = ours.method_config(
        model_args.get("model", "smollm2_135m"), model_args.get("mode", "certified"),
        model_args.get("experiment"),
        {k: v for k, v in model_args.items() if k not in ours.ARGS})
    assert built.variants[0].mode == model_args["mode"]


@pytest.mark.parametrize("args", [c for c in COMMANDS if c[0] in ("report", "bench")],
                         ids=lambda c: " ".join(c)[:60])
def test_readme_report_and_bench_lines_parse(args):
    """Their options exist (bench runs in test_bench.py, report in test_report.py)."""
    from typer.main import get_command

    command = get_command(app)
    ctx = command.make_context("certkv", list(args), resilient_parsing=True)
    sub = command.get_command(ctx, args[0])
    if args[0] == "bench":
        sub = sub.get_command(ctx, args[1])
        rest = args[2:]
    else:
        rest = args[1:]
    sub.make_context(args[0], list(rest))  # raises on an unknown option or a bad value


def test_readme_info_and_demo_lines_run(monkeypatch):
    for args in [c for c in COMMANDS if c[0] in ("info", "demo")]:
        if args[0] == "demo":
            args = [*args, "--context", "256"]  # the README's flags, a shorter context
        result = runner.invoke(app, args, env={"COLUMNS": "100"})
        assert result.exit_code == 0, (args, result.output)
        if args[0] == "demo":
            assert "VIOLATED" not in result.output and "ok" in result.output


def test_readme_task_manager_snippet_runs(data_dir_with_tasks, tmp_path, monkeypatch):
    """The lm-eval Python example, on the tiny model (SmolLM2 would take minutes)."""
    monkeypatch.chdir(tmp_path)  # the model's certificates go to ./runs/lm_eval/
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    python = [b for b in re.findall(r"```python\n(.*?)```", documented(), flags=re.S)
              if "task_manager(" in b]
    assert len(python) == 1
    code = python[0].replace("model=smollm2_135m", "model=tiny_random").replace(
        'task_manager=task_manager(context=1024)',
        'task_manager=task_manager(model="tiny_random", context=1024, samples=2, '
        'include_defaults=False)')  # lm-eval's own tasks take 15 s to index
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert set(scope["results"]["results"]["certkv_needle_choice"]) >= {"acc,none"}
