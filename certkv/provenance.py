"""Where a result came from: the code's commit, the machine, thread count and library versions
(recorded in every run directory and report, so a result can be reproduced or its variance
understood: CPU reductions, hence rounding, depend on the thread count)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch


def source_commit() -> str:
    """The certkv checkout's commit (short hash, ``-dirty`` if tracked files outside
    ``reports/`` changed since), for the provenance line of a report; ``unknown`` outside a git
    checkout."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!reports")
        return commit + ("-dirty" if changed else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def environment() -> dict:
    """Commit, device, torch threads and versions of this process."""
    import transformers

    return {"commit": source_commit(), "device": device_name(),
            "threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__}
