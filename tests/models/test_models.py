"""Model loading: clear sentences for missing models, random models of each architecture."""

from __future__ import annotations

import pytest

from certkv.errors import CertKVError, ConfigError
from certkv.models import load_model, loading

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}


def test_missing_local_path_names_the_fix(tmp_path):
    with pytest.raises(CertKVError, match="does not exist; point it at a model directory"):
        load_model({"name": "x", "path": str(tmp_path / "nope")})


def test_missing_weights_package_names_the_fix():
    with pytest.raises(CertKVError, match="run `make setup`"):
        load_model({"name": "x", "package": "certkv_no_such_weights", "gguf_file": "m.gguf"})


def test_unreachable_hub_id_names_the_offline_default():
    with pytest.raises(CertKVError, match="model=smollm2_135m"):
        load_model({"name": "x", "path": "certkv-test/definitely-not-a-model"})


def offline_hub(monkeypatch, reachable: bool) -> list[dict]:
    """The hub reachable or not (no connection tried); returns the kwargs every tokenizer
    load gets (each load then fails as an uncached model does)."""
    calls: list[dict] = []

    def tokenizer(path, **kwargs):
        calls.append(kwargs)
        raise OSError("not cached")

    loading.hub_unreachable.cache_clear()
    monkeypatch.setattr(loading, "_connects", lambda *a: reachable)
    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", tokenizer)
    for name in (*loading.PROXY_VARIABLES, "HF_HUB_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_a_hub_id_without_the_hub_reads_the_local_cache_and_says_why_it_failed(monkeypatch):
    calls = offline_hub(monkeypatch, reachable=False)
    with pytest.raises(CertKVError, match="hub cannot be reached from this machine and the "
                                          "model is not in its local cache; use model=smollm2"):
        load_model({"name": "x", "path": "certkv-test/definitely-not-a-model"})
    assert calls == [{"local_files_only": True}]  # no retries against a hub that is not there
    spec = loading.ModelSpec(name="x", path="certkv-test/definitely-not-a-model")
    assert loading._resolved_source(spec)[2] is None  # no converted copy: not a GGUF model
    loading.hub_unreachable.cache_clear()


def test_a_reachable_hub_or_a_proxy_leaves_the_hub_library_to_decide(monkeypatch):
    calls = offline_hub(monkeypatch, reachable=True)
    with pytest.raises(CertKVError, match="check the path, or the network"):
        load_model({"name": "x", "path": "certkv-test/definitely-not-a-model"})
    loading.hub_unreachable.cache_clear()
    monkeypatch.setattr(loading, "_connects", lambda *a: pytest.fail("tried behind a proxy"))
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    with pytest.raises(CertKVError, match="check the path, or the network"):
        load_model({"name": "x", "path": "certkv-test/definitely-not-a-model"})
    assert calls == [{}, {}]
    loading.hub_unreachable.cache_clear()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_random_models_use_the_certkv_attention(arch):
    lm = load_model({"name": "r", "random_config": {"model_type": arch, **SMALL}})
    assert lm.model.config._attn_implementation == "certkv"
    assert lm.num_layers == 1 and lm.tokenizer is not None


def test_bad_model_fields():
    with pytest.raises(ConfigError, match="model_type='gpt9' is unknown"):
        load_model({"name": "r", "random_config": {"model_type": "gpt9"}})
    with pytest.raises(ConfigError, match="dtype='float8' is unknown"):
        load_model({"name": "r", "dtype": "float8", "random_config": SMALL})


def test_context_longer_than_the_model_names_the_fix():
    from certkv.eval.tasks import NeedleTask, PerplexityTask, RulerTask

    for task in (PerplexityTask(context=10_000), NeedleTask(context=10_000),
                 RulerTask(context=10_000)):
        with pytest.raises(CertKVError, match=r"must lie in \[1, 8192\] \(the model's context"):
            task.samples(tokenizer=None, max_context=8192)


def test_device_map_is_handed_to_accelerate_and_the_model_stays_where_it_put_it(monkeypatch):
    """A model larger than one GPU (conf/model/llama31_70b.yaml) loads with device_map=auto;
    load_model then does not move it to one device, but still switches what accelerate placed
    to the certkv attention and to eval mode."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from certkv.models import loading

    seen = {}
    tiny = load_model({"name": "tiny", "random_config": {"hidden_size": 32,
                       "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "num_key_value_heads": 1}, "device": "cpu"})
    config = AutoConfig.for_model("llama", **SMALL, vocab_size=len(tiny.tokenizer))
    placed = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    assert placed.training and placed.config._attn_implementation == "sdpa"

    def fake(path, **kwargs):
        seen.update(kwargs)
        return placed

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake)
    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny.tokenizer)
    monkeypatch.setattr(torch.nn.Module, "to", lambda *a, **k: pytest.fail("moved"))
    lm = load_model({"name": "big", "path": "some/hub-id", "device_map": "auto"})
    assert seen["device_map"] == "auto" and seen["dtype"] == torch.float32
    assert lm.model is placed and lm.spec.device_map == "auto"
    assert lm.model.config._attn_implementation == "certkv" and not lm.model.training
    assert lm.num_layers == 1 and lm.tokenizer is tiny.tokenizer


def test_a_tokenizer_is_read_once_per_process_and_each_caller_gets_its_own_copy():
    from certkv.models import loading

    first = loading.load_tokenizer()
    second = loading.load_tokenizer()
    assert first is not second and first.get_vocab() == second.get_vocab()
    first.add_special_tokens({"pad_token": "<certkv-test-pad>"})  # a caller's change stays its own
    assert "<certkv-test-pad>" not in second.get_vocab()
    assert "<certkv-test-pad>" not in loading.load_tokenizer().get_vocab()
