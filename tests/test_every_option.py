"""Every option of every config group runs end to end on ``+experiment=tiny`` (issue 52).

The options are read from ``conf/``, so a new YAML joins this test by itself. Each runs as
``certkv run +experiment=tiny GROUP=OPTION audit=true`` composes and runs it:
every certified head of every layer step is compared with FP64 attention on its originals, and
the run must record every planned sample with no head over its bound. What cannot run on the
tiny experiment is listed in :data:`NOT_ON_TINY` with the reason, and that list is checked too.
"""

from __future__ import annotations

import pytest
from helpers.tiny_run import audited_tiny_run

from certkv.config import config_groups

# groups whose options are not components of a pipeline: an experiment is a run of its own and
# `hydra` holds launchers (tests/test_sweep.py runs one)
NOT_COMPONENTS = ("experiment", "hydra")
NOT_ON_TINY = {
    "model=llama31_8b": "Llama weights from the hub (16 GB); no network here",
    "model=llama31_70b": "Llama weights from the hub (140 GB); no network here",
    "model=smollm2_135m": "the real model: `make run` runs it, and "
                          "tests/models/test_smollm2.py (slow)",
}
OPTIONS = [f"{group}={option}" for group, options in config_groups().items()
           if group not in NOT_COMPONENTS for option in options]
# A component's option runs tiny's perplexity task alone at its smallest (four decode steps of
# every method; the task options run NIAH, RULER and the smoke pair), at 512 tokens (past every
# config's exact windows) where nothing needs more: eviction keeps tiny's 2048, which its
# policies' default protection needs to leave their budgets room. This keeps every code path
# of a run at a quarter of the cost of tiny's defaults.
SMALLEST = ["task=perplexity", "task.perplexity.decode_tokens=4"]
SHORT = ["task.perplexity.context=512"]
# the Triton interpreter takes about 6 ms per program tile: 160 tokens
SHORTER = ["task.perplexity.context=160"]


def overrides(option: str) -> list[str]:
    """What the test adds to ``+experiment=tiny OPTION`` (see above)."""
    group = option.split("=")[0]
    if group == "task":
        return []
    if group == "logger":
        return ["task.niah.trials=1", "task.niah.max_new_tokens=2",
                "task.perplexity.decode_tokens=4"]
    if option == "backend=triton":
        return [*SMALLEST, *SHORTER]
    return SMALLEST if group == "evict" else [*SMALLEST, *SHORT]


def test_the_options_left_out_exist_and_say_why():
    assert set(NOT_ON_TINY) <= set(OPTIONS)
    assert all(reason for reason in NOT_ON_TINY.values())


@pytest.mark.usefixtures("books")
@pytest.mark.parametrize("option", [o for o in OPTIONS if o not in NOT_ON_TINY])
def test_every_option_runs_on_tiny_with_no_head_over_its_bound(option, tmp_path, monkeypatch):
    """The run as ``certkv run`` makes it (composed, validated, run, summarised, logged by the
    option's logger); the CLI around it and the written report have their own tests
    (test_cli.py, test_report.py), here they would triple the cost."""
    monkeypatch.setenv("WANDB_MODE", "offline")  # logger=wandb: a run written, nothing sent
    monkeypatch.setenv("WANDB_SILENT", "true")
    audited = audited_tiny_run([option, *overrides(option)], tmp_path)
    assert sum(c["violations"] for c in audited) == 0
