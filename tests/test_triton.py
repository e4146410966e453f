"""Triton kernels against the PyTorch reference and an FP64 oracle (flash-attention rule:
kernel error <= 2 x reference error + small atol), and the certificate contract re-run with
backend=triton. On CPU they run under TRITON_INTERPRET=1 on small shapes; `gpu` tests use
full sizes on CUDA."""

from __future__ import annotations

import pytest
import torch
from helpers import cuda_layer, make_kv, make_query
from hypothesis import HealthCheck, given, settings
from test_contract import build, check_contract, scenarios

from certkv import CertifiedAttention, ChannelAffineKeyCodec, TieredKVStore
from certkv.kernels.dispatch import get_backend
from certkv.kernels.layout import StagedBlocks, StepLayout
from certkv.kernels.reference import Attended, TorchBackend, merge_staged

pytest.importorskip("triton")
from certkv.kernels.triton_backend import TritonBackend

ATOL = 1e-6


def case(hkv=2, group=3, d=32, tokens=75, seed=0, block=16):
    k, v = make_kv(hkv, tokens, d, seed=seed, outlier_channels=2)
    store = TieredKVStore(hkv, d, block_size=block, value_group=8)
    store.append(k, v)
    q = make_query(k, group, seed=seed, scale=3.0, peaked=seed % 2 == 0)
    return store, q.reshape(hkv, group, d)


@pytest.mark.parametrize("seed", range(4))
def test_phase1_scores_flash_attention_rule(seed):
    store, qg = case(seed=seed)
    lay = StepLayout(store)
    scaling = store.head_dim**-0.5
    oracle = torch.einsum("kgd,kntd->kgnt", qg.double(), lay.keys.double()) * scaling
    oracle = oracle.masked_fill(~lay.valid, float("-inf"))
    ref = TorchBackend().score(qg, lay, scaling)
    kernel = TritonBackend().score(qg, lay, scaling)
    finite = torch.isfinite(oracle)
    assert torch.equal(finite, torch.isfinite(kernel))
    ref_err = (ref.double() - oracle)[finite].abs().max()
    kernel_err = (kernel.double() - oracle)[finite].abs().max()
    assert kernel_err <= 2 * ref_err + ATOL


def fp64_attend(scores, values):
    """Oracle: softmax attention over all tokens in FP64, with block masses and log-masses."""
    s, v = scores.double(), values.double()
    hkv, g, n, b = s.shape
    w = torch.softmax(s.reshape(hkv, g, n * b), dim=-1).reshape(hkv, g, n, b)
    out = torch.einsum("kgnt,kntd->kgd", w, v)
    return Attended(out=out, rho=w.sum(-1), log_mass=torch.logsumexp(s, dim=-1))


@pytest.mark.parametrize(("seed", "promote"), [(0, False), (1, True), (2, True), (3, False)])
def test_phase2_attend_flash_attention_rule(seed, promote):
    store, qg = case(seed=seed, tokens=100)
    lay = StepLayout(store)
    scores = TorchBackend().score(qg, lay, store.head_dim**-0.5)
    staged = None
    if promote:
        kv, blk = torch.tensor([0, 1, 1]), torch.tensor([2, 0, 4])
        staged = StagedBlocks(kv, blk, store.fetch_originals(kv, blk, which="v")[1])
    values = merge_staged(lay.values, staged)
    oracle = fp64_attend(scores, values)
    ref = TorchBackend().attend(scores, lay, staged)
    kernel = TritonBackend(split=2).attend(scores, lay, staged)
    for name in ("out", "rho", "log_mass"):
        o = getattr(oracle, name).double()
        ref_err = (getattr(ref, name).double() - o).abs().max()
        ker_err = (getattr(kernel, name).double() - o).abs().max()
        assert ker_err <= 2 * ref_err + ATOL, name


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_contract_with_triton_backend(sc):
    sc = {**sc, "tokens": min(sc["tokens"], 64), "fp64_scalars": False}
    store, q, attn = build(sc)
    attn.backend = TritonBackend(split=4)
    check_contract(store, q, attn)


def test_triton_and_torch_backends_agree_through_attention():
    store, qg = case(seed=5, tokens=130)
    q = qg.reshape(-1, store.head_dim)
    a, ca = CertifiedAttention(backend="torch")(q, store)
    b, cb = CertifiedAttention(backend=TritonBackend())(q, store)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(ca.rung, cb.rung) and torch.equal(ca.k_star, cb.k_star)
    torch.testing.assert_close(ca.bound, cb.bound, rtol=1e-4, atol=1e-6)


def test_unsupported_codecs_fall_back_to_the_reference():
    k, v = make_kv(2, 64, 32, seed=0)
    store = TieredKVStore(2, 32, key_codec=ChannelAffineKeyCodec(bits=2))
    store.append(k, v)
    q = make_query(k, 2, scale=2.0)
    a, _ = CertifiedAttention(backend="torch")(q, store)
    b, _ = CertifiedAttention(backend=TritonBackend())(q, store)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_auto_backend_is_the_reference_without_cuda():
    if torch.cuda.is_available():
        assert get_backend("auto").name == "triton"
    else:
        assert get_backend("auto").name == "torch"


@pytest.mark.gpu
@pytest.mark.parametrize("context", [4096, 65536])
def test_full_size_kernels_on_cuda(context):
    store, q = cuda_layer(8, context, 128, group=4)
    a, ca = CertifiedAttention(backend="torch")(q, store)
    b, cb = CertifiedAttention(backend="triton")(q, store)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert torch.equal(ca.rung, cb.rung)


def test_quantize_on_append_kernel_matches_the_codecs():
    k, v = make_kv(2, 83, 32, seed=7, outlier_channels=3, heavy_tail=True)
    torch_store = TieredKVStore(2, 32, value_group=8, fused_encode=False)
    fused_store = TieredKVStore(2, 32, value_group=8, fused_encode=True)
    assert fused_store.fused_encode and not torch_store.fused_encode
    for store in (torch_store, fused_store):
        store.append(k[:, :40], v[:, :40])
        store.append(k[:, 40:], v[:, 40:])
    for a, b in ((torch_store.key_blocks(), fused_store.key_blocks()),
                 (torch_store.value_blocks(), fused_store.value_blocks())):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    # annotations: FP32 in the kernel, inflated to stay upper bounds of the exact FP64 values
    assert (fused_store.eta >= torch_store.eta * (1 - 1e-7)).all()
    torch.testing.assert_close(fused_store.eta, torch_store.eta, rtol=1e-4, atol=1e-7)
    assert (fused_store.nu >= torch_store.nu * (1 - 1e-7)).all()
    q = make_query(k, 3, seed=7, scale=2.0, peaked=True)
    check_contract(fused_store, q, CertifiedAttention(backend=TritonBackend()))
