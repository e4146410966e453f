"""The runner's batches (issue 54): ``task.<name>.batch_size`` checked before anything is
written, and a batch too large for the memory free now refused in one sentence before any
prompt is prefilled."""

from __future__ import annotations

import pytest
from helpers.cli import TINY, runner

from certkv.cli import app
from certkv.models import hf_cache


@pytest.mark.parametrize("value", ["0", "two"])
def test_a_batch_size_that_is_not_a_positive_count_is_one_sentence(tmp_path, value):
    result = runner.invoke(app, ["run", *TINY, f"task.niah.batch_size={value}",
                                 f"out_dir={tmp_path}"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    message = " ".join(result.output.split())
    assert f"task.niah.batch_size={value!r}" in message or value == "0"
    assert "e.g. task.niah.batch_size=" in message
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_batch_larger_than_free_memory_is_refused_before_any_prefill(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_cache, "free_memory", lambda device: 2**20)  # 1 MiB free
    result = runner.invoke(app, ["run", *TINY, "task.niah.trials=2", f"out_dir={tmp_path}"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    message = " ".join(result.output.split())
    assert "task.niah.batch_size=4 needs about" in message
    assert "lower task.niah.batch_size" in message
    assert not list(tmp_path.rglob("samples.jsonl"))  # nothing recorded


def test_a_run_recorded_before_a_class_moved_resumes(tmp_path):
    """A run's config.yaml names the classes where they were then; a class that moved since
    (``MOVED``) is the same setting, so the run resumes instead of refusing."""
    from omegaconf import OmegaConf

    from certkv.eval.runner import MOVED, record_settings

    old_path, new_path = next(iter(MOVED.items()))
    cfg = OmegaConf.create({"model": {}, "seed": 0, "backend": {}, "task": {},
                            "cache": {"_target_": new_path}, "variants": []})
    old = OmegaConf.create({**OmegaConf.to_container(cfg), "cache": {"_target_": old_path}})
    assert record_settings(old) == record_settings(cfg)


def test_a_field_added_since_a_run_resumes_at_its_default_and_refuses_away_from_it(tmp_path):
    """A component field the run's records predate (absent from its config.yaml) is the
    behaviour they were made with at the field's default: the run resumes; set away from it,
    the records would mix two settings, so the rerun refuses in one sentence naming it."""
    import json

    from omegaconf import OmegaConf

    from certkv.errors import ConfigError
    from certkv.eval.results import RunDir
    from certkv.eval.runner import check_resume

    def config(ladder: dict, variant: dict):
        return OmegaConf.create({"model": {}, "seed": 0, "backend": {}, "cache": {}, "task": {},
                                 "ladder": {"_target_": "certkv.Ladder", "r": 1, **ladder},
                                 "variants": [{"name": "c", "mode": "certified", **variant}]})

    (tmp_path / RunDir.CONFIG).write_text(OmegaConf.to_yaml(config({}, {})))
    (tmp_path / RunDir.SAMPLES).write_text(json.dumps({"task": "niah", "variant": "c"}) + "\n")
    check_resume(str(tmp_path), config({"rank_summaries": True}, {}))  # the default: resumes
    changed = config({"rank_summaries": True}, {"ladder": {"rank_summaries": False}})
    with pytest.raises(ConfigError, match=r"\(variant c: ladder\.rank_summaries: \(not set: "
                                          r"True\) -> False\); pass another run directory"):
        check_resume(str(tmp_path), changed)
