"""The Hydra entry point behind ``certkv run`` (composes ``conf/`` and runs the experiment)."""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from certkv.config import CONF_DIR
from certkv.errors import CertKVError

MAX_DIRNAME = 120


def short_dirname(overrides: str) -> str:
    """A run directory name from the overrides: as Hydra writes it, or, when that would be too
    long for a file system (e.g. a ``variants=[...]`` list), its start and a hash of the whole."""
    if len(overrides) <= MAX_DIRNAME:
        return overrides
    digest = hashlib.md5(overrides.encode()).hexdigest()[:10]
    return f"{overrides[:MAX_DIRNAME - 11].rstrip(',')}-{digest}"


OmegaConf.register_new_resolver("dirname", short_dirname, replace=True)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    from certkv.eval.results import RunDir
    from certkv.eval.runner import run_experiment

    out_dir = HydraConfig.get().runtime.output_dir
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    console = Console(stderr=True)
    if multirun and RunDir.finished(out_dir, OmegaConf.to_yaml(cfg, resolve=True)):
        console.print(f"[bold]skipped:[/] {out_dir} finished earlier.", highlight=False)
        return
    Path(out_dir, RunDir.FAILED).unlink(missing_ok=True)  # a fresh attempt
    try:
        summary = run_experiment(cfg, out_dir)
    except (CertKVError, InstantiationException) as exc:
        cause = exc if isinstance(exc, CertKVError) else exc.__cause__
        if not isinstance(cause, CertKVError):
            raise
        if multirun:  # one failed point of a sweep: record it and let Hydra go on
            RunDir.record_failure(out_dir, str(cause))
            console.print(f"[bold red]point failed:[/] {out_dir}: {cause}", highlight=False)
            return
        _discard_if_empty(Path(out_dir), Path(cfg.out_dir))
        console.print(f"[bold red]error:[/] {cause}", highlight=False)
        sys.exit(2)
    from certkv.report.document import build_report, write_report

    report = build_report([out_dir])
    write_report(report, out_dir)  # README.md, figures/, report.json in the run directory
    instantiate(cfg.logger).log(report, summary, out_dir)


def _discard_if_empty(run_dir: Path, root: Path) -> None:
    """A run that failed before recording any result leaves no look-alike directory behind
    (Hydra creates it before the job starts); empty parents up to ``root`` go too."""
    if (run_dir / "samples.jsonl").exists():
        return  # a resumed run keeps what it recorded
    shutil.rmtree(run_dir, ignore_errors=True)
    parent = run_dir.parent
    while parent != root and root in parent.parents and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent
