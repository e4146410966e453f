"""Every Triton launch a certified step makes compiles for a CUDA GPU (sm_90), checked on a
machine without one (:mod:`certkv.kernels.cuda_compile`): the interpreter that runs the kernels
in CI accepts programs the compiler rejects, and on an H200 every Phase 2 launch failed so."""

from __future__ import annotations

import pytest
import torch
from helpers import make_kv, make_query
from helpers.contract import OwnDecodeValues
from omegaconf import OmegaConf

from certkv import CertifiedAttention, TieredKVStore
from certkv.cache.scratch import ScratchCache
from certkv.certify.ladder import Ladder
from certkv.config import CONF_DIR
from certkv.eval.runner import build
from certkv.evict import StreamingEviction
from certkv.kernels.cuda_compile import compile_for_cuda, recording_launches
from certkv.quant import GroupAffineValueCodec, KiviKeyCodec, KVQuantizer, OutlierValueCodec
from certkv.quant.protect import FaultModel, Protection
from certkv.quant.rope import RopeSpec

QUANTIZERS = sorted(p.stem for p in (CONF_DIR / "quantizer").glob("*.yaml"))


def quantizers():
    """Every quantizer in ``conf/``; the paper's and the tiered one also with eviction, the
    paper's with Hamming(8,4) protection, the tiered one with its rotation archive and with
    KVQuant's (pre-RoPE keys, dense-and-sparse values, normal-float and uniform levels); 3-bit
    KIVI keys and values; values of a codec no kernel reads, so that Phase 2 runs on the
    reference and the checks take their own launch."""
    for name in QUANTIZERS:
        node = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "quantizer" / f"{name}.yaml"))
        quantizer = build(node, "quantizer").with_rope(RopeSpec.from_theta(1e4, 32))
        yield quantizer
        if name in ("int8_int4", "tiers"):
            yield quantizer.with_eviction(StreamingEviction(budget=0.5, sink=16))
        if name == "tiers":  # the rotated and KVQuant archives (auto: from 2,048 / 8,192)
            for archive in ("rotation", "kvquant"):
                node.update(hot=32, stale=96, archive=archive)
                yield build(node, "quantizer").with_rope(RopeSpec.from_theta(1e4, 32))
        if name == "int8_int4":
            yield quantizer.with_protection(Protection("hamming84", "zero", True, FaultModel()))
    yield KVQuantizer(KiviKeyCodec(bits=3), GroupAffineValueCodec(bits=3, group=8))
    yield KVQuantizer(KiviKeyCodec(bits=4), OutlierValueCodec(bits=2, group=32,
                                                              levels="uniform"))
    yield KVQuantizer(KiviKeyCodec(bits=4), OwnDecodeValues(bits=3, group=32))



def certified_steps():
    """Steps over every quantizer: 16 blocks and a one-token tail (an integer argument equal
    to 1 is a constant to the JIT), scratch page-in, some heads on rungs 3-4 (r=3); batches of
    ragged sequences of the first quantizer and of those holding several precisions (the
    batched step's launches); a naive step; a BF16 query; the fused quantize-on-append
    kernel."""
    k, v = make_kv(2, 16 * 16 + 1, 32, seed=3, outlier_channels=2)
    q = make_query(k, 3, seed=3, scale=4.0, peaked=True)
    for i, quantizer in enumerate(quantizers()):
        store = TieredKVStore(2, 32, **quantizer.store_kwargs())
        store.append(k, v)
        attn = CertifiedAttention(backend="triton", ladder=Ladder(r=3))
        attn(q, store, scratch=ScratchCache(8, 8))
        several = len(store.block_groups("value")) > 1
        if getattr(quantizer, "eviction", None) is None and (i == 0 or several):
            batch_step(attn, quantizer, k, v, q, ragged=i == 0)
    CertifiedAttention(backend="triton", mode="naive")(q, store)
    CertifiedAttention(backend="triton")(q.bfloat16(), store)  # the output rounded to BF16
    TieredKVStore(2, 32, value_group=8, fused_encode=True).append(k, v)


def batch_step(attn, quantizer, k, v, q, ragged: bool) -> None:
    """One batched step of three sequences (a launch over every sequence's precision groups:
    the union of theirs); ``ragged``: the last without a completed block (its tail block a
    group of its own)."""
    lengths = (k.shape[1], 70, 5) if ragged else (k.shape[1], 200, 150)
    stores = [TieredKVStore(2, 32, **quantizer.store_kwargs()) for _ in lengths]
    for store, n in zip(stores, lengths, strict=True):
        store.append(k[:, :n], v[:, :n])
    attn.batch(q[None].expand(3, -1, -1), stores,
               scratches=[ScratchCache(8, 8) for _ in lengths])


@pytest.mark.slow
def test_every_launch_of_a_certified_step_compiles_for_cuda():
    with recording_launches() as launches:
        certified_steps()
    kernels = {x.name for x in launches}
    assert {"_score_kernel", "_select_kernel", "_attend_kernel", "_reduce_kernel", "_checks_kernel",
            "_dense_flagged_kernel", "_page_in_kernel", "_quantize_kernel",
            "_ecc_decode_kernel"} <= kernels, kernels
    failures = compile_for_cuda(launches)
    assert failures == {}, "\n\n".join(f"{name}:\n{msg}" for name, msg in failures.items())


def test_a_kernel_the_compiler_refuses_is_reported_with_the_compilers_message(tmp_path,
                                                                                monkeypatch):
    """The check is not vacuous: a kernel whose loop-carried variable changes type (what the
    interpreter ran and the H200 refused) comes back with the compiler's sentence."""
    (tmp_path / "refused_kernel.py").write_text(
        "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
        "def refused(x_ptr, n):\n"
        "    flag = tl.zeros((4,), tl.int8)\n"
        "    if n > 0:\n"
        "        flag = tl.max(tl.zeros((4, 4), tl.int8), axis=1)\n"
        "    tl.store(x_ptr + tl.arange(0, 4), flag)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    import refused_kernel

    x = torch.zeros(4, dtype=torch.int8)
    with recording_launches() as launches:
        refused_kernel.refused[(1,)](x, 3)
    failures = compile_for_cuda(launches)
    assert list(failures) == ["refused_kernel.refused"]
    assert "flag" in failures["refused_kernel.refused"]
