"""The contract property test's scenarios and checks, shared by the tests that run them on
other paths (numba, Triton, the fused CPU certificate, the ladder)."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from certkv import (
    AdaptiveTopK,
    CertifiedAttention,
    ChannelAffineKeyCodec,
    GreedyBudget,
    GroupAffineValueCodec,
    Ladder,
    LocalThreshold,
    TieredKVStore,
)
from certkv.kernels.numba_backend import NumbaBackend
from certkv.kernels.reference import TorchBackend
from certkv.quant import (
    KiviKeyCodec,
    OutlierValueCodec,
    Precision,
    PreRoPEKeyCodec,
    RotatedKeyCodec,
    RotatedValueCodec,
)
from helpers import check_heads, make_kv, make_query

BACKENDS = {"torch": TorchBackend, "numba": NumbaBackend}


class OwnDecodeValues(OutlierValueCodec):
    """Dense-and-sparse values with a decode of their own (the same numbers): a codec the
    kernels cannot know they understand (:func:`certkv.quant.layout.keeps`), so it claims no
    kernel layout and its blocks run on the PyTorch reference."""

    def decode(self, blocks):
        return super().decode(blocks)


@st.composite
def scenarios(draw):
    d = draw(st.sampled_from([8, 16, 32, 64]))
    group_size = draw(st.sampled_from([g for g in (4, 8, 16) if d % g == 0]))
    k_max = draw(st.sampled_from([0, 1, 2, 4, 128]))
    return {
        "hkv": draw(st.integers(1, 3)),
        "group": draw(st.integers(1, 4)),
        "d": d,
        "block": draw(st.sampled_from([1, 2, 4, 8, 16])),
        "tokens": draw(st.integers(1, 160)),
        "value_group": group_size,
        "key_bits": draw(st.sampled_from([8, 4, 2])),
        "value_bits": draw(st.sampled_from([4, 8, 2])),
        "outliers": draw(st.sampled_from([0, 1, 4])),
        "heavy_tail": draw(st.booleans()),
        "key_offset": draw(st.sampled_from([0.0, 3.0])),
        "q_scale": draw(st.sampled_from([1e-3, 0.3, 1.0, 4.0, 30.0, 1e3])),
        "peaked": draw(st.booleans()),
        "tau_cov": draw(st.sampled_from([0.0, 1e-3, 0.5, 0.9, 0.995, 1.0])),
        "k_max": k_max,
        "k_min": min(draw(st.sampled_from([0, 1, 2])), k_max),
        "inflation": draw(st.sampled_from([2.0, 3.0])),
        "union": draw(st.booleans()),
        "value_policy": draw(st.sampled_from(["local", "greedy"])),
        "v_tol": draw(st.sampled_from([0.0, 0.01, 0.05, math.inf])),
        "expand": draw(st.booleans()),
        "r": draw(st.integers(1, 3)),
        "exploration": draw(st.sampled_from([0.0, 0.3])),
        "fp64_scalars": draw(st.booleans()),
        "mode": draw(st.sampled_from(["certified", "certified", "naive", "dense"])),
        "q_dtype": draw(st.sampled_from(["float32", "float32", "float16", "bfloat16",
                                         "float64"])),
        "scaling": draw(st.sampled_from([None, None, None, 1.0, 0.02])),
        "seed": draw(st.integers(0, 2**16)),
        "chunks": draw(st.integers(1, 3)),
        "value_offset": draw(st.sampled_from([0.0, 0.0, 50.0, 1e3])),
        "aligned": draw(st.booleans()),
        "key_levels": draw(st.sampled_from([0, 1, 2])),
        "contribution": draw(st.sampled_from(["tight", "paper"])),
        "tail_mass": draw(st.sampled_from(["tight", "paper"])),
        "fused": draw(st.booleans()),  # the certificate fused on CPU (numba) or as operators
        "backend": draw(st.sampled_from(["torch", "numba"])),  # the phases: reference or fused
        # the decoded mirror (numba: Phase 1 from INT8 codes), whole or lean (no keys kept)
        "mirror": draw(st.sampled_from([False, True, "lean"])),
        "decode": draw(st.integers(0, 3)),  # tokens appended one at a time, as decode does
        "defer": draw(st.booleans()),  # a tail block that fills stays the (full) tail
    }


def build(sc):
    store = TieredKVStore(
        sc["hkv"], sc["d"], block_size=sc["block"],
        key_codec=ChannelAffineKeyCodec(bits=sc["key_bits"]),
        value_codec=GroupAffineValueCodec(bits=sc["value_bits"], group=sc["value_group"]),
        decoded_mirror=sc.get("mirror", False),
    )
    store.defer_commit = sc.get("defer", False)
    k, v = make_kv(sc["hkv"], sc["tokens"], sc["d"], seed=sc["seed"],
                   outlier_channels=min(sc["outliers"], sc["d"]), heavy_tail=sc["heavy_tail"],
                   key_offset=sc["key_offset"], value_offset=sc.get("value_offset", 0.0),
                   aligned_block=sc["block"] if sc.get("aligned") else 0,
                   key_levels=sc.get("key_levels", 0))
    decode = min(sc.get("decode", 0), sc["tokens"] - 1)
    prompt = sc["tokens"] - decode
    chunks = list(zip(k[:, :prompt].tensor_split(sc["chunks"], 1),
                      v[:, :prompt].tensor_split(sc["chunks"], 1), strict=True))
    chunks += [(k[:, t:t + 1], v[:, t:t + 1]) for t in range(prompt, sc["tokens"])]
    for chunk_k, chunk_v in chunks:
        if chunk_k.shape[1]:
            store.append(chunk_k, chunk_v)
    q = make_query(k, sc["group"], seed=sc["seed"], scale=sc["q_scale"], peaked=sc["peaked"])
    q = q.to(getattr(torch, sc.get("q_dtype", "float32")))
    contribution = sc.get("contribution", "tight")
    policy = (LocalThreshold(v_tol=sc["v_tol"], contribution=contribution)
              if sc["value_policy"] == "local"
              else GreedyBudget(e_val_budget=min(sc["v_tol"], 1e9), contribution=contribution))
    attn = CertifiedAttention(
        selector=AdaptiveTopK(tau_cov=sc["tau_cov"], k_min=sc["k_min"], k_max=sc["k_max"],
                              mass_inflation=sc["inflation"], kv_group_union=sc["union"]),
        value_policy=policy,
        ladder=Ladder(expand=sc["expand"], r=sc["r"], exploration=sc["exploration"],
                      tail_mass=sc.get("tail_mass", "tight")),
        backend=BACKENDS[sc.get("backend", "torch")](fp64_scalars=sc["fp64_scalars"]),
        mode=sc["mode"],
        compile=None if sc.get("fused", True) else False,
    )
    return store, q, attn


def check_contract(store, q, attn, scaling=None, scratch=None):
    """Run one step and assert the contract for every head (:func:`helpers.check_heads`);
    returns ``(bound, actual)`` of fast-path heads."""
    out, cert = attn(q, store, scaling, scratch=scratch)
    assert out.dtype == q.dtype
    err, bound = check_heads(out, cert, q, store, scaling)
    assert (cert.candidate_e_key >= cert.e_key).all()
    fast = cert.rung < 3
    if attn.mode == "dense":  # every head is the dense path, bounded by its e_arith alone
        assert (cert.rung == 4).all() and not fast.any()
        assert (cert.e_key == 0).all() and (cert.e_val == 0).all()
    else:  # the tight terms never exceed the paper's forms
        assert (cert.candidate_e_val <= cert.paper_e_val * (1 + 1e-6) + 1e-30).all()
    return bound[fast], err[fast]




ADVERSARIAL = {"hkv": 2, "group": 2, "d": 32, "block": 8, "tokens": 150, "value_group": 8,
               "key_bits": 8, "value_bits": 4, "outliers": 1, "heavy_tail": False,
               "key_offset": 0.0, "q_scale": 1.0, "peaked": False, "tau_cov": 0.9, "k_max": 4,
               "k_min": 1, "inflation": 2.0, "union": False, "value_policy": "local",
               "v_tol": math.inf, "expand": False, "r": 1, "exploration": 0.0,
               "fp64_scalars": False, "mode": "certified", "seed": 7, "chunks": 1}


def archives(group: int, key_mode: str) -> dict[str, Precision]:
    return {
        "kivi2": Precision(KiviKeyCodec(bits=2), GroupAffineValueCodec(bits=2, group=group)),
        "rotation": Precision(RotatedKeyCodec(bits=2, subspaces=4),
                              RotatedValueCodec(bits=2, subspaces=4)),
        "kvquant": Precision(PreRoPEKeyCodec(inner=KiviKeyCodec(bits=3), key_mode=key_mode),
                             OutlierValueCodec(bits=3, group=group, levels="nonuniform")),
    }
