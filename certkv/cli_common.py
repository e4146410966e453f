"""What every ``certkv`` command shares: one-sentence errors, the device choice, the command
line a report records."""

from __future__ import annotations

import sys
from contextlib import contextmanager

import typer
from rich.console import Console

from certkv.errors import CertKVError


@contextmanager
def user_errors():
    """A :class:`CertKVError` raised inside exits with its one sentence (:func:`fail`)."""
    try:
        yield
    except CertKVError as exc:
        fail(str(exc))


def fail(message: str) -> None:
    from rich.markup import escape

    Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    raise typer.Exit(2)


def device(name: str):
    """``--device`` (``auto``: CUDA where there is one, else CPU) -> a torch device; CUDA
    asked of a machine without it is one sentence."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        fail("--device cuda needs a CUDA GPU, which this machine lacks; use --device cpu.")
    return torch.device(name)


def command() -> str:
    """The command line as typed (a report records it)."""
    return "certkv " + " ".join(sys.argv[1:])
