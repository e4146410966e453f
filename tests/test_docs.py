"""The documentation: a short front page, and a docs site that builds with no warning (its
commands are run by test_readme.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_is_a_front_page_linking_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name != "index.md":
            assert f"(docs/{page.name})" in readme, page.name


def test_the_docs_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: every page in the nav, no broken link or anchor warning, no
    docstring naming a parameter its function does not have; the API pages are the classes'
    own docstrings."""
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or "mkdocs"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    built = {p.parent.name for p in (tmp_path / "site").glob("*/index.html")}
    assert built >= {p.stem for p in (ROOT / "docs").glob("*.md") if p.name != "index.md"}
    api = tmp_path / "site" / "api"
    assert {p.parent.name for p in api.glob("*/index.html")} == {
        p.stem for p in (ROOT / "docs" / "api").glob("*.md") if p.name != "index.md"}
    attention = (api / "attention" / "index.html").read_text()
    assert "QuantizedStep" in attention and "Certified attention for one decode step" in attention
