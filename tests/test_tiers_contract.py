"""The certificate contract over mixed-precision stores (issue 20): KIVI with exact residual and
sink windows, seed 004's tiers with every archive (2-bit KIVI, rotation, 3-bit pre-RoPE keys
with dense-and-sparse values), blocks demoted mid-decode, early graduation under a budget.

Every head of every step: ``||out - O_ref||_2 <= e_key + e_val + e_arith`` against FP64
attention on the FP16 originals, with no allowance but the reference's own rounding
(:func:`helpers.check_heads`). Inputs are adversarial as in ``test_contract``.
"""

from __future__ import annotations

import warnings

import pytest
from helpers import check_heads, check_steps, examples, make_kv, make_query, step_draws
from helpers.contract import OwnDecodeValues, archives
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from certkv import CertifiedAttention
from certkv.cache.store import TieredKVStore
from certkv.errors import BudgetError
from certkv.kernels.reference import TorchBackend
from certkv.kernels.triton_backend import TritonBackend, triton_available
from certkv.quant import (
    GroupAffineValueCodec,
    KiviKeyCodec,
    KVQuantizer,
    Precision,
    TieredQuantizer,
)
from certkv.quant.rope import RopeSpec

D = 32


def quantizer(sc) -> KVQuantizer:
    block, group = sc["block"], sc["group_size"]
    if sc["kind"] == "kivi":
        q = KVQuantizer(KiviKeyCodec(bits=sc["bits"]),
                        GroupAffineValueCodec(bits=sc["bits"], group=group), block,
                        residual=sc["residual"], sink=sc["sink"])
    else:
        q = TieredQuantizer(KiviKeyCodec(bits=4), GroupAffineValueCodec(bits=4, group=group),
                            block, sink=sc["sink"], hot=sc["hot"], stale=sc["hot"] + sc["warm"],
                            archive=sc["archive"], mid_from=48, long_from=96,
                            archives=archives(group, sc["key_mode"]))
    return q.with_rope(RopeSpec.from_theta(10000.0, D))


@st.composite
def scenarios(draw):
    return {
        "kind": draw(st.sampled_from(["kivi", "tiers", "tiers"])),
        "bits": draw(st.sampled_from([2, 3, 4])),
        "block": draw(st.sampled_from([4, 8, 16])),
        "group_size": draw(st.sampled_from([8, 16, 32])),
        "residual": draw(st.sampled_from([0, 8, 32])),
        "sink": draw(st.sampled_from([0, 0, 4, 16])),
        "hot": draw(st.sampled_from([0, 8, 16])),
        "warm": draw(st.sampled_from([0, 16, 32])),
        "archive": draw(st.sampled_from(["auto", "auto", "kivi2", "rotation", "kvquant"])),
        "key_mode": draw(st.sampled_from(["pre_rope", "post_rope"])),
        **step_draws(draw, 140, [1, 7, 20]),
    }


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_contract_over_mixed_precision_stores(sc):
    store = TieredKVStore(sc["hkv"], D, block_size=sc["block"], quantizer=quantizer(sc),
                          decoded_mirror=sc["seed"] % 2 == 0)
    k, v = make_kv(sc["hkv"], sc["tokens"], D, seed=sc["seed"],
                   outlier_channels=sc["outliers"], heavy_tail=sc["heavy_tail"],
                   key_offset=sc["key_offset"])
    check_steps(store, CertifiedAttention(backend=TorchBackend()), k, v, sc)


def covered(sc) -> dict:
    """``sc`` on small shapes for the interpreter, its archive by the seed: the 2-bit KIVI
    one, the Hadamard-rotated one (whose rotation the kernels run as a matmul of tiles of at
    least 16) or KVQuant's (pre- or post-RoPE 3-bit keys, dense-and-sparse values)."""
    archive = ("kivi2", "rotation", "kvquant")[sc["seed"] % 3]
    return {**sc, "bits": 2 if sc["bits"] == 3 else sc["bits"], "archive": archive,
            "block": 16 if archive == "rotation" else sc["block"],
            "tokens": min(sc["tokens"], 90), "steps": min(sc["steps"], 2),
            "q_dtype": "float16" if sc["q_dtype"] == "bfloat16" else sc["q_dtype"]}


def check_mixed_triton_contract(sc, device):
    """Windows, demotions mid-decode and every warm/archive mix through the kernels (one
    launch per precision), never the reference they could fall back to."""
    store = TieredKVStore(sc["hkv"], D, block_size=sc["block"], quantizer=quantizer(sc),
                          device=device)
    k, v = make_kv(sc["hkv"], sc["tokens"], D, seed=sc["seed"],
                   outlier_channels=sc["outliers"], heavy_tail=sc["heavy_tail"],
                   key_offset=sc["key_offset"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_steps(store, CertifiedAttention(backend=TritonBackend(split=2)), k, v, sc)
    assert not [w for w in caught if "PyTorch reference" in str(w.message)]  # no fallback


@pytest.mark.skipif(not triton_available(), reason="needs triton (TRITON_INTERPRET=1 on CPU)")
@settings(max_examples=examples(5), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios().map(covered))
def test_contract_over_mixed_stores_with_the_triton_kernels(sc):
    check_mixed_triton_contract(sc, "cpu")


@pytest.mark.gpu
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios().map(lambda sc: {**covered(sc), "tokens": sc["tokens"], "steps": sc["steps"]}))
def test_contract_over_mixed_stores_with_the_compiled_kernels(sc):
    """The same on CUDA, compiled (what the interpreter accepts the compiler may not), at the
    scenarios' full prompt lengths and decode rounds."""
    check_mixed_triton_contract(sc, "cuda")


@pytest.mark.skipif(not triton_available(), reason="needs triton (TRITON_INTERPRET=1 on CPU)")
def test_triton_backend_falls_back_on_an_archive_it_does_not_read():
    """An archive whose value codec decodes in its own way (a subclass) is not read by the
    kernels: a store holding it runs Phase 2 on the reference (one notice) and still
    certifies every head."""
    sc = {"kind": "tiers", "block": 8, "group_size": 8, "sink": 4, "hot": 8, "warm": 16,
          "archive": "kvquant", "key_mode": "pre_rope", "tokens": 100, "steps": 2,
          "per_step": 9, "gqa": 2, "q_scale": 1.0, "peaked": True, "q_dtype": "float16",
          "seed": 3}
    q = quantizer(sc)
    keys = q.archives["kvquant"].key_codec
    q.archives["kvquant"] = Precision(keys, OwnDecodeValues(bits=3, group=8))
    assert OwnDecodeValues(bits=3, group=8).kernel_layout(D) is None
    store = TieredKVStore(2, D, block_size=8, quantizer=q)
    k, v = make_kv(2, 100, D, seed=3, outlier_channels=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_steps(store, CertifiedAttention(backend=TritonBackend()), k, v, sc)
    assert any("PyTorch reference" in str(w.message) for w in caught)


def test_budget_graduates_the_oldest_blocks_early_and_is_never_exceeded():
    q = TieredQuantizer(KiviKeyCodec(bits=4), GroupAffineValueCodec(bits=4, group=8), 8,
                        hot=16, stale=10_000, archive="kivi2", archives=archives(8, "post_rope"))
    free = TieredKVStore(2, D, quantizer=q, block_size=8)
    k, v = make_kv(2, 400, D, seed=5)
    free.append(k, v)
    budget = int(free.tier1_bytes() * 0.85)  # 2-bit blocks take 3/4 of 4-bit ones here
    q.budget_bytes = budget
    store = TieredKVStore(2, D, quantizer=q, block_size=8)
    attn = CertifiedAttention(backend=TorchBackend())
    for start in range(0, 400, 25):
        store.append(k[:, start:start + 25], v[:, start:start + 25])
        assert store.tier1_bytes() <= budget
        qv = make_query(k[:, :start + 25], 2, seed=start)
        check_heads(*attn(qv, store), qv, store)
    stages = store.stages.stage
    assert (stages == 2).any() and (stages[:-3] == 2).all()  # the oldest went to the archive
    q.budget_bytes = 100
    with pytest.raises(BudgetError, match="raise the budget"):
        TieredKVStore(2, D, quantizer=q, block_size=8).append(k, v)
