"""Pack the certificate records of committed runs: every ``certificates.jsonl`` under the given
folders becomes ``certificates.jsonl.gz`` (:func:`certkv.eval.results.pack`; about a third of
the bytes, the same bytes for the same records). ``certkv report``, the committed-report tests
and a resumed run read either; a resumed run writes the plain file again.

    .venv/bin/python scripts/pack_runs.py reports
"""

from __future__ import annotations

import sys
from pathlib import Path

from certkv.eval.results import RunDir, pack


def pack_runs(roots: list[Path]) -> tuple[int, int]:
    """Pack every run's certificate records under ``roots``; ``(files packed, bytes saved)``."""
    paths = sorted(p for root in roots for p in Path(root).rglob(RunDir.CERTIFICATES))
    return len(paths), sum(pack(path) for path in paths)


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("name the folders whose runs to pack, e.g. scripts/pack_runs.py reports")
    count, saved = pack_runs([Path(a) for a in argv])
    print(f"packed {count} certificates.jsonl, {saved / 2**20:.1f} MiB saved")


if __name__ == "__main__":
    main(sys.argv[1:])
