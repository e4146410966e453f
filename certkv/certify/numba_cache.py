"""numba's on-disk cache of certkv's kernels, kept only while every certkv source file is the same.

numba keys a cached function by its own source file's time and size, so a kernel whose file did
not change keeps the machine code it was compiled with, including the code of the kernels it
calls from other files, inlined: after an upgrade or an edit of ``numba_backend.py``, the
cached ``numba_step._step`` would still run the old Phase 2. :func:`install` puts a locator in
front of numba's own for the functions of this package only: the same cache directories, with
a stamp that also holds a digest of every ``.py`` file of the package, so any change to any of
them compiles every kernel again (once; the new code is cached).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # certkv/


@lru_cache(maxsize=4)
def sources_digest(root: Path = PACKAGE) -> str:
    """A digest of the Python sources under ``root`` (their paths and bytes; the package's by
    default)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _in_package(py_file: str) -> bool:
    try:
        return Path(py_file).resolve().is_relative_to(PACKAGE)
    except OSError:
        return False


def _stamped(base: type) -> type:
    """``base`` (one of numba's locators), for this package's functions only, stamped with
    :func:`sources_digest` besides the function's own file."""

    class Locator(base):
        def get_source_stamp(self):
            return super().get_source_stamp(), sources_digest()

        @classmethod
        def from_function(cls, py_func, py_file):
            return super().from_function(py_func, py_file) if _in_package(py_file) else None

    Locator.__name__ = Locator.__qualname__ = f"Certkv{base.__name__}"
    return Locator


def is_cached(dispatcher) -> bool:
    """Whether numba's cache holds code of the kernel ``dispatcher`` compiled from the current
    sources (its index read with the stamp of :func:`install`'s locators; False for any
    dispatcher without a cache, or a numba whose cache cannot say)."""
    try:
        return bool(dispatcher._cache._cache_file._load_index())
    except (AttributeError, OSError, EOFError, TypeError, ValueError):
        return False


def install(numba_module) -> bool:
    """Put the stamped locators first in numba's list (once); False where this numba's cache
    has no such list (its own locators then stay, as before)."""
    caching = getattr(getattr(numba_module, "core", None), "caching", None)
    impl = getattr(caching, "CacheImpl", None)
    classes = getattr(impl, "_locator_classes", None)
    if not isinstance(classes, list):
        return False
    if any(c.__name__.startswith("Certkv") for c in classes):
        return True
    names = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")
    ours = [_stamped(getattr(caching, name)) for name in names if hasattr(caching, name)]
    classes[:0] = ours
    return bool(ours)
