"""scripts/cpu_step_profile.py: the CPU layer step split into the kernels of its compiled call
(issue 55's profile)."""

from __future__ import annotations

import json
import re
import types

import pytest
from helpers import script

from certkv.kernels import numba_step


def load():
    return script("cpu_step_profile.py")


def test_the_profile_names_every_kernel_the_compiled_step_calls():
    """A kernel added to the step without joining KERNELS would go untimed: every jitted
    function the step's body calls through a module is listed."""
    mod = load()
    body = numba_step._step.py_func.__code__.co_names
    listed = {name for _, name, _ in mod.KERNELS}
    modules = {v for v in vars(numba_step).values() if isinstance(v, types.ModuleType)}
    for module in modules:
        jitted = {n for n in body if hasattr(getattr(module, n, None), "py_func")}
        assert jitted <= listed, f"untimed kernels of {module.__name__}: {jitted - listed}"


def test_a_profile_times_each_kernel_once_per_step_and_writes_its_report(tmp_path):
    pytest.importorskip("numba")
    load().main(["--context", "200", "--context", "260", "--repeats", "2", "--out",
                 str(tmp_path)])
    data = json.loads((tmp_path / "cpu_step_profile.json").read_text())
    assert [r["case"]["context"] for r in data["results"]] == [200, 260]
    for r in data["results"]:
        assert set(r["calls"].values()) == {1}  # each kernel once per step
        assert min(r["kernels"].values()) > 0 and r["ms"]["compiled"] > 0
    text = (tmp_path / "cpu_step_profile.md").read_text()
    assert text.startswith("# Where a CPU layer step's time goes (d = 64, 9 query / 3 kv "
                           "heads; synthetic keys)")
    assert "Command: `python scripts/cpu_step_profile.py --context 200 --context 260" in text
    rows = [line for line in text.splitlines() if line.startswith("| kernel: ")]
    assert len(rows) == len(load().KERNELS)
    assert all(re.fullmatch(r"\| kernel: [^|]+( \| \d+\.\d{3} \| \d+){2} \|", r) for r in rows)


@pytest.mark.slow
def test_a_profile_of_a_models_own_layer_says_what_the_step_read_in_fp16(tmp_path):
    """``--model smollm2_135m``: the layer's own query, keys and values after a dense prefill
    of a book's text; the report says so and how many blocks the step read in FP16."""
    pytest.importorskip("numba")
    load().main(["--context", "300", "--repeats", "2", "--model", "smollm2_135m", "--layer",
                 "3", "--out", str(tmp_path)])
    (r,) = json.loads((tmp_path / "cpu_step_profile.json").read_text())["results"]
    assert r["data"] == "smollm2_135m layer 3" and r["case"]["kv_heads"] == 3
    assert 0 < r["fp16_keys"] <= 1 and 0 <= r["fp16_values"] <= 1
    text = (tmp_path / "cpu_step_profile.md").read_text()
    assert "smollm2_135m layer 3" in text and "FP16 keys read for" in text
