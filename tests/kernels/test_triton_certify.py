"""The certificate in Phase 2's merge and the rungs in the fallback kernel (issue 55,
:mod:`certkv.kernels.triton_certify`): the device path's certificate against the PyTorch
segment's on the same step (the same kernels before it, so the same inputs), over every
quantizer in ``conf/``, both modes, the checks and the canary on and off, rung 4 and FP16 /
BF16 queries; each held to FP64 attention by the contract (no allowance). Under
TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import pytest
import torch
from helpers import check_heads, make_kv, make_query
from omegaconf import OmegaConf

from certkv import CertifiedAttention, TieredKVStore
from certkv.cache.scratch import ScratchCache
from certkv.certify.ladder import Ladder
from certkv.config import CONF_DIR
from certkv.eval.runner import build
from certkv.quant.rope import RopeSpec

QUANTIZERS = sorted(p.stem for p in (CONF_DIR / "quantizer").glob("*.yaml"))
# terms the merge computes in FP64 and rounds once, the segment in FP32 operators: equal up to
# the segment's own rounding, which for e^x of a log quantity x is relative 8 u |x| (arith's
# LOG_ULPS; 1e-5 at x = -20, a tail mass of 1e-9); the contract holds each to FP64 attention
RTOL = 1e-4
TERMS = ("candidate_e_key", "candidate_e_val", "e_key", "e_val", "e_arith", "tail_mass",
         "paper_e_key", "paper_e_val")
EXACT = ("rung", "k_star", "value_blocks", "canary_ok", "ranking_ok", "boundary_ok",
         "tol_level")


def segment(attn: CertifiedAttention) -> CertifiedAttention:
    """``attn`` with the certificate left to the PyTorch segment (the backend asked, as the
    step asks it, whether its Phase 2 certifies)."""
    attn.backend.certifies_in_phase2 = lambda lay: False
    return attn


def both(q, store, scratch=None, **options):
    """One step of the merge's certificate and one of the segment's, on the same store."""
    fused = CertifiedAttention(backend="triton", compile=False, **options)
    assert fused.backend.certifies_in_phase2
    plain = segment(CertifiedAttention(backend="triton", compile=False, **options))
    return fused(q, store, scratch=scratch), plain(q, store, scratch=scratch)


def assert_same_certificate(got, want) -> None:
    (out, cert), (out_s, cert_s) = got, want
    assert out.dtype == out_s.dtype and torch.equal(out, out_s)
    for name in EXACT:
        assert torch.equal(getattr(cert, name), getattr(cert_s, name)), name
    for name in TERMS:
        torch.testing.assert_close(getattr(cert, name), getattr(cert_s, name), rtol=RTOL,
                                   atol=0, equal_nan=True, msg=name)


def layer(tokens=200, seed=0, group=3, peaked=True, d=32, **store):
    k, v = make_kv(2, tokens, d, seed=seed, outlier_channels=2)
    kv = TieredKVStore(2, d, **({"value_group": 8} | store))
    kv.append(k, v)
    return kv, make_query(k, group, seed=seed, scale=4.0, peaked=peaked)


@pytest.mark.parametrize(("seed", "r", "dtype"), [
    (0, 2, torch.float32), (1, 3, torch.float32), (4, 2, torch.float16),
    (5, 3, torch.bfloat16), (2, 1, torch.float16)])
def test_the_merge_certifies_as_the_segment_does(seed, r, dtype):
    """Some heads on rungs 0-2, some dense (the ranking of the top ``r`` fails): the same
    output, rungs, checks and counts, the bounds equal up to the segment's rounding, and the
    contract on every head."""
    store, q = layer(200, seed=seed, peaked=seed % 2 == 0)
    got, want = both(q.to(dtype), store, ScratchCache(4, 4), ladder=Ladder(r=r))
    assert_same_certificate(got, want)
    check_heads(*got, q.to(dtype), store)


@pytest.mark.parametrize("options", [
    {"mode": "naive"},
    {"ladder": Ladder(r=3, layer_dense_fraction=0.2)},  # rung 4 for the whole layer
    {"ladder": Ladder(r=3, ranking_check=False)},
    {"ladder": Ladder(r=3, boundary_check=False, canary=False)},
    {"ladder": Ladder(r=2, expand=False)},
], ids=["naive", "layer-dense", "no-ranking", "no-boundary-no-canary", "no-expand"])
def test_the_rungs_follow_the_ladder_as_the_segment_does(options):
    store, q = layer(300, seed=7, peaked=False)
    got, want = both(q, store, **options)
    assert_same_certificate(got, want)
    check_heads(*got, q, store)
    if options.get("ladder") and options["ladder"].layer_dense_fraction < 1:
        assert (got[1].rung == 4).all()


def quantizers():
    """Every quantizer in ``conf/`` (mixed-precision stores, windows, 3-bit codes)."""
    for name in QUANTIZERS:
        node = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "quantizer" / f"{name}.yaml"))
        yield name, build(node, "quantizer").with_rope(RopeSpec.from_theta(1e4, 32))


@pytest.mark.parametrize(("name", "quantizer"), list(quantizers()), ids=QUANTIZERS)
def test_every_quantizer_certifies_alike_in_the_merge(name, quantizer):
    """16 blocks and a one-token tail: where the kernels read the store (every codec that
    claims a kernel layout), the merge's certificate is the segment's; elsewhere Phase 2 is
    the reference and the segment certifies."""
    k, v = make_kv(2, 16 * 16 + 1, 32, seed=3, outlier_channels=2)
    q = make_query(k, 3, seed=3, scale=4.0, peaked=True)
    store = TieredKVStore(2, 32, **quantizer.store_kwargs())
    store.append(k, v)
    got, want = both(q, store, ScratchCache(8, 8), ladder=Ladder(r=3))
    assert_same_certificate(got, want)
    check_heads(*got, q, store)
