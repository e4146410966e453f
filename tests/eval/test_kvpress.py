"""NVIDIA kvpress's presses as baselines (issue 57, ``mode: kvpress``): a run asks kvpress's own
process for the answers through files in the run directory, a rerun scores and records them
beside certkv's methods on the same prompts, and bad settings are one sentence.

kvpress itself pins a transformers certkv cannot share, so it is not installed here: the
kvpress side (``scripts/kvpress/run_presses.py``) runs in this process with a stand-in for the
``kvpress`` package whose press keeps the newest tokens of each layer (what a press's forward
hook does to the cache); kvpress's real run is the committed evict report's."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from helpers import script
from helpers.cli import TINY, run, run_dir_of

from certkv.errors import ConfigError
from certkv.eval.decode import Method
from certkv.eval.kvpress_exchange import Exchange, read_lines
from certkv.eval.press import KVPress
from certkv.models.loading import load_model

ROOT = Path(__file__).resolve().parents[2]


def presses_script():
    """``scripts/kvpress/run_presses.py`` as a module (it is a script of kvpress's venv)."""
    return script("kvpress/run_presses.py")


class NewestPress:
    """A stand-in press: after the prefill, each layer keeps its newest ``1 - ratio`` of the
    prompt's tokens (a forward hook on the model's base, as kvpress's presses hook layers)."""

    def __init__(self, compression_ratio: float = 0.0, **options) -> None:
        self.ratio, self.options = compression_ratio, options

    def __call__(self, model):
        def cut(module, args, kwargs, output):
            cache = kwargs["past_key_values"]
            for layer in cache.layers:
                n = layer.keys.shape[2]
                keep = n - int(n * self.ratio)
                layer.keys, layer.values = layer.keys[:, :, -keep:], layer.values[:, :, -keep:]

        class Hooked:
            def __enter__(self):
                self.handle = model.model.register_forward_hook(cut, with_kwargs=True)

            def __exit__(self, *exc):
                self.handle.remove()

        return Hooked()


@pytest.fixture
def fake_kvpress(monkeypatch):
    module = types.ModuleType("kvpress")
    module.NewestPress = NewestPress
    monkeypatch.setitem(sys.modules, "kvpress", module)
    return module


VARIANTS = ("variants=[{name: dense, mode: dense}, {name: kp-none, mode: kvpress, press: "
            "{press: NewestPress, compression_ratio: 0.0}}, {name: kp-half, mode: kvpress, "
            "press: {press: NewestPress, compression_ratio: 0.5, options: {window_size: 4}}}]")


def _records(run_dir: Path) -> dict:
    return {(r["task"], r["sample"], r["variant"]): r
            for r in read_lines(run_dir / "samples.jsonl")}


def test_a_run_asks_kvpress_then_records_its_answers_on_the_same_prompts(tmp_path,
                                                                          fake_kvpress):
    first = run(*TINY, VARIANTS, f"out_dir={tmp_path}")
    assert first.exit_code == 0, first.output
    run_dir = run_dir_of(tmp_path / "tiny")
    assert "kvpress record(s) wait for kvpress's own run: bash scripts/kvpress/run.sh" \
        in " ".join(first.output.split())
    assert {v for _, _, v in _records(run_dir)} == {"dense"}  # nothing made up meanwhile
    asked = read_lines(run_dir / "kvpress/requests.jsonl")
    dense_keys = {(t, s) for t, s, _ in _records(run_dir)}
    assert {(r["key"].split("/")[0], int(r["key"].split("/")[1])) for r in asked} == dense_keys
    assert len(read_lines(run_dir / "kvpress/prompts.jsonl")) == len(dense_keys)  # shared

    script = presses_script()
    job = json.loads((run_dir / "kvpress/job.json").read_text())
    model = load_model(job["model"]).model  # the run's model, weights and all
    assert script.run(run_dir, model=model, log=lambda _: None) == len(asked)
    assert script.run(run_dir, model=model, log=lambda _: None) == 0  # a rerun resumes

    again = run(*TINY, VARIANTS, f"out_dir={tmp_path}")
    assert again.exit_code == 0, again.output
    assert "wait for kvpress" not in again.output
    records = _records(run_dir)
    for (task, sample, variant), record in records.items():
        if variant != "kp-none":
            continue
        dense = records[(task, sample, "dense")]
        assert record["mode"] == "kvpress" and record["external"]["transformers"]
        if task == "perplexity":  # no compression: dense's log-probabilities
            assert record["nll"] == pytest.approx(dense["nll"], rel=1e-5)
        else:
            assert record["generated"] == dense["generated"]
    certs = {(c["task"], c["sample"], c["variant"]): c
             for c in read_lines(run_dir / "certificates.jsonl")}
    kept = [c["tier1_over_dense"] for k, c in certs.items() if k[2] == "kp-half"]
    assert kept and all(0.49 <= x <= 0.51 for x in kept)  # half the prompt's tokens kept
    readme = (run_dir / "README.md").read_text()
    eviction = readme[readme.index("## Eviction"):]
    assert "| kp-half | kvpress Newest | 50% |" in eviction


def test_a_compressed_prompt_decodes_every_token_at_its_true_position(fake_kvpress):
    """The script's decode over a press's cache equals the model's own steps over the same
    kept keys and values with the tokens at positions len(prompt), len(prompt) + 1, ...
    (not at the compressed cache's length), and a request's tokens leave the cache after it."""
    from transformers import DynamicCache

    from certkv.models.loading import ModelSpec

    script = presses_script()
    lm = load_model(ModelSpec(name="tiny", random_config={
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "max_position_embeddings": 512}, dtype="float32", device="cpu"))
    prompt = list(range(5, 105))
    cache = script.compress(lm.model, prompt, NewestPress(0.75))
    assert script._lengths(cache) == [25, 25]
    request = {"feed": [7, 8], "first": 9, "max_new_tokens": 0, "target": [10, 11, 12]}
    got = script.answer(lm.model, cache, len(prompt), request, set())
    assert script._lengths(cache) == [25, 25]  # the answer was cut off again

    with torch.inference_mode():
        full = DynamicCache()
        lm.model(input_ids=torch.tensor([prompt]), past_key_values=full)
        for layer in full.layers:
            layer.keys, layer.values = layer.keys[:, :, -25:], layer.values[:, :, -25:]
        tokens = [7, 8, 9, 10, 11]
        logits = lm.model(input_ids=torch.tensor([tokens]), past_key_values=full,
                          position_ids=torch.arange(100, 105)[None]).logits[0, 2:].float()
    want = [float(torch.log_softmax(row, -1)[t]) for row, t in zip(logits, [10, 11, 12],
                                                                     strict=True)]
    assert got["logprobs"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert len(got["step_ms"]) == 3


def test_an_unknown_press_or_missing_job_is_one_sentence(tmp_path, fake_kvpress):
    script = presses_script()
    with pytest.raises(script.JobError, match="has no press 'NewestPres'; use one of "
                                              r"\['NewestPress'\]"):
        script.make_press({"press": "NewestPres", "compression_ratio": 0.5, "options": {}})
    with pytest.raises(script.JobError, match="does not take these settings"):
        script.make_press({"press": "NewestPress", "compression_ratio": 0.5,
                           "options": {"compression_ratio": 1}})
    with pytest.raises(script.JobError, match="run `certkv run` with a mode: kvpress variant"):
        script.run(tmp_path)
    assert script.main([str(tmp_path)]) == 2
    with pytest.raises(script.JobError, match="randomly initialised"):
        script.load_model({"random_config": {"model_type": "llama"}})


def test_bad_press_settings_are_one_sentence_naming_the_fix():
    with pytest.raises(ConfigError, match=r"press\.press='snapkv' is not a kvpress class name"):
        KVPress(press="snapkv")
    with pytest.raises(ConfigError, match=r"compression_ratio=1.0 must lie in \[0, 1\)"):
        KVPress(compression_ratio=1.0)
    with pytest.raises(ConfigError, match="press has unknown keys \\['window_size'\\]"):
        KVPress.from_config({"window_size": 32})
    with pytest.raises(ConfigError, match="must map the press's argument names"):
        KVPress(options={"window_size": [32]})
    with pytest.raises(ConfigError, match="runs in kvpress's own venv"):
        from certkv.eval.decode import Prefill

        Prefill.cache_for(None, Method.build("kp", "kvpress"))


def test_a_torn_last_answer_line_is_left_for_the_rerun(tmp_path):
    folder = tmp_path / "kvpress"
    folder.mkdir()
    (folder / "answers.jsonl").write_text('{"key": "niah/0/kp"}\n{"key": "niah/1')
    assert list(Exchange(tmp_path).answers) == ["niah/0/kp"]
    (folder / "answers.jsonl").write_text('{"key": "niah/0\n{"key": "niah/1/kp"}\n')
    with pytest.raises(ConfigError, match="line 1 is not JSON; remove it"):
        Exchange(tmp_path)


def test_the_kvpress_script_names_its_argument_before_making_a_venv(tmp_path):
    import subprocess

    script = ROOT / "scripts/kvpress/run.sh"
    for args in ([], [str(tmp_path)]):
        done = subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin", "KVPRESS_VENV": str(tmp_path / "v")})
        assert done.returncode == 2
        assert "usage: bash scripts/kvpress/run.sh RUN_DIR" in done.stderr
    assert not (tmp_path / "v").exists()
