"""The numba CPU backend (:mod:`certkv.kernels.numba_backend`) against the PyTorch reference
it fuses: the same phases on the same decoded blocks, equal up to FP32 rounding in an order the
reference's rounding chain allows, and the same checks. The contract (both against FP64
attention) is ``test_contract.py``'s, whose scenarios draw either backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import examples, make_kv, make_query, same_values
from helpers.contract import build, scenarios
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import certkv.kernels.numba_backend as nb
import certkv.kernels.numba_logits as nbl
from certkv import CertifiedAttention, TieredKVStore
from certkv.errors import NonFiniteError
from certkv.kernels.dispatch import get_backend
from certkv.kernels.layout import StagedBlocks, StepLayout
from certkv.kernels.reference import CheckInputs, TorchBackend


def test_the_reference_stays_reachable():
    """``torch`` is the reference; FP64 softmax scalars run it inside the numba backend
    (``backend=auto``'s choice: ``test_triton.py``)."""
    assert nb.AVAILABLE
    assert get_backend("torch").name == "torch" and get_backend("numba").name == "numba"
    assert not nb.NumbaBackend(fp64_scalars=True)._fused(torch.zeros(1))


def _layout(sc):
    store, q, _ = build(sc)
    lay = StepLayout(store)
    hkv = store.num_kv_heads
    return store, lay, q.float().reshape(hkv, q.shape[0] // hkv, -1)


def _phases(backend, lay, qg, scaling, gate, staged_values, checks):
    scored = backend.phase1(qg, lay, scaling)
    keys = None if not gate.any() else StagedBlocks(torch.zeros(0, dtype=torch.long),
                                                    torch.zeros(0, dtype=torch.long), None)
    att = backend.phase2(qg, scored, lay, gate, (keys, staged_values), scaling, 1e-6, checks)
    return scored, att


def _staged(store, lay, mask):
    """FP16 values of the ``mask [Hkv, n]`` completed blocks, staged from Tier-2."""
    kv, blk = mask.nonzero(as_tuple=True)
    if kv.numel() == 0:
        return None
    _, v = store.fetch_originals(kv, blk, which="v")
    return StagedBlocks(kv, blk, v)


@settings(max_examples=examples(120), suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(scenarios(), st.integers(0, 99))
def test_phases_agree_with_the_reference(sc, seed):
    """Phase 2 (gated FP16-key blocks, staged FP16 values, the checks in the epilogue) gives
    the reference's log-masses, masses, spreads and output up to FP32 rounding, and the same
    canary and checks."""
    sc = {**sc, "fp64_scalars": False, "mirror": False}  # the BLAS logits, as the reference's
    store, lay, qg = _layout(sc)
    scaling = sc["scaling"] or store.head_dim**-0.5
    hkv, group, _ = qg.shape
    n = lay.num_blocks
    gen = torch.Generator().manual_seed(seed)
    gate = (torch.rand(hkv, group, n, generator=gen) < 0.5) | ~lay.quantized
    staged_mask = torch.rand(hkv, lay.num_completed, generator=gen) < 0.3
    staged = _staged(store, lay, staged_mask & lay.quantized[:lay.num_completed])
    checks = CheckInputs(torch.randn(hkv * group, n, generator=gen),
                         torch.rand(hkv * group, n, generator=gen), gate.reshape(hkv * group, n),
                         lay.quantized, sc["r"])
    ref_s, ref = _phases(TorchBackend(), lay, qg, scaling, gate, staged, None)
    got_s, got = _phases(nb.NumbaBackend(), lay, qg, scaling, gate, staged, checks)
    for name in ("scores", "log_mass", "delta_b", "log_spread"):  # Phase 1 (fused after BLAS)
        torch.testing.assert_close(getattr(got_s, name), getattr(ref_s, name), msg=name,
                                   equal_nan=True)
    torch.testing.assert_close(got_s.state.m, ref_s.state.m, equal_nan=True)
    for name in ("w", "l", "l2"):  # its softmax state, exponentials within 1 u
        torch.testing.assert_close(getattr(got_s.state, name), getattr(ref_s.state, name),
                                   rtol=1e-4, atol=1e-6, equal_nan=True, msg=name)
    scale = float(ref.out.abs().max()) if ref.out.numel() else 1.0
    torch.testing.assert_close(got.out, ref.out, rtol=1e-4, atol=1e-5 * max(scale, 1.0),
                               equal_nan=True)
    for name in ("rho", "spread", "log_mass"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=1e-4,
                                   atol=1e-6, equal_nan=True, msg=name)
    assert torch.equal(got.canary, ref.canary)
    ranking, boundary = TorchBackend().checks(*checks[:1], ref.log_mass.reshape(hkv * group, n),
                                              *checks[1:])
    assert torch.equal(got.ranking, ranking) and torch.equal(got.boundary, boundary)


def test_values_read_in_place_are_the_staged_values():
    """The numba backend reads promoted FP16 values from Tier-2 in place (``in_place``): the
    same output, bit for bit, as from the same blocks staged into a pool."""
    k, v = make_kv(2, 16 * 20 + 5, 32, seed=3, outlier_channels=2)
    store = TieredKVStore(2, 32, decoded_mirror=True)
    store.append(k, v)
    lay = StepLayout(store)
    qg = make_query(k, 2, seed=3, peaked=True).float().reshape(2, 2, -1)
    gate = torch.zeros(2, 2, lay.num_blocks, dtype=torch.bool)
    mask = torch.zeros(2, lay.num_completed, dtype=torch.bool)
    mask[0, ::3], mask[1, 5] = True, True
    staged = _staged(store, lay, mask)
    in_place = StagedBlocks(staged.kv_heads, staged.blocks, None)
    backend = nb.NumbaBackend()
    assert backend.in_place(store) == "kv" and TorchBackend().in_place(store) == "k"
    _, want = _phases(backend, lay, qg, 0.2, gate, staged, None)
    _, got = _phases(backend, lay, qg, 0.2, gate, in_place, None)
    _, none = _phases(backend, lay, qg, 0.2, gate, None, None)
    assert torch.equal(got.out, want.out) and not torch.equal(got.out, none.out)


def test_logits_from_int8_codes_are_the_mirrors_products():
    """Phase 1's logits from the INT8 codes (the exact tail block from the mirror)
    agree with the BLAS product over the decoded mirror up to the dot products' rounding,
    ``-inf`` on the tail's empty slots; the codes decode bitwise to the mirror's keys."""
    k, v = make_kv(3, 16 * 10 + 5, 32, seed=3)
    store = TieredKVStore(3, 32, block_size=16, decoded_mirror=True)
    store.append(k[:, :-16], v[:, :-16])
    store.append(k[:, -16:], v[:, -16:])  # a tenth block: the code buffers grow past it
    lay = StepLayout(store)
    codes = nbl.int8_keys(store)
    slot, int8, scale, offset, width = codes
    assert (slot[:10] >= 0).all() and slot[10] == -1  # the tail block: from the mirror
    # C-contiguous rows of the store's buffers in place, though the buffers hold room for
    # more blocks (numba compiles a strided view's loops to scalar code)
    buffer = store.block_groups("key")[0][1]["codes"]
    assert not buffer.is_contiguous() and width > 10
    assert all(x.flags.c_contiguous for x in (int8, scale, offset))
    assert np.shares_memory(int8, buffer.numpy())
    decoded, row = np.empty((16, 32), np.float32), width + slot[4]
    nbl._decode(int8[row], scale[row], offset[row], decoded)
    assert np.array_equal(decoded, lay.keys[1, 4].numpy())
    q = make_query(k, 2, seed=3).float().reshape(3, 2, -1)
    s8 = nbl.key_logits(q, lay, 0.2, codes)
    full = nb.block_scores(q, lay.keys, lay.slot_bias, 0.2).reshape(6, -1, 16)
    torch.testing.assert_close(torch.from_numpy(s8), full, rtol=1e-5, atol=1e-5)
    assert np.isinf(s8[:, 10, 5:]).all() and np.isfinite(s8[:, 10, :5]).all()


def test_rows_view_the_buffer_in_place():
    """:func:`rows`: a head-major view of a wider buffer as its rows, without a copy; any other
    layout as a contiguous copy."""
    buffer = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    got, width = nbl.rows(buffer[:, :4])
    assert width == 5 and got.shape == (10, 3) and np.shares_memory(got, buffer.numpy())
    assert np.array_equal(got[5 + 2], buffer[1, 2].numpy())
    copied = buffer.transpose(0, 1)[:, :2]
    got, width = nbl.rows(copied)
    assert width == 2 and np.array_equal(got[2 + 1], buffer[1, 1].numpy())
    view = buffer[:, :4]
    assert nbl.rows(view)[0] is nbl.rows(view)[0]  # made once per view
    buffer[1, 1] = -1.0  # a write into the buffer: the view's rows show it, a copy is remade
    assert (nbl.rows(view)[0][5 + 1] == -1.0).all() and (nbl.rows(copied)[0][2 + 1] == -1.0).all()


def test_gated_logits_are_phase1s_products_on_the_originals():
    """The FP16-key logits of the gated blocks: the full product's up to rounding, and bitwise
    Phase 1's where a block's keys are exact (so the canary compares like with like)."""
    k, v = make_kv(3, 16 * 9 + 5, 32, seed=4)
    store = TieredKVStore(3, 32, block_size=16, decoded_mirror=True)
    store.append(k, v)
    lay = StepLayout(store)
    q = make_query(k, 2, seed=4).float().reshape(3, 2, -1)
    gate = torch.zeros(3, 2, lay.num_blocks, dtype=torch.bool)
    gate[0, 1, [0, 2, 7]] = True
    gate[2, 0, [0, 9]] = True  # 9: the partial tail block, exact keys
    s16 = nbl.gated_logits(q, lay, gate, 0.2)
    full = nb.block_scores(q, lay.original_keys, lay.slot_bias, 0.2).reshape(6, -1, 16)
    for kv, b in gate.any(1).nonzero().tolist():
        heads = slice(2 * kv, 2 * kv + 2)
        torch.testing.assert_close(torch.from_numpy(s16[heads, b]), full[heads, b], rtol=1e-5,
                                   atol=1e-5)
    s8 = nbl.key_logits(q, lay, 0.2, nbl.int8_keys(store))
    assert np.array_equal(s16[4:6, 9], s8[4:6, 9])


def test_phase2_over_many_chunks_matches_the_reference():
    """Phase 2's value sums split over (kv head, chunk of SUM_CHUNK blocks) in parallel give the
    reference's output where the two-level sum has several chunks (300 blocks)."""
    k, v = make_kv(3, 4 * 300 - 1, 16, seed=5)
    store = TieredKVStore(3, 16, block_size=4, decoded_mirror=True)
    store.append(k, v)
    lay = StepLayout(store)
    q = make_query(k, 3, seed=5, peaked=True)
    qg = q.float().reshape(3, 3, -1)
    gate = torch.zeros(3, 3, lay.num_blocks, dtype=torch.bool)
    gate[1, 2, 250:] = True
    staged = _staged(store, lay, torch.rand(3, lay.num_completed) < 0.2)
    _, ref = _phases(TorchBackend(), lay, qg, 0.25, gate, staged, None)
    _, got = _phases(nb.NumbaBackend(), lay, qg, 0.25, gate, staged, None)
    torch.testing.assert_close(got.out, ref.out, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got.rho, ref.rho, rtol=1e-4, atol=1e-7)


@settings(max_examples=examples(120), suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(scenarios())
def test_phase1_from_int8_codes_is_the_reference_within_its_rounding(sc):
    """With the decoded mirror, Phase 1's logits come from the INT8 codes by dot products in
    another order than BLAS's: each logit within the two products' rounding, ``2 gamma_{d+3}
    scaling sum_c |q_c k_c|`` (arith item 1 for each), of the reference's; the block maxima
    and log-masses within the largest of their block's."""
    sc = {**sc, "fp64_scalars": False, "mirror": True}
    store, lay, qg = _layout(sc)
    scaling = sc["scaling"] or store.head_dim**-0.5
    got = nb.NumbaBackend().phase1(qg, lay, scaling)
    ref = TorchBackend().phase1(qg, lay, scaling)
    d = store.head_dim
    magnitude = nb.block_scores(qg.abs(), lay.keys.abs(), torch.zeros_like(lay.slot_bias),
                                scaling).view_as(ref.scores)
    slack = 2 * (d + 3) * 2.0**-24 / (1 - (d + 3) * 2.0**-24) * magnitude + 1e-30
    finite = torch.isfinite(ref.scores)
    assert torch.equal(finite, torch.isfinite(got.scores))
    assert ((got.scores - ref.scores).abs() <= slack)[finite].all()
    block = slack.amax(dim=-1)
    for name in ("log_mass", "log_spread"):
        gap = (getattr(got, name) - getattr(ref, name)).abs()
        bound = block + 1e-5 * getattr(ref, name).abs() + 1e-6
        assert (gap <= bound)[torch.isfinite(getattr(ref, name))].all(), name
    torch.testing.assert_close(got.delta_b, ref.delta_b)


@pytest.mark.parametrize("peaked", [False, True])
def test_a_step_matches_the_reference_backend(peaked):
    """Whole certified steps: the same rungs, key sets, value promotions and checks; outputs and
    bounds equal up to FP32 rounding (on a store with the decoded mirror, as in a model)."""
    k, v = make_kv(3, 700, 64, seed=2, outlier_channels=3)
    store = TieredKVStore(3, 64, block_size=16, decoded_mirror=True)
    store.append(k, v)
    q = make_query(k, 3, seed=4, scale=2.0, peaked=peaked)
    results = [CertifiedAttention(backend=b)(q, store) for b in ("torch", "numba")]
    (out_t, cert_t), (out_n, cert_n) = results
    torch.testing.assert_close(out_n, out_t, rtol=1e-5, atol=1e-5)
    for name in ("rung", "k_star", "value_blocks", "ranking_ok", "boundary_ok", "canary_ok"):
        assert torch.equal(getattr(cert_n, name), getattr(cert_t, name)), name
    torch.testing.assert_close(cert_n.bound, cert_t.bound, rtol=1e-4, atol=1e-7)


def test_a_nonfinite_query_raises_as_on_the_reference():
    k, v = make_kv(2, 100, 16, seed=1)
    store = TieredKVStore(2, 16, block_size=8)
    store.append(k, v)
    q = make_query(k, 2, seed=1)
    q[1, 3] = float("nan")
    for backend in ("torch", "numba"):
        with pytest.raises(NonFiniteError, match="NaN or Inf"):
            CertifiedAttention(backend=backend)(q, store)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_a_lean_mirror_gives_the_whole_mirrors_steps(backend):
    """A store with a lean decoded mirror (no decoded keys, values or FP32 original keys:
    Phase 1 reads the exact sink and residual windows' keys from Tier-2, the tail's from its
    buffer, Phase 2 decodes the 4-bit value codes in place and reads the exact windows' and
    the tail's values as FP16) gives
    every step of the whole mirror's, output and certificate bit for bit, as decode tokens
    fill the tail, complete a block and age one out of the window; the reference decodes what
    the lean mirror leaves out."""
    from certkv.cache.scratch import ScratchCache
    from certkv.quant import KVQuantizer

    k, v = make_kv(2, 16 * 14 + 12, 32, seed=7, outlier_channels=2)
    stores = {kind: TieredKVStore(2, 32, quantizer=KVQuantizer(sink=16, residual=32),
                                  decoded_mirror=kind)
              for kind in (True, "lean")}
    for store in stores.values():
        store.append(k[:, :-20], v[:, :-20])
    attn = CertifiedAttention(backend=backend)
    for t in range(k.shape[1] - 20, k.shape[1]):
        q = make_query(k[:, :t], 3, seed=t, peaked=True)
        steps = [attn(q, store, scratch=ScratchCache(4, 4)) for store in stores.values()]
        assert torch.equal(steps[0][0], steps[1][0]), t
        assert same_values(steps[0][1], steps[1][1]), t
        for store in stores.values():
            store.append(k[:, t:t + 1], v[:, t:t + 1])
    assert stores["lean"].num_blocks == 14 and stores["lean"]._table.held() == [0, 1]
    assert stores["lean"]._mirror_fields == ("bound", "bias")  # values decoded in place
