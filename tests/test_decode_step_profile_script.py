"""scripts/decode_step_profile.py: a whole decode step split into the model's parts and the
certified step's, dense and certified in one process (issue 55's in-model profile)."""

from __future__ import annotations

import json

import pytest
from helpers import script


def load():
    return script("decode_step_profile.py")


@pytest.mark.slow
def test_a_decode_profile_splits_both_methods_steps_and_writes_its_report(tmp_path):
    """Every part is timed where the model calls it: the parts nest (the compiled call inside
    the certified step, inside the attention function, inside the attention modules), dense
    has no certified step, and the report names command, parts and ratio."""
    pytest.importorskip("numba")
    load().main(["--context", "120", "--steps", "2", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "decode_step_profile.json").read_text())
    (r,) = data["results"]
    dense, cert = r["dense"], r["certified"]
    assert r["context"] == 120 and r["steps"] == 2
    for m in (dense, cert):
        assert m["mlp"] > 0 and 0 < m["attention_function"] < m["attention_module"]
        assert m["mlp"] + m["attention_module"] < m["step"]
    assert dense["certified_step"] == dense["compiled_call"] == dense["certificate_log"] == 0
    assert dense["fallback"] == 0 and cert["fallback"] < cert["certified_step"]
    assert 0 < cert["compiled_call"] < cert["certified_step"] < cert["attention_function"]
    assert min(cert["certificate_log"], cert["cache_update"], dense["cache_update"]) > 0
    text = (tmp_path / "decode_step_profile.md").read_text()
    assert text.startswith("# Where a whole decode step's time goes (smollm2_135m, ")
    assert "Command: `python scripts/decode_step_profile.py --context 120 --steps 2" in text
    assert "| N=120 dense: ms | % | N=120 certified: ms | % |" in text
    assert "N=120: certified / dense " in text


def test_a_decode_profile_refuses_an_empty_context_naming_the_fix(capsys):
    with pytest.raises(SystemExit):
        load().main(["--context", "0"])
    assert "e.g. --context 4096 --steps 48" in capsys.readouterr().err
