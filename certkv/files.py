"""Small file helpers shared by results, corpora and model caching."""

from __future__ import annotations

import itertools
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks, a directory is not guarded
    fcntl = None


def data_dir() -> Path:
    """Where certkv caches converted models and corpora: ``$CERTKV_DATA`` or ``~/.cache/certkv``."""
    return Path(os.environ.get("CERTKV_DATA") or Path.home() / ".cache" / "certkv")


def below_cwd(path: str | Path) -> Path:
    """``path`` relative to the working directory where it lies below it, else as given (a
    shorter path to print or paste)."""
    path, cwd = Path(path), Path.cwd()
    return path.relative_to(cwd) if path.is_absolute() and cwd in path.parents else path


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write ``text`` (UTF-8, or bytes as they are) to ``path`` via a temporary file in the
    same folder and a rename, so readers never see a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with (os.fdopen(fd, "wb") if isinstance(text, bytes)
              else os.fdopen(fd, "w", encoding="utf-8")) as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def writable_dir(path: str | Path, fix: str) -> Path:
    """``path`` as a directory this process can write (created if missing), else a
    :class:`~certkv.errors.CertKVError` whose one sentence names ``fix`` (e.g. ``"--out DIR"``).
    Checked before any work starts, so nothing computed is lost to a read-only target."""
    from certkv.errors import CertKVError

    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".certkv-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise CertKVError(f"cannot write to {path} ({reason.lower()}); choose a writable "
                          f"directory with {fix}.") from None
    return path


def fresh_dir(path: str | Path) -> Path:
    """Create and return ``path`` (``path-2``, ``path-3``, ... when taken): always a new
    directory, so a command never replaces an earlier one's files (created atomically, so two
    processes never get the same one)."""
    path = Path(path)
    for n in itertools.count(1):
        candidate = path if n == 1 else path.with_name(f"{path.name}-{n}")
        try:
            candidate.mkdir(parents=True)
        except FileExistsError:
            continue
        return candidate
    raise AssertionError("unreachable")


@contextmanager
def exclusive_dir(path: str | Path, fix: str):
    """Hold ``path`` (created if missing) for this process while the block runs: a second
    process asking for it gets a :class:`~certkv.errors.CertKVError` naming the holder's pid
    and ``fix``, instead of writing records beside the first one's. An advisory lock on
    ``path/.lock`` (``flock``): the system releases it when the holder exits, killed or not."""
    from certkv.errors import CertKVError

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / ".lock", "a+", encoding="utf-8") as f:
        if fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "unknown"
                raise CertKVError(f"another certkv process (pid {holder}) is writing {path}; "
                                  f"wait for it to finish or {fix}.") from None
            f.truncate(0)
            f.write(str(os.getpid()))
            f.flush()
        yield path
