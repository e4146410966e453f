"""transformers' own QuantizedCache as a baseline (issue 57, ``mode: hf_quantized``): decoded by
transformers' and quanto's code after the shared dense prefill, recorded beside certkv's
methods on the same prompts, and one sentence where its package or settings are wrong."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from helpers.cli import TINY, run, run_dir_of
from transformers import QuantizedCache

from certkv.errors import ConfigError
from certkv.eval import hf_quantized
from certkv.eval.decode import Method, Prefill
from certkv.eval.hf_quantized import HFQuantized
from certkv.models.loading import ModelSpec, load_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("optimum") is None,
                                reason="optimum-quanto is not installed")


@pytest.fixture(scope="module")
def lm():
    return load_model(ModelSpec(name="tiny_random", random_config={
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "max_position_embeddings": 512}, dtype="float32", device="cpu"))


def test_an_hf_quantized_method_decodes_with_transformers_quantized_cache(lm):
    ids = list(range(5, 200))
    shared = Prefill(lm, ids[:-1])
    dense = shared.session(Method.build("dense", "dense")).decoder()
    hf4 = shared.session(Method.build("hf4", "hf_quantized",
                                      hf_cache=HFQuantized(nbits=4, q_group_size=32,
                                                           residual_length=8))).decoder()
    assert isinstance(hf4.cache, QuantizedCache) and hf4.cache.get_seq_length() == len(ids) - 1
    first_dense, first_hf = dense.step(ids[-1]), hf4.step(ids[-1])
    # the prefill's keys and values were quantized: the first step already reads them
    assert not torch.equal(first_dense, first_hf)
    assert torch.allclose(first_dense.softmax(-1), first_hf.softmax(-1), atol=0.05)
    for token in range(10, 20):  # past the residual window: transformers re-quantizes
        hf4.step(token)
    assert hf4.cache.get_seq_length() == len(ids) + 10
    assert hf4.cache_telemetry() is None  # nothing certified, nothing recorded


@pytest.mark.parametrize(("nbits", "ratio"), [(4, 0.375), (2, 0.25)])
def test_quanto_cache_bytes_are_packed_codes_and_fp32_scales(lm, nbits, ratio):
    """4096 tokens of an FP32 model: b/8 bytes of codes per element plus an FP32 scale and
    shift per group of 32 (0.25 bytes per element), against FP16's 2 bytes."""
    states = [(torch.randn(1, 2, 4096, 32), torch.randn(1, 2, 4096, 32))] * 2
    cache = HFQuantized(nbits=nbits, q_group_size=32).cache(lm.model.config, states)
    held, dense = hf_quantized.quantized_bytes(cache)
    assert dense == 2 * 2 * 2 * 4096 * 32 * 2 and held / dense == pytest.approx(ratio)


def test_graphs_leave_transformers_cache_uncaptured():
    from certkv.graphs import GraphedAttention

    method = Method.build("hf4", "hf_quantized", graphs=True)
    assert not isinstance(method.attention, GraphedAttention)
    assert method.attention.mode == "dense"  # the model's own attention reads the cache


def test_bad_hf_cache_settings_are_one_sentence_naming_the_fix():
    with pytest.raises(ConfigError, match="backend='bnb' is unknown"):
        HFQuantized(backend="bnb")
    with pytest.raises(ConfigError, match=r"nbits=3 is not a width the quanto backend takes"):
        HFQuantized(nbits=3)
    with pytest.raises(ConfigError, match="unknown keys \\['bits'\\]"):
        HFQuantized.from_config({"bits": 4})
    with pytest.raises(ConfigError, match="residual_length=0 must be a positive integer"):
        HFQuantized(residual_length=0)


def test_a_missing_backend_package_is_one_sentence_naming_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(hf_quantized.importlib.util, "find_spec",
                        lambda name: None if name == "optimum" else real(name))
    with pytest.raises(ConfigError, match=r"pip install 'certkv\[hf-quantized\]'"):
        Method.build("hf4", "hf_quantized")


def test_a_run_records_the_hf_baseline_beside_certkvs_methods(tmp_path):
    variants = ("variants=[{name: dense, mode: dense}, {name: kivi4-naive, mode: naive, "
                "quantizer: ${option:quantizer,kivi4}}, {name: hf-quanto4, mode: hf_quantized, "
                "hf_cache: {nbits: 4, q_group_size: 32}}]")
    result = run(*TINY, "task.niah.batch_size=2", variants, f"out_dir={tmp_path}")
    assert result.exit_code == 0, result.output
    run_dir = run_dir_of(tmp_path / "tiny")
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().split("\n")
               if line]
    mine = [r for r in records if r["variant"] == "hf-quanto4"]
    assert mine and {r["task"] for r in mine} == {r["task"] for r in records}
    config = (run_dir / "config.yaml").read_text()  # what a resumed run is checked against
    assert "mode: hf_quantized" in config and "q_group_size: 32" in config
    readme = (run_dir / "README.md").read_text()
    assert "hf-quanto4" in readme
