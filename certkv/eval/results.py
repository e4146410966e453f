"""Run directory: resolved config, per-sample JSONL, certificate JSONL, summary JSON.

Every write is atomic (write a temporary file, then rename), so an interrupted run never leaves
a half-written file, and a rerun of the same command skips the samples already recorded.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from certkv.files import write_atomic


def packed(path: Path) -> Path:
    """Where :func:`pack` keeps ``path``'s records: ``<name>.gz`` beside it."""
    return path.with_name(path.name + ".gz")


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file, or of its packed copy (:func:`pack`) where only that
    exists; none where neither does."""
    if path.exists():
        text = path.read_text()
    elif packed(path).exists():
        text = gzip.decompress(packed(path).read_bytes()).decode()
    else:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def pack(path: Path) -> int:
    """Replace a JSONL file by its gzip copy ``<name>.gz`` (byte for byte the same for the same
    records: no name or time in the header), for committed runs, whose certificate records
    compress about three-fold; every reader of runs reads either. Returns the bytes saved."""
    data = path.read_bytes()
    gz = gzip.compress(data, compresslevel=9, mtime=0)
    write_atomic(packed(path), gz)
    os.remove(path)
    return len(data) - len(gz)


class RunDir:
    """The files of one run. Records are keyed by ``(task, sample, variant)``."""

    SAMPLES = "samples.jsonl"
    CERTIFICATES = "certificates.jsonl"
    HEADS = "certificate_heads.jsonl"
    SUMMARY = "summary.json"
    CONFIG = "config.yaml"
    META = "run.json"
    FAILED = "failed.json"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.samples = read_jsonl(self.root / self.SAMPLES)
        self.certificates = read_jsonl(self.root / self.CERTIFICATES)
        self._done = {self.key(r) for r in self.samples}

    @staticmethod
    def key(record: dict) -> tuple:
        return record["task"], record["sample"], record["variant"]

    def done(self, task: str, sample: int, variant: str) -> bool:
        return (task, sample, variant) in self._done

    def add(self, sample: dict, certificate: dict, heads: list[dict] | None = None) -> None:
        """Record one finished ``(task, sample, variant)``; rewrites the JSONL files atomically."""
        self.samples.append(sample)
        self.certificates.append(certificate)
        self._done.add(self.key(sample))
        self._write_jsonl(self.SAMPLES, self.samples)
        self._write_jsonl(self.CERTIFICATES, self.certificates)
        if heads:
            existing = read_jsonl(self.root / self.HEADS)
            self._write_jsonl(self.HEADS, existing + heads)

    def _write_jsonl(self, name: str, records: list[dict]) -> None:
        """Every record, atomically; a packed copy (read when this run resumed) goes, its
        records now in the plain file."""
        write_atomic(self.root / name, "".join(json.dumps(r) + "\n" for r in records))
        packed(self.root / name).unlink(missing_ok=True)

    def write_summary(self, summary: dict) -> None:
        write_atomic(self.root / self.SUMMARY, json.dumps(summary, indent=2) + "\n")

    def write_config(self, text: str) -> None:
        write_atomic(self.root / self.CONFIG, text)

    @classmethod
    def finished(cls, root: str | Path, config_text: str) -> bool:
        """Whether ``root`` already holds a complete run of exactly this resolved config (a
        sweep skips such points instead of reloading the model to find nothing to do)."""
        root = Path(root)
        if not (root / cls.SUMMARY).exists() or not (root / cls.CONFIG).exists():
            return False
        meta = json.loads((root / cls.META).read_text()) if (root / cls.META).exists() else {}
        complete = meta.get("records", -1) >= meta.get("planned", float("inf"))
        return complete and (root / cls.CONFIG).read_text() == config_text

    @classmethod
    def record_failure(cls, root: str | Path, message: str) -> None:
        """A point of a sweep that failed (e.g. validation): its directory says why."""
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        write_atomic(root / cls.FAILED, json.dumps({"error": message}, indent=2) + "\n")

    @classmethod
    def failure(cls, root: str | Path) -> str | None:
        path = Path(root) / cls.FAILED
        return json.loads(path.read_text())["error"] if path.exists() else None

    def read_meta(self) -> dict:
        path = self.root / self.META
        return json.loads(path.read_text()) if path.exists() else {}

    def start_session(self, env: dict) -> None:
        """Provenance of this (possibly resumed) session: ``env`` (commit, machine, threads,
        versions) becomes run.json's top level, and a session whose environment differs from
        the last one's is appended to ``sessions`` with the record it started at, so a run
        resumed on other code or another machine says which part each made."""
        earlier = self.read_meta()
        sessions = earlier.get("sessions") or (
            [{**{k: earlier[k] for k in env if k in earlier}, "from_record": 0}]
            if "commit" in earlier else [])
        if not sessions or {k: v for k, v in sessions[-1].items() if k != "from_record"} != env:
            sessions.append({**env, "from_record": len(self.samples)})
        self.write_meta({**env, "sessions": sessions})

    def write_meta(self, meta: dict) -> None:
        """Provenance of the run (command, commit, machine, threads, versions, wall time),
        merged into what earlier (resumed) sessions recorded."""
        write_atomic(self.root / self.META, json.dumps({**self.read_meta(), **meta}, indent=2)
                     + "\n")
