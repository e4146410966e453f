"""InnerQ (seed 002): inner-dimension groups, asymmetric / symmetric / hybrid modes, windows, the
key normalization compensated on the query, bytes, and the certificate contract."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    KINDS,
    adversarial,
    assert_keys_within_bound,
    assert_values_within_bound,
    check_steps,
    examples,
    make_kv,
    make_query,
    step_draws,
    tier1_bytes,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from certkv import CertifiedAttention, TieredKVStore
from certkv.config import option
from certkv.errors import ConfigError
from certkv.kernels.reference import TorchBackend
from certkv.quant import InnerQKeyCodec, InnerQValueCodec, KVQuantizer
from certkv.quant.innerq import decode_groups, key_exponents, quantize_groups

MODES = ("asym", "sym", "hybrid")


def innerq(bits=2, mode="hybrid", group=32, normalize=True, block=32, sink=32, residual=96):
    return KVQuantizer(InnerQKeyCodec(bits=bits, group=group, mode=mode, normalize=normalize),
                       InnerQValueCodec(bits=bits, mode=mode), block, residual=residual,
                       sink=sink)


# ---------------------------------------------------------------- codecs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_round_trip_within_the_stated_bound(kind, mode, bits):
    x = adversarial(kind, (2, 3, 32, 64), seed=bits)
    for normalize in (True, False):
        assert_keys_within_bound(InnerQKeyCodec(bits=bits, mode=mode, normalize=normalize), x)
    assert_values_within_bound(InnerQValueCodec(bits=bits, mode=mode), x)


@pytest.mark.parametrize("bits", [2, 4])
def test_hybrid_keeps_the_lower_error_and_stores_its_mode(bits):
    x = adversarial("outliers", (2, 4, 32, 64), seed=5).double().reshape(2, 4, 32, 2, 32)
    x[0, 0, 0, 0] = torch.linspace(10, 11, 32, dtype=torch.float64)  # asymmetric wins here
    asym, sym, hybrid = (quantize_groups(x, bits, m) for m in MODES)

    def error(groups):
        return (decode_groups(groups).double() - x).square().sum(dim=-1)

    expect = error(sym) <= error(asym)
    assert torch.equal(hybrid.sym, expect)
    assert expect.any() and not expect.all()  # both modes occur
    assert torch.equal(error(hybrid), torch.minimum(error(asym), error(sym)))
    assert not asym.sym.any() and sym.sym.all()
    # the stored mode bits decode back to the same choice
    codec = InnerQKeyCodec(bits=bits, normalize=False)
    blocks = codec.encode(x.reshape(2, 4, 32, 64).half())
    assert torch.equal(codec.groups(blocks).sym, expect)


def test_symmetric_groups_store_signs_and_decode_exactly_in_fp32():
    x = torch.tensor([[-3.0, 2.0, 0.0, -1.0] * 8], dtype=torch.float64)  # one group of 32
    groups = quantize_groups(x, 2, "sym")
    assert groups.scale.item() == 1.0 and groups.codes[0, :4].tolist() == [3, 2, 0, 1]
    assert torch.equal(decode_groups(groups).double(), x)
    assert groups.slot.dtype == torch.int32 and groups.slot.item() < 0  # element 31 < 0: bit 31
    # bit i is set exactly where element i is negative
    bits = [(int(groups.slot.item()) >> i) & 1 for i in range(32)]
    assert bits == [1, 0, 0, 1] * 8


def test_asymmetric_zero_point_is_kept_exactly_in_fp32():
    x = torch.tensor([[2.0**-30 * 3, 1.0 + 2.0**-10, 7.0, 5.5]], dtype=torch.float64)
    groups = quantize_groups(x, 2, "asym")
    assert groups.slot.view(torch.float32).double().item() == x.min().item()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_codes_pack_at_every_width_and_bytes_are_counted(bits):
    hkv, n, block, d, group = 2, 3, 32, 64, 32
    x = adversarial("random", (hkv, n, block, d), seed=1)
    keys, values = InnerQKeyCodec(bits=bits), InnerQValueCodec(bits=bits)
    kb, vb = keys.encode(x), values.encode(x)
    assert kb["codes"].shape == vb["codes"].shape == (hkv, n, block, d * bits // 8)
    # keys: codes, an FP16 scale and a 32-bit slot per group, a mode bit per group (packed per
    # block), an int8 norm exponent per channel; values: codes, scale + slot + mode bit per
    # channel over the block's tokens
    key_bytes = block * d * bits // 8 + block * d // group * 6 + -(-block * d // group // 8) + d
    value_bytes = block * d * bits // 8 + d * 6 + d // 8
    assert tier1_bytes(kb) == hkv * n * key_bytes
    assert tier1_bytes(vb) == hkv * n * value_bytes
    # 2 bits at d=64: 30.25 + 28.25 bytes per token per kv head against FP16's 256
    if bits == 2:
        assert (key_bytes + value_bytes) / block == pytest.approx(58.5)


def test_bad_settings_get_one_sentence_naming_the_fix():
    with pytest.raises(ConfigError, match="is not an InnerQ mode; use one of"):
        InnerQKeyCodec(mode="both")
    with pytest.raises(ConfigError, match="group=48 must be 1-32 channels"):
        InnerQKeyCodec(group=48)
    with pytest.raises(ConfigError, match="does not divide head_dim=48; use a divisor"):
        InnerQKeyCodec(group=32).validate(48, 32)
    with pytest.raises(ConfigError, match="block_size=64; use block_size=32"):
        TieredKVStore(1, 64, block_size=64, quantizer=innerq(block=64))


# ---------------------------------------------------------------- key normalization


def test_normalization_leaves_logits_unchanged_bit_for_bit():
    """Dividing keys by ``2^e_c`` and multiplying the query by it: every product and so every
    FP32 logit is the same, in full precision and on the quantized keys."""
    k, _ = make_kv(2, 64, 64, seed=3, outlier_channels=3)
    k = k.half().float()
    q = make_query(k, 1, seed=4, scale=30.0)  # [Hq, d], one query head per kv head
    codec = InnerQKeyCodec(bits=2)
    blocks = codec.encode(k.half().reshape(2, 2, 32, 64))
    e = blocks["norm"][:, 0]  # [Hkv, d]: one exponent per channel over the blocks given
    assert torch.equal(e, key_exponents(k.abs().amax(dim=1))) and e.abs().max() > 0
    power = torch.exp2(e.float())
    exact = torch.einsum("hd,htd->ht", q, k)
    compensated = torch.einsum("hd,htd->ht", q * power, k / power.unsqueeze(1))
    assert torch.equal(exact, compensated)
    normalized = dict(blocks, norm=torch.zeros_like(blocks["norm"]))  # the stored k / 2^e
    k_hat = codec.decode(blocks).reshape(2, 64, 64)
    k_norm = codec.decode(normalized).reshape(2, 64, 64)
    assert torch.equal(k_hat, k_norm * power.unsqueeze(1))
    assert torch.equal(torch.einsum("hd,htd->ht", q, k_hat),
                       torch.einsum("hd,htd->ht", q * power, k_norm))


def test_the_store_normalizes_by_the_prefill_and_windows_stay_exact():
    k, v = make_kv(1, 320, 64, seed=6, outlier_channels=2)
    store = TieredKVStore(1, 64, block_size=32, quantizer=innerq())
    store.append(k[:, :256], v[:, :256])  # prefill: blocks 0..7, tail empty
    prefill_exponents = key_exponents(k[:, :256].half().abs().amax(dim=1).float())
    # sink block 0 and the recent window (ages < 96: blocks 5, 6, 7) exact, blocks 1-4 not
    assert store.quantized_mask().tolist() == [False, True, True, True, True, False, False,
                                               False]
    for _ in range(64):  # decode: blocks 5 and 6 leave the window, block 8 and 9 join it
        store.append(k[:, 256 + _ : 257 + _], v[:, 256 + _ : 257 + _])
    assert store.quantized_mask().tolist() == [False] + [True] * 6 + [False] * 3
    (_, key_blocks, _, _), = [g for g in store.block_groups("key") if not g[0].exact]
    assert torch.equal(key_blocks["norm"], prefill_exponents.unsqueeze(1).expand(1, 6, 64))


def test_hybrid_prefill_is_hybrid_at_prefill_and_symmetric_in_decode():
    k, v = make_kv(2, 256 + 96, 64, seed=8, key_offset=3.0)  # offset keys: asymmetric wins
    store = TieredKVStore(2, 64, block_size=32, quantizer=innerq(mode="hybrid_prefill", sink=0,
                                                                 residual=0))
    store.append(k[:, :256], v[:, :256])
    store.append(k[:, 256:], v[:, 256:])
    (precision, blocks, _, _), = [g for g in store.block_groups("key") if not g[0].exact]
    sym = precision.key_codec.groups(blocks).sym  # [Hkv, n, B, d / 32]
    assert not sym[:, :8].all()  # the prefill's blocks chose per group: some asymmetric
    assert sym[:, 8:].all()  # decode's blocks are symmetric


def test_a_later_key_beyond_the_prefill_range_raises_its_block_exponent():
    k = torch.full((1, 64, 32), 0.01)
    k[:, 32:, 0] = 60000.0  # decode keys far beyond the prefill's maximum
    codec = InnerQKeyCodec(bits=2, group=32)
    assert_keys_within_bound(codec, k.half().reshape(1, 2, 32, 32))
    from certkv.quant.base import LayerContext

    blocks = codec.encode_at(k.half().reshape(1, 2, 32, 32), torch.tensor([0, 32]),
                             LayerContext(torch.full((1, 32), 0.01)))
    assert torch.isfinite(blocks["scale"].float()).all()
    assert blocks["norm"][0, 1, 0] > blocks["norm"][0, 0, 0]
    err = (codec.decode(blocks).double() - k.half().double().reshape(1, 2, 32, 32)).abs()
    assert (err.amax(dim=2) <= codec.channel_bound(blocks).double()).all()


def test_the_config_option_builds_the_seed_defaults():
    from hydra.utils import instantiate

    q = instantiate(option("quantizer", "innerq"))
    assert (q.block_size, q.sink, q.residual) == (32, 32, 96)
    assert q.key_codec == InnerQKeyCodec(bits=2, group=32, mode="hybrid", normalize=True)
    assert q.value_codec == InnerQValueCodec(bits=2, mode="hybrid")


# ---------------------------------------------------------------- the certificate contract


@st.composite
def scenarios(draw):
    return {
        "bits": draw(st.sampled_from([2, 3, 4, 8])),
        "mode": draw(st.sampled_from(["asym", "sym", "hybrid", "hybrid_prefill"])),
        "group": draw(st.sampled_from([8, 16, 32])),
        "normalize": draw(st.booleans()),
        "block": draw(st.sampled_from([4, 8, 16, 32])),
        "sink": draw(st.sampled_from([0, 8])),
        "residual": draw(st.sampled_from([0, 16])),
        **step_draws(draw, 150, [1, 9, 33]),
    }


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_contract_with_innerq(sc):
    """Every head of every step within its bound against FP64 attention on the originals:
    windows, every mode (hybrid_prefill switching at the first decode append), normalization
    on and off, blocks leaving the recent window mid-decode."""
    d = 32
    quantizer = innerq(sc["bits"], sc["mode"], sc["group"], sc["normalize"], sc["block"],
                       sc["sink"], sc["residual"])
    store = TieredKVStore(sc["hkv"], d, block_size=sc["block"], quantizer=quantizer,
                          decoded_mirror=sc["seed"] % 2 == 0)
    k, v = make_kv(sc["hkv"], sc["tokens"], d, seed=sc["seed"], outlier_channels=sc["outliers"],
                   heavy_tail=sc["heavy_tail"], key_offset=sc["key_offset"])
    check_steps(store, CertifiedAttention(backend=TorchBackend()), k, v, sc)
