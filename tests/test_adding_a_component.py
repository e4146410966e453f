"""docs/adding-a-component.md, done as it says: the page's codec file and YAML, written to a
temporary directory that ``CERTKV_CONF_PATH`` names, with no other edit, are a registered
codec that keeps its bound on adversarial keys, a ``quantizer=`` option whose tiny run has no
head over its bound, and a row of ``certkv bench codecs``; the page's commands run."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
from helpers import KINDS, adversarial, assert_keys_within_bound
from helpers.tiny_run import audited_tiny_run
from typer.testing import CliRunner

from certkv.cli import app
from certkv.config import config_groups
from certkv.registry import KEY_CODECS

PAGE = Path(__file__).resolve().parent.parent / "docs" / "adding-a-component.md"
TEXT = PAGE.read_text()


def block(language: str) -> str:
    (found,) = re.findall(rf"```{language}\n(.*?)```", TEXT, flags=re.S)
    return found


@pytest.fixture
def components(tmp_path, monkeypatch):
    """The page's two files in ``my_components/``, named by ``CERTKV_CONF_PATH``; the import
    path, the module and the registry are restored afterwards."""
    root = tmp_path / "my_components"
    (root / "quantizer").mkdir(parents=True)
    (root / "fp8_keys.py").write_text(block("python"))
    (root / "quantizer" / "fp8_e4m3.yaml").write_text(block("yaml"))
    monkeypatch.setenv("CERTKV_CONF_PATH", str(root))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(KEY_CODECS, "_items", dict(KEY_CODECS._items))
    monkeypatch.delitem(sys.modules, "fp8_keys", raising=False)
    monkeypatch.chdir(tmp_path)
    return root


def test_the_page_holds_one_file_and_one_yaml_that_name_each_other():
    assert "class FP8KeyCodec" in block("python")
    assert "fp8_keys.FP8KeyCodec" in block("yaml")


def test_the_codec_is_a_registered_option_and_keeps_its_bound(components):
    assert "fp8_e4m3" in config_groups()["quantizer"]
    import fp8_keys  # importable: the directory joined sys.path with the config

    codec = KEY_CODECS.get("fp8_e4m3")()
    assert isinstance(codec, fp8_keys.FP8KeyCodec) and codec.kernel_layout() is None
    for seed, kind in enumerate(KINDS):
        assert_keys_within_bound(codec, adversarial(kind, (2, 3, 32, 64), seed=seed))


@pytest.mark.usefixtures("books")
def test_the_codec_runs_the_tiny_experiment_with_no_head_over_its_bound(components, tmp_path):
    audited = audited_tiny_run(["quantizer=fp8_e4m3", "task=perplexity",
                                "task.perplexity.decode_tokens=4",
                                "task.perplexity.context=512"], tmp_path)
    assert sum(c["violations"] for c in audited) == 0


def page_commands() -> list[list[str]]:
    bash = re.findall(r"```bash\n(.*?)```", TEXT, flags=re.S)
    return [shlex.split(line, comments=True)[1:] for b in bash for line in b.splitlines()
            if line.startswith("certkv ")]


def test_the_pages_commands_run(components, tmp_path):
    """``certkv run`` as far as its composed and validated config (the run itself above),
    ``certkv bench codecs`` in full: the new quantizer is its row."""
    runner = CliRunner()
    (run,), (bench,) = ([c for c in page_commands() if c[0] == name] for name in ("run", "bench"))
    result = runner.invoke(app, [*run, "--cfg", "job"])
    assert result.exit_code == 0 and "fp8_keys.FP8KeyCodec" in result.output, result.output
    result = runner.invoke(app, [*bench, "--context", "256", "--out", str(tmp_path / "codecs")],
                           env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "codecs" / "codecs_cpu.json").read_text())
    assert [r["quantizer"] for r in data["records"]["stores"]] == ["fp8_e4m3"]
    (store,) = data["records"]["stores"]
    assert 1 < store["compression"] < 4  # FP8 keys and 4-bit values against FP16
    assert torch.float8_e4m3fn  # the torch these tests run carries the dtype the page uses
