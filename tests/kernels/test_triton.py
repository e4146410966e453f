"""Triton kernels against the PyTorch reference and an FP64 oracle (flash-attention rule:
kernel error <= 2 x reference error + small atol), and the certificate contract re-run with
backend=triton. On CPU they run under TRITON_INTERPRET=1 on small shapes; `gpu` tests use
full sizes on CUDA."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import triton  # noqa: F401 (a declared dev dependency: without it these tests fail, never skip)
from helpers import (
    DEVICES,
    check_heads,
    cuda_layer,
    examples,
    kernel_launches,
    make_kv,
    make_query,
)
from helpers.contract import (
    ADVERSARIAL,
    OwnDecodeValues,
    archives,
    build,
    check_contract,
    scenarios,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from certkv import CertifiedAttention, ChannelAffineKeyCodec, TieredKVStore
from certkv.cache.scratch import ScratchCache
from certkv.certify.checks import canary_violations
from certkv.kernels.dispatch import get_backend
from certkv.kernels.launch_hooks import wrap_triton_launches
from certkv.kernels.layout import StagedBlocks, StepLayout
from certkv.kernels.reference import Attended, Scored, TorchBackend, block_products
from certkv.kernels.triton_attend import FP16Slots, attend_blocks
from certkv.kernels.triton_backend import TritonBackend, slot_map
from certkv.kernels.triton_checks import ranking_and_boundary
from certkv.kernels.triton_score import score_blocks
from certkv.kernels.triton_sources import block_sources
from certkv.quant import (
    GroupAffineValueCodec,
    KiviKeyCodec,
    KVQuantizer,
    RotatedKeyCodec,
    RotatedValueCodec,
    TieredQuantizer,
    TokenSymmetricKeyCodec,
    TokenSymmetricValueCodec,
)
from certkv.quant.layout import KERNEL_BITS

ATOL = 1e-6


def merge_staged(values: torch.Tensor, staged) -> torch.Tensor:
    """The oracle's values: ``values [Hkv, n, B, d]`` with the staged FP16 blocks written into a
    copy (:func:`~certkv.kernels.reference.attend` reads them without copying)."""
    if staged is None:
        return values
    values = values.clone()
    values[staged.kv_heads, staged.blocks] = staged.gathered().float()
    return values


def case(hkv=2, group=3, d=32, tokens=75, seed=0, block=16, device="cpu", bits=None,
         symmetric=False):
    """A store of ``tokens`` (INT8 keys and INT4 values, or both at ``bits``: affine, or
    ``symmetric`` with a scale per token as SmartKV's) and queries."""
    k, v = make_kv(hkv, tokens, d, seed=seed, outlier_channels=2)
    value_group = 8 if d < 128 else 16
    codecs = {} if bits is None else {
        "key_codec": ChannelAffineKeyCodec(bits=bits),
        "value_codec": GroupAffineValueCodec(bits=bits, group=value_group)}
    if symmetric:
        codecs = {"key_codec": TokenSymmetricKeyCodec(bits=bits),
                  "value_codec": TokenSymmetricValueCodec(bits=bits)}
    store = TieredKVStore(hkv, d, block_size=block, value_group=value_group, device=device,
                          **codecs)
    store.append(k.to(device), v.to(device))
    q = make_query(k, group, seed=seed, scale=3.0, peaked=seed % 2 == 0)
    return store, q.reshape(hkv, group, d).to(device)


GPU_FULL = {"hkv": 8, "group": 4, "d": 128, "device": "cuda"}  # Llama-3.1-8B's attention shape


def flash_rule(kernel, ref, oracle, name):
    """Kernel error <= 2 x reference error + ATOL against the FP64 oracle (finite entries)."""
    finite = torch.isfinite(oracle)
    assert torch.equal(finite, torch.isfinite(kernel)), name
    ref_err = (ref.double() - oracle)[finite].abs().max()
    kernel_err = (kernel.double() - oracle)[finite].abs().max()
    ulps = 4 * 2.0**-23 * oracle[finite].abs().max()  # FP32 rounding of the magnitude
    assert kernel_err <= 2 * ref_err + ATOL + ulps, name


@pytest.mark.parametrize(("seed", "split", "shape"), [
    (0, 1, {}), (1, 3, {}), (2, None, {}), (3, 8, {}), (5, 2, {"bits": 3}), (6, 2, {"bits": 2}),
    (7, 2, {"bits": 3, "symmetric": True}), (8, 4, {"bits": 8, "symmetric": True}),
    pytest.param(4, None, {**GPU_FULL, "tokens": 32768 + 7}, marks=pytest.mark.gpu),
])
def test_phase1_flash_attention_rule(seed, split, shape):
    """Phase 1's logits, log-masses, log-spreads and Delta_b against FP64 on the store's own
    decoded keys (INT8 keys; 3-bit codes, two of each 8 straddling a byte; 2-bit; SmartKV's
    symmetric codes with a scale per token)."""
    store, qg = case(seed=seed, **{"tokens": 75 + 40 * seed, **shape})
    lay = StepLayout(store)
    scaling = store.head_dim**-0.5
    oracle = torch.einsum("kgd,kntd->kgnt", qg.double(), lay.keys.double()) * scaling
    oracle = oracle.masked_fill(~lay.valid, float("-inf"))
    bound = lay.channel_bound.double()
    oracle_delta = scaling * torch.einsum("kgd,knd->kgn", qg.double().abs(), bound)
    ref = TorchBackend().phase1(qg, lay, scaling)
    kernel = TritonBackend(split=split).phase1(qg, lay, scaling)
    flash_rule(kernel.scores, ref.scores, oracle, "scores")
    flash_rule(kernel.log_mass, ref.log_mass, torch.logsumexp(oracle, dim=-1), "log_mass")
    flash_rule(kernel.log_spread, ref.log_spread, 0.5 * torch.logsumexp(2 * oracle, dim=-1),
               "log_spread")
    n_q = lay.num_quantized
    flash_rule(kernel.delta_b[..., :n_q], ref.delta_b[..., :n_q], oracle_delta, "delta_b")
    assert (kernel.delta_b[..., n_q:] == 0).all()  # the exact tail block


def fp64_attend(scores, values):
    """Oracle: softmax attention over all tokens in FP64, with block masses, log-masses and
    spreads ``||p_b||_2``."""
    s, v = scores.double(), values.double()
    hkv, g, n, b = s.shape
    w = torch.softmax(s.reshape(hkv, g, n * b), dim=-1).reshape(hkv, g, n, b)
    out = torch.einsum("kgnt,kntd->kgd", w, v)
    return Attended(out=out, rho=w.sum(-1), log_mass=torch.logsumexp(s, dim=-1),
                    spread=w.norm(dim=-1))


def gated_scores(q, scored: Scored, gate, keys, scaling, eps_guard):
    """Oracle of Phase 2's logits ``[Hkv, G, n, B]``: FP16-key logits on the staged key blocks
    where ``gate`` is set, Phase 1's elsewhere, and the canary violations ``[Hkv, G, n]`` of the
    gated blocks."""
    violated = torch.zeros_like(gate)
    if keys is None:
        return scored.scores, violated
    kv, blk = keys.kv_heads, keys.blocks
    s16 = torch.bmm(q[kv].float(), keys.gathered().float().transpose(1, 2)) * scaling
    s8, on = scored.scores[kv, :, blk], gate[kv, :, blk]
    s2 = scored.scores.clone()
    s2[kv, :, blk] = torch.where(on.unsqueeze(-1), s16, s8)
    violated[kv, :, blk] = on & canary_violations(s8, s16, scored.delta_b[kv, :, blk], eps_guard)
    return s2, violated


def staged(store, kv, blk, which):
    kv, blk = torch.tensor(kv), torch.tensor(blk)
    k16, v16 = store.fetch_originals(kv, blk, which=which)
    return StagedBlocks(kv.to(store.device), blk.to(store.device), k16 if which == "k" else v16)


@pytest.mark.parametrize(("seed", "promote", "shape"), [
    (0, False, {}), (1, True, {}), (2, True, {}), (3, False, {}), (5, True, {"bits": 3}),
    (6, True, {"bits": 2, "symmetric": True}), (7, False, {"bits": 4, "symmetric": True}),
    pytest.param(4, True, {**GPU_FULL, "tokens": 32768 + 9}, marks=pytest.mark.gpu),
])
def test_phase2_attend_flash_attention_rule(seed, promote, shape):
    """Phase 2's output and block statistics against FP64 softmax attention over the store's
    decoded values (INT4, 3-bit codes, SmartKV's symmetric codes with a scale per token) with
    staged FP16 keys and values."""
    store, qg = case(seed=seed, **{"tokens": 100, **shape})
    lay = StepLayout(store)
    scaling = store.head_dim**-0.5
    scored = TorchBackend().phase1(qg, lay, scaling)
    hkv, group, n = scored.log_mass.shape
    gate = torch.zeros(hkv, group, n, dtype=torch.bool, device=qg.device)
    keys = values = None
    if promote:
        keys = staged(store, [0, 0, 1], [1, 3, 2], "k")
        gate[0, 0, 1] = gate[0, 1:, 3] = gate[1, :, 2] = True
        values = staged(store, [0, 1, 1], [2, 0, 4], "v")
    s2, _ = gated_scores(qg, scored, gate, keys, scaling, 1e-6)
    if promote:  # the oracle's FP16-key logits in FP64
        s16 = torch.einsum("pgd,ptd->pgt", qg[keys.kv_heads].double(),
                           keys.data.double()) * scaling
        s2 = s2.double()
        at = s2[keys.kv_heads, :, keys.blocks]
        s2[keys.kv_heads, :, keys.blocks] = torch.where(
            gate[keys.kv_heads, :, keys.blocks].unsqueeze(-1), s16, at)
    oracle = fp64_attend(s2, merge_staged(lay.values, values))
    args = (qg, scored, lay, gate, (keys, values), scaling, 1e-6)
    ref = TorchBackend().phase2(*args)
    kernel = TritonBackend(split=2).phase2(*args)
    for name in ("out", "rho", "log_mass", "spread"):
        flash_rule(getattr(kernel, name), getattr(ref, name), getattr(oracle, name).double(),
                   name)
    assert torch.equal(kernel.canary, ref.canary) and not ref.canary.any()


def mixed_case(seed=0, device="cpu"):
    """A store of four precisions and the tail: a 4-token FP16 sink, 2-bit KIVI archive, 4-bit
    KIVI warm blocks and an FP16 hot window (seed 004's tiers at toy ages), then the partial
    tail block; 2 kv heads, 3 query heads each, d = 32, B = 8."""
    q = TieredQuantizer(KiviKeyCodec(bits=4), GroupAffineValueCodec(bits=4, group=8), 8, sink=4,
                        hot=16, stale=48, archive="kivi2", archives=archives(8, "post_rope"))
    store = TieredKVStore(2, 32, block_size=8, quantizer=q, device=device)
    k, v = make_kv(2, 117, 32, seed=seed, outlier_channels=2)
    store.append(k.to(device), v.to(device))
    qg = make_query(k, 3, seed=seed, scale=3.0, peaked=seed % 2 == 0).reshape(2, 3, 32)
    return store, qg.to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_phases_read_every_precision_of_a_mixed_store(device):
    """One launch per phase whose programs are grouped by precision (the last group carries
    the tail block), every block at its index: the kernels meet the flash-attention rule
    against FP64 on a four-precision store, value promotion and gated keys included."""

    store, qg = mixed_case(seed=1, device=device)
    held = store.block_groups("key")
    assert [p.label for p, *_ in held] == ["FP16", "K4/V4", "K2/V2"]  # the sink shares FP16
    lay = StepLayout(store)
    scaling = store.head_dim**-0.5
    launches = []

    def named(kernel, launch, args, kwargs):  # each launch by its kernel's name
        launches.append(kernel.fn.__name__)
        return launch(*args, **kwargs)

    restore = wrap_triton_launches(named)
    try:
        kernel = TritonBackend(split=2).phase1(qg, lay, scaling)
        gate = torch.zeros(kernel.log_mass.shape, dtype=torch.bool, device=device)
        keys = staged(store, [0, 1], [2, 6], "k")
        gate[0, :, 2] = gate[1, 1, 6] = True
        values = staged(store, [0, 1], [3, 7], "v")
        ref = TorchBackend().phase1(qg, lay, scaling)
        args = (qg, ref, lay, gate, (keys, values), scaling, 1e-6)
        attended = TritonBackend(split=2).phase2(*args)
    finally:
        restore()
    assert store.tail_len and launches == ["_score_kernel", "_attend_kernel", "_reduce_kernel"]
    oracle = torch.einsum("kgd,kntd->kgnt", qg.double(), lay.keys.double()) * scaling
    oracle = oracle.masked_fill(~lay.valid, float("-inf"))
    flash_rule(kernel.scores, ref.scores, oracle, "scores")
    flash_rule(kernel.log_mass, ref.log_mass, torch.logsumexp(oracle, dim=-1), "log_mass")
    oracle_delta = scaling * torch.einsum("kgd,knd->kgn", qg.double().abs(),
                                          lay.channel_bound.double())
    nc = lay.num_completed
    flash_rule(kernel.delta_b[..., :nc], ref.delta_b[..., :nc], oracle_delta, "delta_b")
    assert (kernel.delta_b[..., ~lay.quantized] == 0).all()  # exact windows and the tail
    expected = TorchBackend().phase2(*args)
    for name in ("out", "rho", "log_mass", "spread"):
        torch.testing.assert_close(getattr(attended, name), getattr(expected, name),
                                   rtol=1e-5, atol=1e-6)
    assert torch.equal(attended.canary, expected.canary) and not attended.canary.any()


class KernelPhases(NamedTuple):
    """Both phases of a store's step on the kernels and on the reference, and the oracle."""

    lay: StepLayout
    kernel: Scored  # Phase 1, kernels
    ref: Scored  # Phase 1, reference
    held: dict  # the key codes of the completed blocks
    qg: torch.Tensor  # the query [Hkv, G, d]

    def delta(self, channel_bound: torch.Tensor) -> torch.Tensor:
        """FP64 ``Delta_b = scaling sum_c |q_c| r_c`` of a channel bound ``[Hkv, n, d]``."""
        return self.lay.store.head_dim**-0.5 * torch.einsum(
            "kgd,knd->kgn", self.qg.double().abs(), channel_bound.double())


def kernel_phases(quantizer, seed: int) -> KernelPhases:
    """117 tokens with outlier channels in a store of ``quantizer`` (B = 16, d = 32, 2 kv
    heads, 3 query heads each): both phases on the kernels (one launch each, not the reference)
    and on the reference, with a staged FP16 key block and a promoted value block; Phase 2's
    outputs, block statistics and canary checked against the reference's here."""
    store = TieredKVStore(2, 32, block_size=16, quantizer=quantizer)
    k, v = make_kv(2, 117, 32, seed=seed, outlier_channels=2)
    store.append(k, v)
    qg = make_query(k, 3, seed=seed, scale=3.0, peaked=True).reshape(2, 3, 32)
    lay = StepLayout(store)
    scaling = store.head_dim**-0.5
    with kernel_launches() as launches:
        kernel = TritonBackend(split=2).phase1(qg, lay, scaling)
        ref = TorchBackend().phase1(qg, lay, scaling)
        gate = torch.zeros(kernel.log_mass.shape, dtype=torch.bool)
        gate[0, :, 2] = gate[1, 1, 5] = True
        args = (qg, ref, lay, gate, (staged(store, [0, 1], [2, 5], "k"),
                                     staged(store, [1], [3], "v")), scaling, 1e-6)
        attended = TritonBackend(split=2).phase2(*args)
    assert launches["phase1"] == 1 and launches["phase2"] == 1, launches
    expected = TorchBackend().phase2(*args)
    for name in ("out", "rho", "log_mass", "spread"):
        torch.testing.assert_close(getattr(attended, name), getattr(expected, name),
                                   rtol=1e-5, atol=1e-6)
    assert torch.equal(attended.canary, expected.canary) and not attended.canary.any()
    nc = lay.num_completed
    held = {name: x[:, :nc] for name, x in store.block_groups("key")[0][1].items()}
    oracle = torch.einsum("kgd,kntd->kgnt", qg.double(), lay.keys.double()) * scaling
    oracle = oracle.masked_fill(~lay.valid, float("-inf"))
    flash_rule(kernel.scores, ref.scores, oracle, "scores")
    return KernelPhases(lay, kernel, ref, held, qg)


@pytest.mark.parametrize(("bits", "mode", "normalize"), [
    (2, "hybrid", True), (3, "hybrid", False), (4, "sym", True), (8, "asym", True)])
def test_phases_read_innerq_groups(bits, mode, normalize):
    """InnerQ's groups along the reduced dimension (keys per token over 16 channels with
    their per-channel exponents, values per channel over the block's tokens; asymmetric,
    symmetric and either per group) are read by both phases' kernels, not the reference: the
    logits, Delta_b and the outputs meet the flash-attention rule against FP64 over the
    codec's own decode, with a staged FP16 block and a promoted value block."""
    from certkv.quant.innerq import InnerQKeyCodec, InnerQValueCodec

    quantizer = KVQuantizer(InnerQKeyCodec(bits=bits, group=16, mode=mode, normalize=normalize),
                            InnerQValueCodec(bits=bits, mode=mode), 16)
    run = kernel_phases(quantizer, bits)
    nc, codec = run.lay.num_completed, quantizer.key_codec
    torch.testing.assert_close(run.lay.keys[:, :nc], codec.decode(run.held), rtol=0, atol=0)
    flash_rule(run.kernel.delta_b[..., :nc], run.ref.delta_b[..., :nc],
               run.delta(codec.channel_bound(run.held)), "delta_b")


@pytest.mark.parametrize(("bits", "subspaces", "rotation"), [
    (2, 4, "random_hadamard"), (3, 2, "hadamard"), (4, 8, "random_hadamard"),
    (8, 1, "hadamard")])
def test_phases_read_rotated_codes(bits, subspaces, rotation):
    """Seed 004's rotation archive (Hadamard-rotated coordinates, a scale and an offset per
    token and subspace) is read by both phases' kernels, not the reference: the codes rotated
    back in registers give logits and outputs within the flash-attention rule against FP64 over
    the codec's own decode, and a Delta_b between the codec's channel bound and that bound plus
    its decode slack (what an FP32 rotation may add), with a staged FP16 block and a promoted
    value block."""
    codecs = [c(bits=bits, subspaces=subspaces, rotation=rotation, seed=bits)
              for c in (RotatedKeyCodec, RotatedValueCodec)]
    run = kernel_phases(KVQuantizer(*codecs, 16), bits)
    bound = codecs[0].channel_bound(run.held).double()
    low, high = run.delta(bound), run.delta(bound + codecs[0].decode_slack(run.held))
    delta = run.kernel.delta_b[..., : run.lay.num_completed].double()
    assert (delta >= low * (1 - 1e-6)).all() and (delta <= high * (1 + 1e-6)).all()


@pytest.mark.parametrize(("bits", "levels", "inner"), [
    (3, "nonuniform", "kivi"), (2, "uniform", "kivi"), (4, "nonuniform", "int8_channel"),
    (8, "uniform", "kivi")])
def test_phases_read_the_kvquant_archive(bits, levels, inner):
    """KVQuant's archive (seed 004's ``kvquant``: pre-RoPE keys, dense-and-sparse values) is
    read by both phases' kernels, not the reference: the inner codes decoded and rotated to
    post-RoPE in registers with FP32 cosines and sines of each token's position give logits
    within the flash-attention rule against FP64 over the codec's own decode, with a Delta_b
    between the codec's channel bound and that bound plus its decode slack (widened by the
    kernel's FP32 margin only); the values' normal-float or affine codes with the block's exact
    outliers in place give Phase 2's outputs (checked in ``kernel_phases``)."""
    from certkv.quant.outlier_value import OutlierValueCodec
    from certkv.quant.prerope import PreRoPEKeyCodec
    from certkv.quant.rope import RopeSpec

    inner_codec = (KiviKeyCodec if inner == "kivi" else ChannelAffineKeyCodec)(bits=bits)
    keys = PreRoPEKeyCodec(inner=inner_codec, rope=RopeSpec.from_theta(1e4, 32, 1.25))
    values = OutlierValueCodec(bits=bits, group=16, levels=levels, outlier_fraction=0.02)
    assert keys.kernel_layout().rope and values.kernel_layout(32).outliers
    run = kernel_phases(KVQuantizer(keys, values, 16), bits)
    nc = run.lay.num_completed
    torch.testing.assert_close(run.lay.keys[:, :nc], keys.decode(run.held), rtol=0, atol=0)
    bound = keys.channel_bound(run.held).double()
    low, high = run.delta(bound), run.delta(bound + keys.decode_slack(run.held))
    delta = run.kernel.delta_b[..., :nc].double()
    assert (delta >= low * (1 - 1e-6)).all() and (delta <= high * (1 + 2**-14)).all()


def _phases_at(store, qg, n, gate, keys, values):
    """Phase 1 and Phase 2 kernels over ``n`` block columns (the store's blocks, its tail
    block, and empty blocks after it), promoted blocks as the first columns' slot maps."""
    scaling = store.head_dim**-0.5
    lay = StepLayout(store, empty_tail=True)
    pad = n - lay.num_blocks
    key_src, value_src = (block_sources(store, which, True) for which in ("key", "value"))
    s, log_mass, delta, log_spread = score_blocks(qg, key_src, n, store.block_size, scaling, 2)
    scored = Scored(scores=s, log_mass=log_mass, delta_b=delta, log_spread=log_spread)
    shape = (store.num_kv_heads, lay.num_blocks)
    padded = [torch.nn.functional.pad(slot_map(staged, shape, lay)[0], (0, pad), value=-1)
              for staged in (keys, values)]
    pools = [slot_map(staged, shape, lay)[1] for staged in (keys, values)]
    gate = torch.nn.functional.pad(gate, (0, pad))
    attended = attend_blocks(scored, qg, gate, value_src,
                             FP16Slots(padded[0], pools[0], padded[1], pools[1]), scaling, 1e-6,
                             split=2)
    return scored, attended


@pytest.mark.parametrize("case_name", ["blocks_and_tail", "empty_tail", "tail_only", "mixed"])
def test_padded_columns_are_empty_blocks_and_leave_the_others_as_they_were(case_name):
    """A layout padded with empty blocks after the tail block (issue 24's bucketed block
    counts: launches that stay the same while blocks complete): the kernels give those
    columns an empty block's values (no mass, ``-inf`` log-masses, ``Delta_b = 0``, no canary)
    and every other column the unpadded launch's numbers, bit for bit per block; the merged
    output only gains splits with no mass (FP32 reassociation of the merge at most)."""
    if case_name == "mixed":
        store, qg = mixed_case(seed=2)
    else:
        tokens = {"blocks_and_tail": 100, "empty_tail": 96, "tail_only": 5}[case_name]
        store, qg = case(seed=3, tokens=tokens)
    n = store.num_blocks + 1
    gate = torch.zeros(store.num_kv_heads, qg.shape[1], n, dtype=torch.bool)
    keys = values = None
    if store.num_blocks >= 3:
        keys, values = staged(store, [0, 1], [1, 2], "k"), staged(store, [1], [0], "v")
        gate[0, :, 1] = gate[1, 0, 2] = True
    base_scored, base = _phases_at(store, qg, n, gate, keys, values)
    scored, att = _phases_at(store, qg, n + 5, gate, keys, values)
    for name in ("scores", "log_mass", "delta_b", "log_spread"):
        assert torch.equal(getattr(scored, name)[:, :, :n], getattr(base_scored, name)), name
    assert (scored.scores[:, :, n:] == float("-inf")).all()
    assert (scored.log_mass[..., n:] == float("-inf")).all()
    assert (scored.log_spread[..., n:] == float("-inf")).all()
    assert (scored.delta_b[..., n:] == 0).all()
    assert torch.equal(att.log_mass[..., :n], base.log_mass)
    assert torch.equal(att.canary[..., :n], base.canary) and not att.canary[..., n:].any()
    assert (att.log_mass[..., n:] == float("-inf")).all()
    assert (att.rho[..., n:] == 0).all() and (att.spread[..., n:] == 0).all()
    for name in ("out", "rho", "spread"):
        torch.testing.assert_close(getattr(att, name)[..., :n] if name != "out" else att.out,
                                   getattr(base, name), rtol=1e-6, atol=0)


def test_phase2_canary_flags_a_staged_block_that_disagrees_with_its_codes():
    store, qg = case(seed=6, tokens=64)
    lay = StepLayout(store)
    scaling = store.head_dim**-0.5
    scored = TorchBackend().phase1(qg, lay, scaling)
    gate = torch.zeros(scored.log_mass.shape, dtype=torch.bool)
    gate[1, :, 2] = True
    gate[1, 0, 1] = True
    # block 2 of kv head 1 no longer matches its INT8 codes (P2 broken): its originals in
    # Tier-2 changed after it was quantized (the reference reads them in place, the kernel
    # from the staged copy)
    store.originals()["k"][1, 2] += 3.0
    keys = staged(store, [1, 1], [1, 2], "k")
    args = (qg, scored, lay, gate, (keys, None), scaling, 1e-6)
    ref = TorchBackend().phase2(*args)
    kernel = TritonBackend(split=3).phase2(*args)
    expected = torch.zeros_like(gate)
    expected[1, :, 2] = True
    assert torch.equal(ref.canary, expected) and torch.equal(kernel.canary, expected)


@pytest.mark.parametrize("r", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 7, 40, pytest.param(8192, marks=pytest.mark.gpu)])
def test_checks_kernel_matches_the_reference(r, n):
    gen = torch.Generator().manual_seed(100 * r + n)
    hq = 24
    l8 = torch.randn(hq, n, generator=gen).round(decimals=1)  # rounding makes ties common
    l16 = l8 + 0.05 * torch.randn(hq, n, generator=gen).round(decimals=1)
    l16[::5] = l8[::5]  # some heads agree exactly
    delta = 0.2 * torch.rand(hq, n, generator=gen)
    promoted = torch.rand(hq, n, generator=gen) < 0.4
    promoted[::3] = True
    quantized = torch.ones(n, dtype=torch.bool)
    quantized[-1] = n == 1
    ref = TorchBackend().checks(l8, l16, delta, promoted, quantized, r)
    if n > 1000:  # full size on the GPU
        l8, l16, delta, promoted, quantized = (
            x.cuda() for x in (l8, l16, delta, promoted, quantized))
    kernel = ranking_and_boundary(l8, l16, delta, promoted, quantized, r,
                                  block_n=8 if n < 1000 else 1024)
    kernel = tuple(x.cpu() for x in kernel)
    for a, b in zip(ref, kernel, strict=True):
        assert torch.equal(a, b)
    assert ref[0].any() and ref[1].any()


@pytest.mark.parametrize("r", [1, 3])
@pytest.mark.parametrize("n", [1, 40])
def test_phase2_merge_runs_the_checks_in_its_epilogue(r, n):
    """The checks in the merge's epilogue (reading back the log-masses it wrote, ``m_b + log
    l_b``; ``l_b = 1`` makes them the test's FP16 log-masses) equal the reference's."""
    from certkv.kernels.reference import CheckInputs
    from certkv.kernels.triton_merge import reduce_splits

    gen = torch.Generator().manual_seed(7 * r + n)
    hkv, g = 4, 6
    l8 = torch.randn(hkv * g, n, generator=gen).round(decimals=1)
    l16 = l8 + 0.05 * torch.randn(hkv * g, n, generator=gen).round(decimals=1)
    l16[::5] = l8[::5]
    delta = 0.2 * torch.rand(hkv * g, n, generator=gen)
    promoted = torch.rand(hkv * g, n, generator=gen) < 0.4
    promoted[::3] = True
    quantized = torch.ones(n, dtype=torch.bool)
    quantized[-1] = n == 1
    m = l16.amax(dim=-1).reshape(hkv, g, 1)
    att = reduce_splits(l16.reshape(hkv, g, n), torch.ones(hkv, g, n), m,
                        torch.ones(hkv, g, 1), torch.zeros(hkv, g, 1, 8),
                        checks=CheckInputs(l8, delta, promoted, quantized, r))
    assert torch.equal(att.log_mass.reshape(hkv * g, n), l16)
    ref = TorchBackend().checks(l8, l16, delta, promoted, quantized, r)
    assert torch.equal(att.ranking, ref[0]) and torch.equal(att.boundary, ref[1])


@st.composite
def triton_scenarios(draw):
    """The contract's scenarios (every key and value width they draw, 2/4/8 bits, is one the
    kernels cover; 3-bit codes are explicit examples) in a quantized mode (dense mode reaches
    no kernel), on at most 2 kv heads and 5 full blocks and a partial tail (2 splits of 4
    blocks; at most 64 tokens): the interpreter takes about 0.3 s per program (kv head and
    split) and kernel. ``scratch``: the capacity of a scratch cache (None: none), whose device
    bookkeeping then serves page-in."""
    sc = draw(scenarios())
    return {**sc, "hkv": min(sc["hkv"], 2), "scratch": draw(st.sampled_from([None, 0, 2, 64])),
            "tokens": min(sc["tokens"], 64, 6 * sc["block"] - 1), "fp64_scalars": False,
            "mode": "naive" if sc["mode"] == "naive" else "certified"}


SMALL_ADVERSARIAL = {**ADVERSARIAL, "tokens": 40, "scaling": None}


@settings(max_examples=examples(14), suppress_health_check=[HealthCheck.too_slow])
@given(sc=triton_scenarios())
@example(sc={**SMALL_ADVERSARIAL, "key_bits": 8, "value_bits": 3})  # 3-bit values in Phase 2
@example(sc={**SMALL_ADVERSARIAL, "key_bits": 3, "value_bits": 4, "mode": "naive"})  # 3-bit keys
@example(sc={**SMALL_ADVERSARIAL, "key_bits": 3, "value_bits": 3, "q_dtype": "float16"})  # both
def contract_with_triton_backend(runs, sc):
    store, q, attn = build(sc)
    attn.backend = TritonBackend(split=4)
    scratch = None if sc.get("scratch") is None else ScratchCache(sc["scratch"], sc["scratch"])
    with kernel_launches() as launches:
        check_contract(store, q, attn, sc["scaling"], scratch)
    if scratch is not None:  # a second step: hits, and the slots the first one filled
        check_contract(store, q, attn, sc["scaling"], scratch)
    # each phase runs its kernels exactly for the codecs they cover (B and d are powers of two)
    assert (launches["phase1"] > 0) == (sc["key_bits"] in KERNEL_BITS), (sc, launches)
    assert (launches["phase2"] > 0) == (sc["value_bits"] in KERNEL_BITS), (sc, launches)
    runs.append(launches)


def test_contract_with_triton_backend():
    """The contract property test with backend=triton, where most examples really run both
    kernels (not the reference they fall back to)."""
    runs = []
    contract_with_triton_backend(runs)
    both = sum(r["phase1"] > 0 and r["phase2"] > 0 for r in runs)
    assert len(runs) >= 15 and both >= 0.75 * len(runs), f"kernels ran in {both} of {len(runs)}"


def test_triton_and_torch_backends_agree_through_attention():
    store, qg = case(seed=5, tokens=130)
    q = qg.reshape(-1, store.head_dim)
    a, ca = CertifiedAttention(backend="torch")(q, store)
    b, cb = CertifiedAttention(backend=TritonBackend())(q, store)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(ca.rung, cb.rung) and torch.equal(ca.k_star, cb.k_star)
    # the paper's terms agree; e_arith differs with each backend's rounding chain
    torch.testing.assert_close(ca.e_key + ca.e_val, cb.e_key + cb.e_val, rtol=1e-4, atol=1e-6)
    check_heads(a, ca, q, store)
    check_heads(b, cb, q, store)


def test_unsupported_codecs_fall_back_to_the_reference():
    """Values of a codec that decodes in its own way (a subclass of the dense-and-sparse one),
    which claims no kernel layout: Phase 2 runs on the reference, with the kernels' results
    elsewhere."""
    from certkv.quant import OutlierValueCodec

    k, v = make_kv(2, 64, 32, seed=0)
    codec = OwnDecodeValues(bits=3, group=32)
    assert codec.kernel_layout(32) is None and OutlierValueCodec(bits=3).kernel_layout(32)
    store = TieredKVStore(2, 32, value_codec=codec)
    store.append(k, v)
    q = make_query(k, 2, scale=2.0)
    a, _ = CertifiedAttention(backend="torch")(q, store)
    b, _ = CertifiedAttention(backend=TritonBackend())(q, store)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_auto_backend_is_triton_on_cuda_else_the_fused_cpu_phases():
    if torch.cuda.is_available():
        assert get_backend("auto").name == "triton"
    else:
        assert get_backend("auto").name == "numba"


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



def test_the_quantize_kernel_leaves_evicted_blocks_to_their_summary_codec():
    """With eviction, the store's fused encoder (the default on CUDA) quantizes blocks at the
    main precision only; an evicted block's summary is written by its own codec (on an H200
    the kernel was asked for a summary's value group and every evicting store failed)."""
    from certkv.evict import StreamingEviction

    k, v = make_kv(2, 256, 32, seed=4, outlier_channels=2)
    stores = [TieredKVStore(2, 32, fused_encode=fused, quantizer=KVQuantizer(
        block_size=16).with_eviction(StreamingEviction(budget=0.3, sink=16)))
        for fused in (False, True)]
    for store in stores:
        store.append(k, v)
    assert stores[1].fused_encode and stores[1].evicted_mask().any()
    assert torch.equal(stores[0].evicted_mask(), stores[1].evicted_mask())
    assert torch.equal(stores[0].dequantized_keys(), stores[1].dequantized_keys())
    assert torch.equal(stores[0].dequantized_values(), stores[1].dequantized_values())
    q = make_query(k, 2, seed=1, scale=2.0, peaked=True)
    check_contract(stores[1], q, CertifiedAttention(backend=TritonBackend()))

def torch_merge(m_b, l_b, m, lsum, acc, l2_b) -> Attended:
    """Oracle of the split reduction: the log-sum-exp merge in PyTorch."""
    top = m.amax(dim=-1, keepdim=True)
    weight = torch.exp(m - top)
    total = (weight * lsum).sum(dim=-1, keepdim=True)
    out = (weight.unsqueeze(-1) * acc).sum(dim=-2) / total
    rho = torch.exp(m_b - top) * l_b / total
    spread = torch.exp(m_b - top) * l2_b.sqrt() / total
    return Attended(out=out, rho=rho, log_mass=m_b + torch.log(l_b), spread=spread)


def test_fused_split_reduction_matches_the_torch_merge():
    from certkv.kernels.triton_merge import reduce_splits

    gen = torch.Generator().manual_seed(0)
    hkv, g, n, splits, d = 2, 3, 140, 70, 32  # more splits than one chunk of 64
    m_b = 5 * torch.randn(hkv, g, n, generator=gen)
    l_b = 1 + 10 * torch.rand(hkv, g, n, generator=gen)
    m = m_b.reshape(hkv, g, splits, 2).amax(-1)
    lsum = 1 + 20 * torch.rand(hkv, g, splits, generator=gen)
    acc = torch.randn(hkv, g, splits, d, generator=gen)
    l2_b = l_b * torch.rand(hkv, g, n, generator=gen).clamp_min(0.1)
    ref, fused = (torch_merge(m_b, l_b, m, lsum, acc, l2_b),
                  reduce_splits(m_b, l_b, m, lsum, acc, l2_b))
    for name in ("out", "rho", "log_mass", "spread"):
        torch.testing.assert_close(getattr(fused, name), getattr(ref, name), rtol=1e-5,
                                   atol=1e-6)


def test_block_products_of_a_view_into_a_larger_buffer_equal_the_single_matmul():
    """The decoded mirror hands Phase 2 a ``[:, :n]`` view of a larger buffer, which one
    batched matmul over (kv head, block) could only read after copying it: the per-kv-head
    products give the same per-block sums."""
    gen = torch.Generator().manual_seed(0)
    buf = torch.randn(3, 40, 16, 8, dtype=torch.float64, generator=gen)
    w = torch.rand(3, 2, 25, 16, dtype=torch.float64, generator=gen)
    view = buf[:, :25]
    assert view.stride(0) != 25 * view.stride(1)  # not flattenable over (kv head, block)
    want = torch.einsum("kgnt,kntd->kgnd", w, view.contiguous())
    torch.testing.assert_close(block_products(w, view), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block_products(w, view.contiguous()), want, rtol=1e-12,
                               atol=1e-12)

