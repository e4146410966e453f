"""SmartKV (seed 001): the symmetric per-token codec, bit allocation under the budget, the
reallocation schedule, importance from the step's own attention, and the certificate contract
with reallocation mid-decode."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    KINDS,
    adversarial,
    assert_keys_within_bound,
    assert_values_within_bound,
    check_heads,
    examples,
    make_kv,
    make_query,
    tier1_bytes,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from certkv import AdaptiveTopK, CertifiedAttention, TieredKVStore
from certkv.certify.certificate import BlockStats
from certkv.errors import ConfigError
from certkv.kernels.reference import TorchBackend
from certkv.quant import SmartKVQuantizer, TokenSymmetricKeyCodec, TokenSymmetricValueCodec
from certkv.quant.allocation import (
    LADDER,
    fit_budget,
    greedy_allocation,
    mean_cost,
    rank_order,
    seed_allocation,
    tier_bits,
)
from certkv.quant.importance import ImportanceBoard
from certkv.quant.smartkv import realloc_period
from certkv.quant.symmetric_token import decode_tokens

COST = {b: b + 16 / 64 for b in LADDER}  # d = 64


# ---------------------------------------------------------------- the codec


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", LADDER)
def test_round_trip_within_bound_and_codes_in_range(kind, bits):
    x = adversarial(kind, (2, 3, 16, 64), seed=bits)
    enc = assert_keys_within_bound(TokenSymmetricKeyCodec(bits), x)
    assert_values_within_bound(TokenSymmetricValueCodec(bits), x)
    qmax = (1 << (bits - 1)) - 1
    codes = torch.round(decode_tokens(enc, bits) / enc["scale"].float().unsqueeze(-1)
                        .clamp_min(2.0**-24))
    assert codes.abs().max() <= qmax  # 2 bits: only -1, 0, 1 (the seed's quantizer)
    assert tier1_bytes(enc) == 2 * 3 * 16 * (64 * bits // 8 + 2)


# ---------------------------------------------------------------- allocation


def test_tiers_by_rank_and_ties_to_the_newer_block():
    bits = tier_bits(100)
    assert bits[:10].eq(8).all() and bits[10:30].eq(4).all()
    assert bits[30:70].eq(3).all() and bits[70:].eq(2).all()
    assert rank_order(torch.tensor([1.0, 5.0, 1.0, 1.0])).tolist() == [1, 3, 2, 0]


def test_over_budget_steps_down_from_the_least_important_never_protected():
    score = torch.linspace(1, 0, 40)  # block 0 most important
    protected = torch.zeros(40, dtype=torch.bool)
    protected[0] = True
    bits = seed_allocation(score, protected, COST, budget=16 * 0.15)
    assert bits[0] == 8
    assert mean_cost(bits, protected, COST) <= 16 * 0.15
    free = bits[1:]
    assert (free[:-1] >= free[1:]).all()  # more important never fewer bits


def test_under_budget_raises_from_the_most_important_until_nothing_fits():
    score = torch.rand(50, generator=torch.Generator().manual_seed(0))
    protected = torch.zeros(50, dtype=torch.bool)
    budget = 16 * 0.4
    bits = seed_allocation(score, protected, COST, budget)
    assert mean_cost(bits, protected, COST) <= budget
    total = sum(COST[int(b)] for b in bits)
    for b in bits.tolist():  # maximal: no single block can move up a rung within the budget
        if b < 8:
            higher = LADDER[LADDER.index(b) + 1]
            assert total + COST[higher] - COST[b] > budget * 50


def test_lowering_only_fit_never_raises():
    bits = torch.tensor([8, 8, 8, 2])
    fitted = fit_budget(bits, torch.arange(4), torch.zeros(4, dtype=torch.bool), COST, 5.0,
                        upgrade=False)
    assert (fitted <= bits).all() and mean_cost(fitted, torch.zeros(4, dtype=torch.bool),
                                                COST) <= 5.0


def test_greedy_allocation_spends_bits_where_sensitivity_is_largest():
    sens = torch.tensor([0.0, 10.0, 1.0, 100.0, 5.0])
    protected = torch.tensor([True, False, False, False, False])
    bits = greedy_allocation(sens, protected, COST, budget=4.0)
    assert bits[0] == 8 and mean_cost(bits, protected, COST) <= 4.0
    order = torch.argsort(sens[1:], descending=True)
    assert (bits[1:][order][:-1] >= bits[1:][order][1:]).all()


def test_reallocation_period_follows_the_seed():
    assert [realloc_period(n) for n in (0, 512, 1024, 1536, 10_000)] == [16, 32, 48, 64, 64]


def test_a_budget_below_all_two_bit_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"2-bit blocks need 2.25 at head_dim=64.*use beta >= "
                       r"0.1406"):
        SmartKVQuantizer(beta=0.1).validate(64)
    with pytest.raises(ConfigError, match="set residual=0 and sink=0"):
        SmartKVQuantizer(sink=4)


# ---------------------------------------------------------------- the store


def decode_steps(store, k, v, start, steps, attn=None, check=False, seed=0):
    """Append one token per step and feed the step's certificate back to the store (naive
    steps, which carry the same block signals, unless the contract is ``check``ed)."""
    attn = attn or CertifiedAttention(mode="certified" if check else "naive",
                                      backend=TorchBackend())
    for t in range(start, start + steps):
        store.append(k[:, t : t + 1], v[:, t : t + 1])
        q = make_query(k[:, : t + 1], 2, seed=seed + t, scale=10.0, peaked=t % 2 == 0)
        out, cert = attn(q, store)
        if check:
            check_heads(out, cert, q, store)
        store.observe(cert)
        yield cert


def widths(store) -> torch.Tensor:
    return torch.tensor([store.precisions[p].key_codec.bits for p in store.block_precision])


@pytest.mark.parametrize("rule", ["importance", "certificate"])
@pytest.mark.parametrize("beta", [0.25, 0.4])
def test_budget_holds_after_every_step_and_protected_stay_at_8_bits(rule, beta):
    k, v = make_kv(2, 300, 64, seed=2, outlier_channels=2)
    store = TieredKVStore(2, 64, block_size=16,
                          quantizer=SmartKVQuantizer(block_size=16, beta=beta, rule=rule))
    store.append(k[:, :200], v[:, :200])
    protected = store._tracker.protected()
    assert mean_cost(widths(store), protected, COST) <= 16 * beta
    for _ in decode_steps(store, k, v, 200, 100):  # 6 blocks complete at 8 bits meanwhile
        w = widths(store)
        assert w[0] == 8 and mean_cost(w, store._tracker.protected(), COST) <= 16 * beta
    assert store._tracker.reallocations >= 1 + 100 // realloc_period(300)  # prefill + f(N)
    assert len(set(w.tolist())) > 1  # mixed precision


def test_reallocation_runs_every_f_steps_since_the_last():
    k, v = make_kv(1, 700, 64, seed=3)
    store = TieredKVStore(1, 64, block_size=16, quantizer=SmartKVQuantizer(block_size=16))
    store.append(k[:, :500], v[:, :500])
    tracker = store._tracker
    at = []
    for i, _ in enumerate(decode_steps(store, k, v, 500, 100)):
        if tracker.steps_since == 0:
            at.append(i + 1)
    expect, since = [], 0
    for i in range(1, 101):  # the seed's f(N) = max(8, min(64, 16 (1 + N / 512))), N tokens
        since += 1
        if since >= max(8, min(64, int(16 * (1 + (500 + i) / 512)))):
            expect.append(i)
            since = 0
    assert at == expect == [32, 65, 99]


def test_changed_blocks_are_requantized_from_the_originals():
    k, v = make_kv(1, 260, 64, seed=4, outlier_channels=1)
    store = TieredKVStore(1, 64, block_size=16, quantizer=SmartKVQuantizer(block_size=16,
                                                                           beta=0.25))
    store.append(k[:, :240], v[:, :240])
    before = widths(store)
    list(decode_steps(store, k, v, 240, 20))
    after = widths(store)
    assert (before[:15] != after[:15]).any()
    originals = store._originals()
    for precision, codes, blocks, slots in store.block_groups("key"):
        direct = precision.key_codec.encode(originals["k"][:, blocks.cpu()])
        assert torch.equal(direct["codes"], codes["codes"][:, slots.cpu()])


def test_block_importance_is_the_sum_of_its_tokens_emas():
    """Feeding per-token attention: the tracker's block EMAs (tail carried over) equal the sums
    of per-token EMAs started at insertion, with no per-token pass."""
    block, steps, gamma = 4, 14, 0.9
    k, v = make_kv(1, 6 + steps, 8, seed=5)
    store = TieredKVStore(1, 8, block_size=block, quantizer=SmartKVQuantizer(block_size=block))
    store.append(k[:, :6], v[:, :6])
    token_ema = torch.zeros(6 + steps, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    for t in range(6, 6 + steps):
        store.append(k[:, t : t + 1], v[:, t : t + 1])
        alpha = torch.rand(2, t + 1, generator=gen, dtype=torch.float64)  # [Hq, tokens]
        alpha /= alpha.sum(dim=1, keepdim=True)
        padded = torch.nn.functional.pad(alpha, (0, -(t + 1) % block))
        mass = padded.reshape(2, -1, block).sum(dim=-1)  # [Hq, blocks (+ tail)]
        zeros = torch.zeros_like(mass).float()
        cert = type("Cert", (), {"blocks": BlockStats(mass.float(), zeros[:1], zeros,
                                                      zeros[:, 0], zeros[0] > 0)})
        store.observe(cert)
        token_ema[: t + 1] = gamma * token_ema[: t + 1] + (1 - gamma) * alpha.mean(dim=0)
    n = store.num_blocks
    expect = token_ema[: n * block].reshape(n, block).sum(dim=-1)
    assert torch.allclose(store._tracker.ema.double(), expect, rtol=1e-5, atol=1e-7)


def test_head_weighting_as_written_is_degenerate_and_max_is_not():
    k, v = make_kv(2, 100, 64, seed=6)
    weights = {}
    for signal in ("mean", "max"):
        store = TieredKVStore(2, 64, block_size=16, quantizer=SmartKVQuantizer(
            block_size=16, head_signal=signal))
        store.append(k[:, :80], v[:, :80])
        list(decode_steps(store, k, v, 80, 5))
        eta = store._tracker.head_eta
        weights[signal] = eta / eta.mean()
    assert torch.allclose(weights["mean"], torch.ones(4))  # every w_h = 1: the seed's weight
    assert weights["max"].std() > 1e-3


def test_layers_sharing_a_board_get_the_same_widths():
    board = ImportanceBoard()
    stores = []
    for layer in range(2):
        k, v = make_kv(1, 240, 64, seed=10 + layer)
        store = TieredKVStore(1, 64, block_size=16, quantizer=SmartKVQuantizer(
            block_size=16, beta=0.25))
        store.join(board, layer)
        store.append(k[:, :200], v[:, :200])
        stores.append((store, k, v))
    runs = [decode_steps(s, k, v, 200, 40, seed=i) for i, (s, k, v) in enumerate(stores)]
    for _ in zip(*runs, strict=True):  # layer 0 then layer 1, step by step
        assert torch.equal(widths(stores[0][0]), widths(stores[1][0]))
    assert stores[0][0]._tracker.reallocations > 1


# ---------------------------------------------------------------- the certificate contract


@st.composite
def scenarios(draw):
    return {
        "beta": draw(st.sampled_from([0.16, 0.25, 0.4, 1.0])),
        "rule": draw(st.sampled_from(["importance", "certificate"])),
        "head_signal": draw(st.sampled_from(["mean", "max"])),
        "block": draw(st.sampled_from([4, 8, 16])),
        "hkv": draw(st.integers(1, 2)),
        "tokens": draw(st.integers(1, 120)),
        "steps": draw(st.integers(1, 24)),
        "outliers": draw(st.sampled_from([0, 2])),
        "rank": draw(st.sampled_from(["mass", "upper"])),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_contract_with_smartkv_reallocating_mid_decode(sc):
    d = 32
    quantizer = SmartKVQuantizer(block_size=sc["block"], beta=sc["beta"], rule=sc["rule"],
                                 head_signal=sc["head_signal"])
    store = TieredKVStore(sc["hkv"], d, block_size=sc["block"], quantizer=quantizer,
                          decoded_mirror=sc["seed"] % 2 == 0)
    n = sc["tokens"]
    k, v = make_kv(sc["hkv"], n + sc["steps"], d, seed=sc["seed"],
                   outlier_channels=sc["outliers"])
    store.append(k[:, :n], v[:, :n])
    attn = CertifiedAttention(AdaptiveTopK(rank=sc["rank"]), backend=TorchBackend())
    list(decode_steps(store, k, v, n, sc["steps"], attn=attn, check=True, seed=sc["seed"]))


def test_ranking_by_the_upper_bound_lets_a_mixed_store_pass_its_boundary_check():
    """SmartKV mixes 3/4/8-bit blocks: promoted by INT8 mass, a wide low-mass block's bound
    ``l_b + Delta_b`` can still reach the top and fail eq. 18 (the head goes dense); promoted by
    ``p_hat e^{Delta_b}`` (``selector.rank=upper``) those blocks go first and the check passes
    on more heads, with every head still within its bound."""
    fails = {}
    k, v = make_kv(3, 1024, 64, seed=1, outlier_channels=2)
    for rank in ("mass", "upper"):
        store = TieredKVStore(3, 64, block_size=16, quantizer=SmartKVQuantizer(block_size=16,
                                                                               beta=0.4))
        store.append(k, v)
        attn = CertifiedAttention(AdaptiveTopK(rank=rank), backend=TorchBackend())
        fails[rank] = 0
        for step in range(30):
            q = make_query(k, 3, seed=step, peaked=step % 2 == 0)
            out, cert = attn(q, store)
            check_heads(out, cert, q, store)
            store.observe(cert)
            store.append(*make_kv(3, 1, 64, seed=1000 + step))
            fails[rank] += int((~cert.boundary_ok).sum())
    assert fails["upper"] < fails["mass"] / 4, fails


def test_contract_holds_across_reallocations_at_real_sizes():
    k, v = make_kv(2, 370, 64, seed=7, outlier_channels=3, heavy_tail=True)
    store = TieredKVStore(2, 64, block_size=16, quantizer=SmartKVQuantizer(block_size=16,
                                                                           beta=0.2))
    store.append(k[:, :300], v[:, :300])
    list(decode_steps(store, k, v, 300, 70, check=True))
    assert store._tracker.reallocations >= 3  # prefill and every f(N) ~ 26 steps
