"""The Hydra entry point behind ``certkv run`` (composes ``conf/`` and runs the experiment)."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from certkv.config import CONF_DIR, drop_unused_task_settings, register_resolvers
from certkv.errors import CertKVError
from certkv.files import below_cwd

register_resolvers()


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    from certkv.eval.results import RunDir
    from certkv.eval.runner import run_experiment

    drop_unused_task_settings(cfg, HydraConfig.get().overrides.task)
    out_dir = HydraConfig.get().runtime.output_dir
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    console = Console(stderr=True)
    if multirun and RunDir.finished(out_dir, OmegaConf.to_yaml(cfg, resolve=True)):
        console.print(f"[bold]skipped:[/] {out_dir} finished earlier.", highlight=False)
        return
    try:
        Path(out_dir, RunDir.FAILED).unlink(missing_ok=True)  # a fresh attempt
        summary = run_experiment(cfg, out_dir, command=point_command(out_dir, multirun),
                                 invoked_by=os.environ.get(INVOCATION))
        from certkv.report.document import build_report, write_report

        report = build_report([out_dir])
        write_report(report, out_dir)  # README.md, figures/, report.json in the run directory
    except (CertKVError, OSError) as exc:
        message = _user_error(exc, out_dir)
        if multirun:  # one failed point of a sweep: record it and let Hydra go on
            RunDir.record_failure(out_dir, message)
            FAILED_POINTS.append(str(below_cwd(out_dir)))
            console.print(f"[bold red]point failed:[/] {out_dir}: {message}", highlight=False)
            return
        _discard_if_empty(Path(out_dir), Path(cfg.out_dir))
        console.print(f"[bold red]error:[/] {message}", highlight=False)
        sys.exit(2)
    instantiate(cfg.logger).log(report, summary, out_dir, brief=multirun)


# the points of this process's sweep that failed (the CLI exits non-zero after the sweep)
FAILED_POINTS: list[str] = []
INVOCATION = "CERTKV_INVOCATION"  # the command the user typed (set by the CLI for sweeps)


def _user_error(exc: Exception, out_dir: str) -> str:
    """The one sentence a failed job reports (components are built through
    :func:`certkv.eval.runner.build`, so Hydra's wrapping never reaches here); an ``OSError``
    without an errno is a bug and propagates."""
    if isinstance(exc, CertKVError):
        return str(exc)
    if not isinstance(exc, PermissionError | FileNotFoundError) and exc.errno is None:
        raise exc
    reason = (exc.strerror or type(exc).__name__).lower()
    return f"cannot write the run directory {out_dir} ({reason}); choose a writable out_dir=DIR."


def point_command(out_dir: str, multirun: bool) -> str:
    """A command a user can paste to rerun (resume) this job into the same directory: the
    job's own overrides (a sweep point's values, not the sweep's lists) and, for a sweep
    point, its directory."""
    overrides = list(HydraConfig.get().overrides.task)
    if multirun:
        # quoted: a point's name holds = and ,
        overrides.append(f'hydra.run.dir="{below_cwd(out_dir)}"')
    else:
        overrides += [o for o in HydraConfig.get().overrides.hydra
                      if o.startswith("hydra.run.dir=")]
    return shlex.join(["certkv", "run", *overrides])


def _discard_if_empty(run_dir: Path, root: Path) -> None:
    """A run that failed before recording any result leaves no look-alike directory behind
    (Hydra creates it before the job starts); empty parents up to ``root`` go too."""
    run_dir, root = run_dir.resolve(), root.resolve()
    if (run_dir / "samples.jsonl").exists():
        return  # a resumed run keeps what it recorded
    shutil.rmtree(run_dir, ignore_errors=True)
    parent = run_dir.parent
    while parent != root and root in parent.parents and parent.is_dir() \
            and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent
