"""numba's cache of certkv's kernels is keyed by every certkv source
(:mod:`certkv.certify.numba_cache`): a cached kernel that calls a changed kernel of another file
is compiled again."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from certkv.certify import fused_cpu, numba_cache

numba = pytest.importorskip("numba")


def _locator(dispatcher):
    return dispatcher._cache._impl.locator


def test_certkv_kernels_are_stamped_with_every_source_of_the_package():
    """A kernel whose own file did not change (``numba_step._step``) is still stamped with the
    digest of the whole package, so a change in a kernel it calls invalidates it."""
    from certkv.kernels import numba_step

    locator = _locator(numba_step._step)
    assert type(locator).__name__.startswith("Certkv")
    own, digest = locator.get_source_stamp()
    assert digest == numba_cache.sources_digest()
    assert own == type(locator).__mro__[1].get_source_stamp(locator)  # numba's stamp kept


def test_functions_outside_the_package_keep_numbas_locators(tmp_path, monkeypatch):
    """Only certkv's functions get the stamped locators: another module cached beside its own
    file keeps numba's in-tree locator."""
    module = tmp_path / "outside_kernel.py"
    module.write_text("import numba\n\n@numba.njit(cache=True)\ndef f(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import outside_kernel

    assert outside_kernel.f(1) == 2
    assert not type(_locator(outside_kernel.f)).__name__.startswith("Certkv")


def test_the_digest_changes_with_any_source_file(tmp_path):
    """Editing, adding or renaming one file of a copy of the package changes its digest."""
    root = tmp_path / "pkg"
    shutil.copytree(numba_cache.PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    first = numba_cache.sources_digest(root)
    assert first == numba_cache.sources_digest.__wrapped__(numba_cache.PACKAGE)
    target: Path = root / "kernels" / "numba_backend.py"
    target.write_text(target.read_text() + "\n# edited\n")
    edited = numba_cache.sources_digest.__wrapped__(root)
    (root / "kernels" / "new_kernel.py").write_text("")
    added = numba_cache.sources_digest.__wrapped__(root)
    assert len({first, edited, added}) == 3


def test_install_is_idempotent():
    """Installing again (every import of the module does) adds no second set of locators."""
    classes = numba.core.caching.CacheImpl._locator_classes
    count = len(classes)
    assert numba_cache.install(numba) and fused_cpu.AVAILABLE
    assert len(classes) == count
    assert sum(c.__name__.startswith("Certkv") for c in classes) == 3
