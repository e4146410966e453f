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
    """The GPU's name, or the CPU's: its model, the microarchitecture numba compiles the CPU
    kernels for (their speed and last bits follow it), the machine and its cores, e.g. ``CPU
    (Intel(R) Xeon(R) Processor, emeraldrapids, x86_64, 2 cores)``."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    parts = [cpu_model(), compiled_for(), platform.machine(), f"{os.cpu_count()} cores"]
    return f"CPU ({', '.join(part for part in parts if part)})"


def cpu_model() -> str:
    """The CPU's model name (Linux's ``/proc/cpuinfo``; the platform's processor elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


def compiled_for() -> str:
    """llvmlite's name for this CPU (what numba compiles for), or ``""`` without it."""
    try:
        import llvmlite.binding as llvm
    except ImportError:
        return ""
    return llvm.get_host_cpu_name()


def environment() -> dict:
    """Commit, device, torch threads and versions of this process."""
    import transformers

    return {"commit": source_commit(), "device": device_name(),
            "threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__}
