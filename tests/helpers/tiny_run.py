"""One option's run on ``+experiment=tiny`` with ``audit=true``, as ``certkv run`` makes it."""

from __future__ import annotations

import json

from hydra.utils import instantiate

from certkv.config import compose_config
from certkv.eval.runner import run_experiment
from certkv.report.document import build_report


def audited_tiny_run(overrides: list[str], tmp_path) -> list[dict]:
    """Compose ``+experiment=tiny OVERRIDES audit=true``, run it, log it with its logger and
    check every planned record was written; returns the audited (non-dense) certificates, each
    of which checked every head-step against FP64 attention on its originals."""
    cfg = compose_config(["+experiment=tiny", *overrides, "audit=true", f"out_dir={tmp_path}"])
    run = tmp_path / "run"
    summary = run_experiment(cfg, str(run), progress=False)
    instantiate(cfg.logger).log(build_report([run]), summary, str(run), brief=True)
    meta = json.loads((run / "run.json").read_text())
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert meta["planned"] == len(samples) > 0
    certificates = [json.loads(line)
                    for line in (run / "certificates.jsonl").read_text().splitlines()]
    audited = [c for c in certificates if c["variant"] != "dense"]  # tiny: naive, certified
    assert audited and all(c["audited"] and c["head_steps"] > 0 for c in audited)
    return audited
