"""The certificate's arithmetic term (certkv.certify.arith) and the inputs an auditor found that
broke the contract before it: FP32 rounding outside the bound, 16-bit outputs, huge logits with
near ties, overflowing dense paths, bad scaling. Every case runs on both backends and is checked
by ``helpers.check_heads`` (no allowance beyond the FP64 reference's own rounding)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import check_heads, make_kv, make_query, reference_fp64

from certkv import (
    AdaptiveTopK,
    CertifiedAttention,
    ChannelAffineKeyCodec,
    Ladder,
    LocalThreshold,
    TieredKVStore,
)
from certkv.certify.arith import Rounding, dot_chunk, dot_depth, gamma
from certkv.certify.bounds import key_error_bound
from certkv.certify.certificate import CertificateLog
from certkv.errors import ConfigError, NonFiniteError
from certkv.kernels.reference import dense_attention, prescaled_attention

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.filterwarnings("ignore"))]
EVERYTHING_PROMOTED = {"selector": AdaptiveTopK(tau_cov=1.0, k_min=0, k_max=1 << 20),
                       "value_policy": LocalThreshold(v_tol=0.0)}


def attention(backend, split=2, **kwargs):
    """CertifiedAttention on ``backend`` (Triton: ``split`` blocks per program)."""
    if backend == "triton":
        from certkv.kernels.triton_backend import TritonBackend

        kwargs["backend"] = TritonBackend(split=split)
    else:
        kwargs["backend"] = "torch"
    return CertifiedAttention(**kwargs)


def block_constant_layer(q0: float, k0: float, d: int = 16, blocks: int = 4, bsz: int = 16):
    """Keys constant within each block (every ``sigma_c = 0``, so ``Delta_b = 0``) with one
    large channel ``k0``; INT4-exact values (each group spans 15 steps of 4: ``eta = 0``); a
    query with ``q_0 = q0``. In exact arithmetic E_key = E_val = 0 is right: all the error is
    floating point's."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, blocks, d, generator=gen)
    k[..., 0] = k0
    k = k.repeat_interleave(bsz, dim=1)
    codes = torch.randint(0, 16, (1, blocks * bsz, d), generator=gen).float()
    codes[..., 0], codes[..., 15] = 0, 15
    store = TieredKVStore(1, d, block_size=bsz, value_group=16)
    store.append(k, codes * 4 - 30)
    q = torch.randn(1, d, generator=gen)
    q[0, 0] = q0
    return store, q


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("q0", "k0"), [(30.0, 1000.0), (1e4, 6e4)])
def test_fp32_rounding_is_inside_the_bound_when_the_math_terms_are_zero(backend, q0, k0):
    store, q = block_constant_layer(q0, k0)
    out, cert = attention(backend)(q, store)
    assert (cert.e_key == 0).all() and (cert.e_val == 0).all() and (cert.rung == 0).all()
    err, _ = check_heads(out, cert, q, store)
    # FP32 really errs here (4.9e-4 and 5.8 on the PyTorch path; 2.6e-3 before its logits
    # became one baddbmm): e_arith covers it
    assert (err > 1e-4).all()


def near_tie_layer(tokens: int, d: int = 64, logit: float = 2500.0, seed: int = 0,
                   block_size: int = 16):
    """Keys with outlier channels of 50; one query aligned with the longest key ``i`` so that
    its logit is about ``logit``, and token ``j`` a copy of ``i`` one FP16 ulp apart on an
    outlier channel (logits about 1 apart: a near tie whose weights FP32 rounding moves), with
    opposite values."""
    k, v = make_kv(1, tokens, d, seed=seed)
    k[..., :4] *= 50
    k = k.half().float()
    i = int(k[0].norm(dim=-1).argmax())  # q along k_i: no other key scores higher
    j = (i + tokens // 2) % tokens
    k[0, j] = k[0, i]
    k[0, j, 0] = torch.nextafter(k[0, i, 0].half(), torch.tensor(-1e4).half()).float()
    v[0, j] = -v[0, i]
    store = TieredKVStore(1, d, block_size=block_size)
    store.append(k, v)
    ki = store.dense_kv()[0][0, i].float()
    q = (ki / ki.norm() ** 2 * logit * d**0.5)[None]
    return store, q


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_logits_with_near_ties(backend):
    store, q = near_tie_layer(300)
    for kwargs in ({}, EVERYTHING_PROMOTED, {"mode": "naive"}):
        out, cert = attention(backend, **kwargs)(q, store)
        err, _ = check_heads(out, cert, q, store)
        assert err.max() > 1e-5  # arithmetic really errs here


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_very_long_context_with_huge_logits_and_near_ties(backend):
    """The auditor's T = 50,001 case (d = 64, outlier channels of 50, logits near 2,500, two
    near-tied tokens): the FP32 error (about 5e-4 here) used to exceed the bound (3.4e-4).
    Triton runs with B = 128 (the interpreter's cost is per block: about 10 s on 2 cores)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    store, q = near_tie_layer(50_001, block_size=128 if backend == "triton" else 16)
    if device == "cuda":
        k, v = store.dense_kv()
        store = TieredKVStore(1, 64, block_size=store.block_size, device="cuda")
        store.append(k.cuda(), v.cuda())
        q = q.cuda()
    out, cert = attention(backend, split=64)(q, store)
    err, _ = check_heads(out, cert, q, store)
    assert err.max() > 1e-5  # arithmetic really errs here


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_queries_get_16_bit_outputs_with_their_rounding_in_the_bound(backend, dtype):
    """Everything promoted (E_key = E_val = 0) with |out| in the hundreds: the cast to the
    caller's dtype errs by 0.03-0.7, which e_arith now reports."""
    k, v = make_kv(2, 200, 64, seed=4)
    store = TieredKVStore(2, 64)
    store.append(k, 40 * v + 150)
    q = make_query(k, 3, seed=4, scale=2.0, peaked=True).to(dtype)
    out, cert = attention(backend, **EVERYTHING_PROMOTED)(q, store)
    assert out.dtype == dtype
    assert (cert.e_key + cert.e_val < 1e-3).all() and (cert.rung < 3).all()
    err, _ = check_heads(out, cert, q, store)
    assert err.max() > 0.01  # the 16-bit output rounding is real


@pytest.mark.parametrize("scaling", [0.0, -0.125, math.nan, math.inf, "0.125", True])
@pytest.mark.parametrize("mode", ["certified", "dense"])
def test_scaling_must_be_finite_and_positive(scaling, mode):
    k, v = make_kv(1, 40, 16)
    store = TieredKVStore(1, 16)
    store.append(k, v)
    with pytest.raises(ConfigError, match="finite positive number"):
        CertifiedAttention(mode=mode)(make_query(k, 2), store, scaling)


def test_scaling_accepts_any_real_number_and_0d_tensors():
    k, v = make_kv(1, 40, 16)
    store = TieredKVStore(1, 16)
    store.append(k, v)
    q = make_query(k, 2)
    out, _ = CertifiedAttention()(q, store, 0.25)
    for scaling in (np.float32(0.25), torch.tensor(0.25), torch.tensor(0.25, dtype=torch.float64),
                    np.array(0.25)):
        assert torch.equal(CertifiedAttention()(q, store, scaling)[0], out)
    with pytest.raises(ConfigError, match="finite positive number"):
        CertifiedAttention()(q, store, torch.tensor([0.25, 0.5]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_a_scaling_at_the_largest_honoured_value_keeps_the_contract(backend, dtype):
    """An auditor's finding: a finite scaling beyond FP32's range (1e38 and up) made every mode
    return NaN with a finite bound. Scales up to ``max_scaling(d)`` are honoured (FP16-extreme
    keys, huge queries, every mode); larger ones are refused with one sentence."""
    from certkv.attention import max_scaling

    d = 16
    k, v = make_kv(2, 40, d, seed=1)
    k[:, :, 0] = 65504 * torch.sign(torch.randn(2, 40, generator=torch.Generator().manual_seed(1)))
    store = TieredKVStore(2, d, block_size=8, value_group=8)
    store.append(k, v)
    q = make_query(k, 2).to(dtype)
    q[:, 0] = 1e4 if dtype == torch.float16 else 1e30
    limit = max_scaling(d)
    for mode in ("dense", "naive", "certified"):
        for scaling in (limit, 1e30):
            out, cert = attention(backend, mode=mode)(q, store, scaling)
            check_heads(out, cert, q, store, scaling)
        with pytest.raises(ConfigError, match=r"exceeds .* the largest scale"):
            attention(backend, mode=mode)(q, store, 1e39)


def test_bf16_queries_beyond_the_fp16_range_stay_finite_on_every_dense_path():
    """A BF16 query with |q_c| > 65504 used to be cast to FP16 (inf, then NaN) on the dense path
    while the certificate reported 0."""
    k, v = make_kv(2, 128, 32, seed=2)
    store = TieredKVStore(2, 32, key_codec=ChannelAffineKeyCodec(bits=2))
    store.append(k, v)
    q = make_query(k, 2, seed=2, scale=1.0).to(torch.bfloat16)
    q[:, 0] = 2e5
    all_dense = CertifiedAttention(selector=AdaptiveTopK(tau_cov=0.0, k_min=1, k_max=1),
                                   ladder=Ladder(expand=False, layer_dense_fraction=0.01))
    for attn in (CertifiedAttention(mode="dense"), all_dense):
        out, cert = attn(q, store)
        assert (cert.rung == 4).all()
        check_heads(out, cert, q, store)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_dense_path_cannot_overflow_for_finite_inputs(dtype):
    """Logits beyond 1e39 overflow FP32; the dense path prescales the query by a power of two
    and never produces NaN (here the certified and naive paths fall back to it too)."""
    k, v = make_kv(2, 64, 16, seed=5)
    store = TieredKVStore(2, 16)
    store.append(1e4 * k, v)
    q = make_query(k, 2, seed=5).to(dtype) * 1e36
    for mode in ("dense", "certified", "naive"):
        out, cert = CertifiedAttention(mode=mode)(q, store)
        assert torch.isfinite(out).all() and (cert.rung >= 3).all()
        check_heads(out, cert, q, store)


def test_an_output_the_callers_dtype_cannot_hold_goes_dense():
    """INT4 values that span the whole FP16 range decode up to 65536; a head that attends to
    them would overflow the FP16 output: it is not certified but answered densely (rung 3)."""
    d = 16
    k, v = make_kv(1, 64, d, seed=6)
    v[..., 0], v[..., 1] = -65504, 65504  # s = 8736 and 15 s + o = 65536 > 65504
    store = TieredKVStore(1, d)
    store.append(k, v)
    q = make_query(k, 2, seed=6, scale=4.0, peaked=True).half()
    out, cert = CertifiedAttention(mode="naive")(q, store)
    assert torch.isfinite(out).all() and (cert.rung == 3).any()
    check_heads(out, cert, q, store)


def test_lemma_a3_survives_a_tail_mass_that_underflows_next_to_a_huge_delta():
    """``a_T = e^{c Delta} alpha_hat`` underflows FP32 (log a_T = -110) while ``e^{2 Delta_T}``
    is huge: their product is e^10 (TV capped by tanh); computed as a plain product it was 0."""
    one = torch.ones(1)
    bound = key_error_bound(one, 60 * one, 60 * one, torch.tensor([-230.0]), 2.0)
    assert float(bound) == pytest.approx(2.0)


def test_a_non_finite_bound_is_an_error_not_a_certificate():
    k, v = make_kv(1, 40, 16)
    store = TieredKVStore(1, 16)
    store.append(k, v)
    _, cert = CertifiedAttention(mode="dense")(make_query(k, 2), store)
    cert.e_arith = torch.full_like(cert.e_arith, math.nan)  # what a NaN q gives on a GPU
    log = CertificateLog()
    log.record(0, cert)
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        log.flush()


def test_e_arith_is_small_at_ordinary_magnitudes():
    """Its share of the bound is reported (reports/tightness.md); here, a sanity check only:
    at the paper's operating point on unit-scale data (outlier channels included) it is a small
    part of the typical head's bound. (The tight E_key is half the paper's here while e_arith,
    about 0.0039, is unchanged: logit rounding over every token, ``2 R tanh(eps/2)``, is most
    of it; its median share is 0.12 of the tight bound, 0.10 of the paper-form one.)"""
    k, v = make_kv(4, 2048, 64, seed=11, outlier_channels=4)
    store = TieredKVStore(4, 64)
    store.append(k, v)
    q = make_query(k, 3, seed=5, scale=1.0)
    for mode in ("certified", "naive"):
        out, cert = CertifiedAttention(mode=mode)(q, store)
        check_heads(out, cert, q, store)
        assert float((cert.e_arith / cert.bound).median()) < 0.15
        paper = cert.paper_e_key + cert.paper_e_val + cert.e_arith
        assert float((cert.e_arith / paper).median()) < 0.1


def test_rounding_chain_grows_with_every_count():
    n, big_n = 8, 128
    base = Rounding(exps=2, depth=20)
    rel = base.relative(n, big_n)
    assert 0 < rel < 1e-4
    assert base.accumulation(n, big_n) > 2 * rel
    for more in (Rounding(exps=3, depth=20), Rounding(exps=2, depth=21),
                 Rounding(exps=2, depth=20, depth_per_block=1),
                 Rounding(exps=2, depth=20, product_u=2.0**-11),
                 Rounding(exps=2, depth=20, weight_u=2.0**-11)):
        assert more.relative(n, big_n) > rel
    assert Rounding(exps=2, depth=20, dot_depth=15).logit_gamma(64) < base.logit_gamma(64)
    assert gamma(10) == pytest.approx(10 * 2.0**-24, rel=1e-6) and gamma(2**23) == math.inf


def test_two_level_dot_product_depth():
    """The Triton kernels' dot products take about 2 sqrt(d) roundings per product, not d."""
    assert [dot_depth(d) for d in (8, 16, 64, 128, 256)] == [5, 7, 15, 23, 31]
    assert [dot_chunk(d) for d in (64, 80, 96)] == [8, 8, 8]


def test_prescaled_dense_attention_follows_the_flash_attention_rule():
    """On ordinary inputs the overflow-proof dense path is as accurate as SDPA in FP32: its
    error against FP64 is at most twice SDPA's plus a few ulps."""
    k, v = make_kv(2, 300, 64, seed=9, outlier_channels=2)
    q = make_query(k, 4, seed=9, scale=3.0, peaked=True)
    k16, v16 = k.half(), v.half()
    oracle = F.scaled_dot_product_attention(q.double()[None, :, None], k16.double()[None],
                                            v16.double()[None], enable_gqa=True)[0, :, 0]
    sdpa = F.scaled_dot_product_attention(q[None, :, None], k16.float()[None],
                                          v16.float()[None], enable_gqa=True)[0, :, 0]
    ours = prescaled_attention(q, k16, v16, 64**-0.5)
    ulps = 4 * 2.0**-24 * float(oracle.abs().max())
    assert (ours.double() - oracle).abs().max() <= 2 * (sdpa.double() - oracle).abs().max() + ulps
    assert torch.equal(dense_attention(q, k16, v16, 64**-0.5), ours)


def test_fp64_queries_keep_fp64_dense_heads():
    k, v = make_kv(1, 64, 16, seed=3)
    store = TieredKVStore(1, 16)
    store.append(k, v)
    q = make_query(k, 2, seed=3, scale=2.0).double()
    out, cert = CertifiedAttention(mode="dense")(q, store)
    assert out.dtype == torch.float64 and (cert.e_arith < 1e-10).all()
    err = (out - reference_fp64(q, store)).norm(dim=-1)
    assert (err < 1e-12).all()
    check_heads(out, cert, q, store)
