"""certkv.eval.results: a run's records, packed or not (committed runs keep their certificate
records gzipped; ``scripts/pack_runs.py``)."""

from __future__ import annotations

from helpers import script

from certkv.eval.results import RunDir, packed, read_jsonl


def record(i: int, variant: str = "certified") -> tuple[dict, dict]:
    sample = {"task": "perplexity", "sample": i, "variant": variant, "ppl": 30.0 + i}
    return sample, {**sample, "e_key_mean": 0.01 * i}


def filled(root, n: int) -> RunDir:
    run = RunDir(root)
    for i in range(n):
        run.add(*record(i))
    return run


def test_a_packed_run_reads_the_same_records_and_packs_to_the_same_bytes(tmp_path):
    a, b = filled(tmp_path / "a", 3), filled(tmp_path / "b", 3)
    plain = read_jsonl(a.root / RunDir.CERTIFICATES)
    count, saved = script("pack_runs.py").pack_runs([tmp_path])
    assert count == 2 and saved > 0
    for run in (a, b):
        assert not (run.root / RunDir.CERTIFICATES).exists()
        assert read_jsonl(run.root / RunDir.CERTIFICATES) == plain
    gz = [packed(run.root / RunDir.CERTIFICATES).read_bytes() for run in (a, b)]
    assert gz[0] == gz[1]  # no file name or time in the header: the same records, the same bytes


def test_a_resumed_packed_run_skips_its_records_and_writes_them_all_plain(tmp_path):
    filled(tmp_path, 2)
    script("pack_runs.py").pack_runs([tmp_path])
    run = RunDir(tmp_path)
    assert run.done("perplexity", 1, "certified") and len(run.certificates) == 2
    run.add(*record(2))
    assert not packed(tmp_path / RunDir.CERTIFICATES).exists()  # no stale copy left to mix
    assert [c["sample"] for c in read_jsonl(tmp_path / RunDir.CERTIFICATES)] == [0, 1, 2]
