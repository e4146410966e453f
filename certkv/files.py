"""Small file helpers shared by results, corpora and model caching."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def data_dir() -> Path:
    """Where certkv caches converted models and corpora: ``$CERTKV_DATA`` or ``~/.cache/certkv``."""
    return Path(os.environ.get("CERTKV_DATA") or Path.home() / ".cache" / "certkv")


def write_atomic(path: Path, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` via a temporary file in the same folder and a rename,
    so readers never see a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

