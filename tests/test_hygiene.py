"""Test hygiene: the declared dev dependencies are installed (tests that need one fail, never
skip, without it), and test output stays out of the checkout (W&B runs, hypothesis's storage:
``tests/conftest.py`` puts them under pytest's temporary directory)."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import hypothesis
import wandb
from hypothesis.configuration import storage_directory
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]


def dev_requirements(extra: str = "dev") -> list[Requirement]:
    """The requirements of ``pip install -e .[extra]`` (``certkv[...]`` extras expanded)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    out = []
    for text in extras[extra]:
        own = re.fullmatch(r"certkv\[(.+)\]", text)
        out += ([r for name in own.group(1).split(",") for r in dev_requirements(name.strip())]
                if own else [Requirement(text)])
    return out


def test_declared_dev_dependencies_are_installed():
    """triton, wandb, lm-eval... are declared dev dependencies: their tests must run, so a
    missing or too old one fails here with the fix (``make setup``) instead of a silent skip."""
    names = [r.name for r in dev_requirements()]
    assert {"triton", "wandb", "lm-eval", "hypothesis", "pytest"} <= set(names)
    missing = []
    for req in dev_requirements():
        try:
            installed = version(req.name)
        except PackageNotFoundError:
            missing.append(f"{req} (not installed)")
            continue
        if not req.specifier.contains(installed, prereleases=True):
            missing.append(f"{req} (installed {installed})")
    assert not missing, f"dev dependencies missing: {missing}; run `make setup`."


def test_wandb_runs_without_a_dir_stay_out_of_the_checkout(output_outside_the_checkout):
    """A W&B run opened without ``dir`` (as lm-eval's own logger does) lands under the tests'
    temporary W&B dir, not in ``./wandb`` of the checkout."""
    run = wandb.init(project="certkv-hygiene", mode="offline", settings=wandb.Settings(
        silent=True))
    try:
        run.log({"x": 1.0})
        written = Path(run.settings.sync_dir).resolve()
    finally:
        run.finish()
    assert written.is_dir() and written.name.startswith("offline-run-")
    assert written.is_relative_to(output_outside_the_checkout.resolve() / "wandb_dir")
    assert not written.is_relative_to(REPO)


def test_hypothesis_keeps_nothing_in_the_checkout(hypothesis_home):
    """No example database, and hypothesis's storage (its constants cache, written while
    collecting) in the session's temporary folder, not ``./.hypothesis``."""
    assert hypothesis.settings().database is None
    where = storage_directory("constants", intent_to_write=False).path.resolve()
    assert where.is_relative_to(hypothesis_home.resolve())
    assert not where.is_relative_to(REPO) and not where.is_relative_to(Path.cwd())


def test_test_modules_share_code_only_through_helpers():
    """A test module imports no other test module: what two tests share lives in
    ``tests/helpers/`` (fixtures in ``conftest.py``)."""
    pattern = re.compile(r"^\s*(from|import)\s+test_\w+", re.M)
    offenders = [p.name for p in (REPO / "tests").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
