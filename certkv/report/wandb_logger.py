"""The ``wandb`` logger: the run's report on the console, and a W&B run with the resolved
config, per-step certificate summaries as metrics, per-sample results as a table, the report's
tables and figures, and the headline quality numbers in the run summary.

``mode="offline"`` (the default) needs no account and no network: the run is written under the
run directory (``<run dir>/wandb/offline-run-<time>-<id>``, printed when it closes) and uploaded
later with ``wandb sync <that path>``; ``online`` uses
the user's key; ``disabled`` logs nothing. One W&B run per Hydra job, grouped by experiment (a
multirun sweep's jobs share the group).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from certkv.errors import ConfigError, require
from certkv.files import below_cwd
from certkv.report.console import ConsoleLogger
from certkv.report.tables import quality_delta

MODES = ("offline", "online", "disabled")
MAX_POINTS = 2000  # per-step points logged per method (longer runs are strided)


def has_api_key() -> bool:
    """Whether W&B has a key to log in with: ``WANDB_API_KEY`` or the netrc entry that
    ``wandb login`` writes for the server (``WANDB_BASE_URL``, default api.wandb.ai). Checked
    before a run starts, so an online run without one fails at once, not after the run."""
    import netrc
    import os
    from urllib.parse import urlparse

    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


@dataclass
class WandbLogger:
    """Console report plus one W&B run (``mode``: offline, online or disabled)."""

    project: str = "certkv"
    entity: str | None = None
    mode: str = "offline"
    group: str | None = None  # default: the experiment
    name: str | None = None  # default: the run directory's name
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        require(self.mode in MODES, ConfigError,
                f"logger.mode={self.mode!r} is unknown; use one of {list(MODES)}.")
        require(self.mode != "online" or has_api_key(), ConfigError,
                "logger.mode=online needs a W&B API key and none is set; run `wandb login` "
                "(or set WANDB_API_KEY), or use logger.mode=offline and `wandb sync` later.")

    def log(self, report, summary: dict, run_dir: str, brief: bool = False) -> None:
        ConsoleLogger().log(report, summary, run_dir, brief)
        wandb = _wandb()
        run_data = report.runs[0]
        run = wandb.init(project=self.project, entity=self.entity, mode=self.mode,
                         dir=run_dir, group=self.group or run_data.experiment,
                         name=self.name or Path(run_dir).name, tags=list(self.tags),
                         job_type=run_data.experiment, config=run_data.config)
        try:
            self._certificates(run, run_data)
            self._samples(run, wandb, run_data)
            self._report(run, wandb, report, Path(run_dir))
            self._summary(run, run_data)
        finally:
            self._finish(run)

    def log_sweep(self, report) -> None:
        """A sweep's aggregate (:class:`certkv.report.sweep.SweepReport`) as one more W&B run
        in the sweep's group: the table and the figure."""
        wandb = _wandb()
        run = wandb.init(project=self.project, entity=self.entity, mode=self.mode,
                         dir=str(report.root), group=self.group or f"sweep-{report.name}",
                         name=f"sweep-{report.name}", job_type="sweep", tags=list(self.tags))
        try:
            run.log({f"sweep/{report.name}": wandb.Table(columns=report.table.head,
                                                         data=report.table.rows)})
            if report.figure is not None:
                run.log({f"sweep/{report.name}_figure": wandb.Image(str(report.figure))})
        finally:
            self._finish(run)

    def log_lm_eval(self, run_dir: Path, name: str) -> None:
        """An lm-eval run's certificate statistics (``certificates_<time>.json``) and lm-eval's
        results (``results_*.json``) as one W&B run in the group ``lm_eval``."""
        wandb = _wandb()
        found = sorted(run_dir.glob("certificates_*.json"))
        require(bool(found), ConfigError, f"{run_dir} holds no certificates_*.json; run "
                "`certkv lm-eval --model certkv ...` first.")
        certificates = json.loads(found[-1].read_text())  # this evaluation's (the newest)
        results = [json.loads(p.read_text())["results"]
                   for p in sorted(run_dir.rglob("results_*.json"))[-1:]]
        run = wandb.init(project=self.project, entity=self.entity, mode=self.mode,
                         dir=str(run_dir), group=self.group or "lm_eval", name=name,
                         job_type="lm_eval", tags=list(self.tags))
        try:
            for task, metrics in (results[0] if results else {}).items():
                for metric, value in metrics.items():
                    if isinstance(value, int | float):
                        run.summary[f"lm_eval/{task}/{metric}"] = value
            for key, value in _flatten(certificates).items():
                run.summary[f"certificate/{key}"] = value
        finally:
            self._finish(run)

    def _finish(self, run) -> None:
        """Close the W&B run; an offline run says where it was written and how to upload it."""
        where = Path(run.settings.sync_dir) if self.mode == "offline" else None
        run.finish()
        if where is not None:
            from rich.console import Console

            Console(stderr=True, soft_wrap=True).print(
                f"W&B offline run written; upload it with: wandb sync {below_cwd(where)}",
                highlight=False)

    @staticmethod
    def _certificates(run, data) -> None:
        """Per-step certificate summaries of every method, one step axis per method."""
        for variant in data.variants:
            records = data.certificate_records(variant)
            steps = [(r[f"{n}_step_mean"][i] for n in ("e_key", "e_val", "e_arith"))
                     for r in records for i in range(len(r.get("e_key_step_mean", [])))]
            steps = [tuple(s) for s in steps]
            if not steps:
                continue
            prefix = f"certificate/{variant}"
            run.define_metric(f"{prefix}/step")
            run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/step")
            stride = max(1, len(steps) // MAX_POINTS)
            for k in range(0, len(steps), stride):
                e_key, e_val, e_arith = steps[k]
                run.log({f"{prefix}/step": k, f"{prefix}/e_key": e_key,
                         f"{prefix}/e_val": e_val, f"{prefix}/e_arith": e_arith,
                         f"{prefix}/bound": e_key + e_val + e_arith})

    @staticmethod
    def _samples(run, wandb, data) -> None:
        """Every per-sample record as one table (lists and dicts as JSON text)."""
        if not data.samples:
            return
        columns = list(dict.fromkeys(k for r in data.samples for k in r))
        rows = [[_cell(r.get(c)) for c in columns] for r in data.samples]
        run.log({"samples": wandb.Table(columns=columns, data=rows)})

    @staticmethod
    def _report(run, wandb, report, run_dir: Path) -> None:
        """The report's tables and figures."""
        for table in report.tables:
            key = "tables/" + "".join(c if c.isalnum() else "_" for c in table.title.lower())
            run.log({key: wandb.Table(columns=table.head, data=table.rows)})
        for figure in sorted((run_dir / "figures").glob("*.png")):
            run.log({f"figures/{figure.stem}": wandb.Image(str(figure))})

    @staticmethod
    def _summary(run, data) -> None:
        """Headline numbers: each method's quality and delta to dense per task."""
        for task in data.tasks:
            for variant in data.variants:
                q = quality_delta(data, task, variant)
                if q is not None:
                    base = f"quality/{task}/{variant}"
                    run.summary[f"{base}/{q['metric']}"] = q["method"]
                    run.summary[f"{base}/delta"] = q["delta"].estimate
                    if q["delta"].bounded:
                        run.summary[f"{base}/delta_low"] = q["delta"].low  # one sample: none
                        run.summary[f"{base}/delta_high"] = q["delta"].high


def _flatten(tree: dict, prefix: str = "") -> dict:
    """``{"e_key": {"median": 1}}`` -> ``{"e_key/median": 1}`` (numbers only)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}/"))
        elif isinstance(value, list):
            out.update({f"{prefix}{key}/{i}": v for i, v in enumerate(value)
                        if isinstance(v, int | float)})
        elif isinstance(value, int | float):
            out[f"{prefix}{key}"] = value
    return out


def _wandb():
    try:
        import wandb
    except ImportError as exc:
        raise ConfigError("logger=wandb needs the wandb package; pip install "
                          "'certkv[wandb]' or use logger=console.") from exc
    return wandb


def _cell(value):
    return json.dumps(value) if isinstance(value, list | dict) else value

