"""3-bit packing, KIVI keys and the Hadamard-rotated codecs: bounds on adversarial data, bytes."""

from __future__ import annotations

import math

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
from hypothesis import given, settings
from hypothesis import strategies as st

from certkv import CertifiedAttention, TieredKVStore
from certkv.errors import ConfigError
from certkv.quant import (
    ChannelAffineKeyCodec,
    GroupAffineValueCodec,
    KiviKeyCodec,
    RotatedKeyCodec,
    RotatedValueCodec,
)
from certkv.quant.packing import check_packable, pack_bits, unpack_bits
from certkv.quant.rotation import MAX_HEAD_DIM, fwht, hadamard

U = 2.0**-24
FAST = settings(max_examples=examples(50), deadline=None)


# ---------------------------------------------------------------- 3-bit packing


@FAST
@given(runs=st.integers(1, 16), lead=st.integers(1, 3))
def test_pack3_round_trip(runs, lead):
    codes = torch.randint(0, 8, (lead, 8 * runs), dtype=torch.uint8)
    packed = pack_bits(codes, 3)
    assert packed.dtype == torch.uint8 and packed.shape == (lead, 3 * runs)
    assert torch.equal(unpack_bits(packed, 3), codes)


def test_pack3_bit_order_is_little_endian():
    """Code i of a run sits at bits [3i, 3i + 3) of the 24-bit word byte0 | byte1 << 8 | ..."""
    codes = torch.zeros(8, dtype=torch.uint8)
    codes[0], codes[2], codes[7] = 5, 7, 6  # code 2 straddles bytes 0 and 1
    word = 5 | 7 << 6 | 6 << 21
    assert pack_bits(codes, 3).tolist() == [word & 255, word >> 8 & 255, word >> 16]


def test_pack3_rejects_unpackable_widths():
    with pytest.raises(ConfigError, match="cannot be packed at 3 bits; make it a multiple of 8"):
        pack_bits(torch.zeros(2, 12, dtype=torch.uint8), 3)
    with pytest.raises(ConfigError, match="multiple of 3"):
        unpack_bits(torch.zeros(2, 4, dtype=torch.uint8), 3)
    with pytest.raises(ConfigError, match=r"head_dim=12 cannot hold 3-bit key codes \(8 codes "
                       r"per 3 bytes\); use a head_dim that is a multiple of 8, e.g. 16"):
        check_packable(12, 3, "key")
    with pytest.raises(ConfigError, match=r"\(4 per byte\); use a head_dim that is a multiple "
                       r"of 4, e.g. 8"):  # the 2/4-bit message is unchanged
        check_packable(6, 2, "key")


@pytest.mark.parametrize("kind", KINDS)
def test_three_bit_affine_codecs_keep_their_bounds(kind):
    x = adversarial(kind, (2, 3, 16, 64), seed=3)
    keys = ChannelAffineKeyCodec(bits=3)
    enc = assert_keys_within_bound(keys, x)
    codes = keys.codes(enc)
    assert codes.min() >= -4 and codes.max() <= 3  # signed 3-bit codes
    values = GroupAffineValueCodec(bits=3, group=32)
    venc = assert_values_within_bound(values, x)
    # per token: 24 code bytes + 8 bytes per channel per 16-token block; 24 + 2 * 2 bytes
    assert tier1_bytes(enc) == 2 * 3 * 16 * (24 + 8 * 64 // 16)
    assert tier1_bytes(venc) == 2 * 3 * 16 * (24 + 4 * 64 // 32)
    with pytest.raises(ConfigError, match="multiple of 8"):
        keys.validate(4, 16)


# ---------------------------------------------------------------- KIVI keys


@FAST
@given(bits=st.sampled_from([2, 3, 4, 8]), kind=st.sampled_from(KINDS),
       seed=st.integers(0, 10_000), block=st.sampled_from([1, 2, 32]))
def test_kivi_round_trip_within_channel_bound(bits, kind, seed, block):
    codec = KiviKeyCodec(bits=bits)
    k = adversarial(kind, (2, 2, block, 64), seed)
    enc = assert_keys_within_bound(codec, k)
    assert enc["scale"].dtype == torch.float16 and enc["offset"].dtype == torch.float16
    # metadata: the exact channel minimum, a scale that covers the spread (never clips)
    x = k.double()
    lo, hi = x.amin(dim=-2), x.amax(dim=-2)
    scale = enc["scale"].double()
    assert torch.equal(enc["offset"].double(), lo)
    assert (scale * codec.levels >= hi - lo).all()
    assert torch.equal(scale == 0, hi == lo)
    live = (scale > 0).unsqueeze(-2)
    quotient = (x - lo.unsqueeze(-2)) / torch.where(live, scale.unsqueeze(-2), 1.0)
    assert (quotient >= 0).all() and (quotient <= codec.levels).all()
    assert torch.equal(codec.codes(enc).double(), torch.round(quotient))


def test_kivi_constant_channel_is_exact_and_scale_is_the_fp16_round_up():
    k = adversarial("constant", (1, 2, 32, 64), seed=1)
    codec = KiviKeyCodec(bits=2)
    enc = codec.encode(k)
    assert (codec.channel_bound(enc)[..., 1] == 0).all()
    assert (codec.decode_slack(enc)[..., 1] == 0).all()
    assert torch.equal(codec.decode(enc)[..., 1], k.float()[..., 1])
    # the scale is the smallest FP16 number s with 3 s >= spread
    spread = (k.double().amax(dim=-2) - k.double().amin(dim=-2))
    below = torch.nextafter(enc["scale"], torch.zeros_like(enc["scale"])).double()
    assert ((below * 3 < spread) | (enc["scale"] == 0)).all()


def test_kivi_subnormal_spread_gets_a_positive_scale():
    k = torch.zeros(1, 1, 4, 8, dtype=torch.float16)
    k[0, 0, 1, :] = 2.0**-24  # the smallest FP16 subnormal: spread / 3 underflows FP16
    codec = KiviKeyCodec(bits=2)
    enc = assert_keys_within_bound(codec, k)
    assert (enc["scale"].double() == 2.0**-24).all()
    assert torch.equal(codec.decode(enc), k.float())


@pytest.mark.parametrize("kind", ["huge", "mixed", "outliers"])
def test_kivi_decode_slack_covers_other_fp32_evaluations(kind):
    codec = KiviKeyCodec(bits=8)
    enc = codec.encode(adversarial(kind, (2, 2, 32, 64), seed=5))
    own = codec.decode(enc).double()
    q = codec.codes(enc).float()
    s, o = enc["scale"].float().unsqueeze(-2), enc["offset"].float().unsqueeze(-2)
    exact = (q.double() * s.double() + o.double())
    for other in (torch.addcmul(o, q, s), o + s * q, exact.float(), (q * s).add(o)):
        diff = (other.double() - own).abs().amax(dim=-2)
        assert (diff <= codec.decode_slack(enc).double()).all()


@pytest.mark.parametrize(("bits", "per_token"), [(2, 24), (3, 32), (4, 40), (8, 72)])
def test_kivi_bytes_are_codes_plus_four_bytes_per_channel_per_block(bits, per_token):
    """d=64, B=32: ``64 * 32 * bits / 8`` code bytes + ``4 * 64`` metadata bytes per block."""
    codec = KiviKeyCodec(bits=bits)
    enc = codec.encode(adversarial("random", (2, 3, 32, 64)))
    per_block = 64 * 32 * bits // 8 + 4 * 64
    assert tier1_bytes(enc) == 2 * 3 * per_block
    assert per_block / 32 == per_token
    assert codec.name == "kivi" and KiviKeyCodec().bits == 4


# ---------------------------------------------------------------- Hadamard rotation


@pytest.mark.parametrize("d", [1, 2, 4, 8, 16, 64, 128, 256])
def test_hadamard_is_orthogonal_up_to_d_and_fwht_applies_it(d):
    h = hadamard(d)
    assert torch.equal(h.abs(), torch.ones(d, d, dtype=torch.float64))
    assert torch.equal(h, h.T)
    assert torch.equal(h.T @ h, d * torch.eye(d, dtype=torch.float64))
    x = torch.randint(-1000, 1000, (3, d), dtype=torch.float64)  # integers: exact either way
    assert torch.equal(fwht(x), x @ h.T)


def test_random_hadamard_basis_is_seeded_and_orthogonal():
    d = 64
    a, b = RotatedKeyCodec(seed=1), RotatedKeyCodec(seed=2)
    assert torch.equal(a.signs(d), RotatedKeyCodec(seed=1).signs(d))
    assert not torch.equal(a.signs(d), b.signs(d))
    assert set(a.signs(d).tolist()) == {-1.0, 1.0}
    assert torch.equal(RotatedKeyCodec(rotation="hadamard").signs(d), torch.ones(d).double())
    for codec in (a, b, RotatedValueCodec(rotation="hadamard")):
        basis = codec.basis(d)
        assert torch.equal(basis.T @ basis, d * torch.eye(d, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["huge", "subnormal", "mixed"])
def test_rotation_is_exact_in_fp64(kind):
    """``H D k`` in FP64 equals the integer computation on ``2^24 k`` (FP16 grid), d = 256."""
    d = MAX_HEAD_DIM
    k = adversarial(kind, (3, d), seed=2)
    signs = RotatedKeyCodec(seed=7).signs(d)
    scaled = (k.double() * 2.0**24).to(torch.int64) * signs.to(torch.int64)
    exact = scaled @ hadamard(d).to(torch.int64).T
    assert exact.abs().max() < 2**53
    assert torch.equal(fwht(k.double() * signs) * 2.0**24, exact.double())


@pytest.mark.parametrize("codec_type", [RotatedKeyCodec, RotatedValueCodec])
def test_eight_bit_rotation_round_trip_is_close(codec_type):
    codec = codec_type(bits=8, subspaces=4)
    x = adversarial("outliers", (2, 2, 16, 64), seed=4)
    out = codec.decode(codec.encode(x))
    assert out.dtype == torch.float32 and out.shape == x.shape
    rel = (out.double() - x.double()).norm(dim=-1) / x.double().norm(dim=-1)
    assert rel.max() < 1e-2


@FAST
@given(bits=st.sampled_from([2, 3, 4, 8]), subspaces=st.sampled_from([1, 4, 8]),
       rotation=st.sampled_from(["hadamard", "random_hadamard"]), kind=st.sampled_from(KINDS),
       seed=st.integers(0, 10_000), block=st.sampled_from([1, 2, 32]))
def test_rotated_round_trip_within_bounds(bits, subspaces, rotation, kind, seed, block):
    x = adversarial(kind, (2, 2, block, 64), seed)
    keys = RotatedKeyCodec(bits=bits, subspaces=subspaces, rotation=rotation, seed=seed)
    enc = assert_keys_within_bound(keys, x)
    bound = keys.channel_bound(enc)
    assert torch.equal(bound, bound[..., :1].expand_as(bound))  # the same for every channel
    values = RotatedValueCodec(bits=bits, subspaces=subspaces, rotation=rotation, seed=seed)
    venc = assert_values_within_bound(values, x)
    assert enc["scale"].dtype == torch.float16 and venc["offset"].dtype == torch.float16
    assert enc["scale"].shape == (2, 2, block, subspaces)


def test_rotated_key_bound_is_the_largest_token_l1_of_half_steps():
    codec = RotatedKeyCodec(bits=2, subspaces=4)
    enc = codec.encode(adversarial("random", (1, 1, 8, 64), seed=9))
    half = enc["scale"].double() / 2 * 16  # g = 16 coordinates per subspace
    expected = half.sum(dim=-1).amax(dim=-1)
    bound = codec.channel_bound(enc)[..., 0].double()
    assert (bound >= expected).all() and (bound <= expected * (1 + 1e-4)).all()


@pytest.mark.parametrize("codec_type", [RotatedKeyCodec, RotatedValueCodec])
def test_rotated_exact_tokens_have_bound_zero(codec_type):
    codec = codec_type(bits=2)
    x = torch.zeros(1, 2, 4, 64, dtype=torch.float16)
    enc = codec.encode(x)
    assert torch.equal(codec.decode(enc), x.float())
    bound = codec.channel_bound(enc) if codec_type is RotatedKeyCodec else codec.token_bound(enc)
    assert (bound == 0).all()


def _fp32_decodes(codec, enc):
    """Other FP32 evaluations of the rotated decode: a matmul with the FP32 basis and a
    sequential left-to-right accumulation."""
    q = unpack_bits(enc["codes"], codec.bits).float()
    d = q.shape[-1]
    sub = q.reshape(*q.shape[:-1], codec.subspaces, d // codec.subspaces)
    z_hat = torch.addcmul(enc["offset"].float().unsqueeze(-1), sub,
                          enc["scale"].float().unsqueeze(-1)).reshape(q.shape)
    basis = codec.basis(d).float()
    acc = torch.zeros_like(z_hat)
    for j in range(d):
        acc = acc + z_hat[..., j : j + 1] * basis[j]
    return z_hat @ basis, acc


@pytest.mark.parametrize("kind", ["mixed", "huge", "outliers", "subnormal"])
def test_rotated_decode_slack_and_rounding_cover_other_fp32_evaluations(kind):
    x = adversarial(kind, (2, 2, 16, 64), seed=6)
    keys, values = RotatedKeyCodec(bits=8), RotatedValueCodec(bits=8)
    kenc, venc = keys.encode(x), values.encode(x)
    own = keys.decode(kenc).double()
    assert torch.equal(own, values.decode(venc).double())  # the same scheme
    limit = values.decode_rounding(64) * U * (x.double().norm(dim=-1) + 2.0**-24 * 8)
    for other in _fp32_decodes(keys, kenc):
        diff = other.double() - own
        assert (diff.abs().amax(dim=-2) <= keys.decode_slack(kenc).double()).all()
        assert (diff.norm(dim=-1) <= limit).all()
    assert values.decode_rounding() >= values.decode_rounding(64) > 0  # default: any head_dim


@pytest.mark.parametrize(("bits", "subspaces", "per_token"),
                         [(2, 4, 32), (2, 8, 48), (3, 4, 40), (4, 4, 48), (8, 4, 80)])
def test_rotated_bytes_are_codes_plus_four_bytes_per_subspace_per_token(bits, subspaces,
                                                                        per_token):
    """d=64, B=32: ``64 * bits / 8`` code bytes + ``2 + 2`` bytes per subspace per token."""
    x = adversarial("random", (2, 3, 32, 64))
    for codec_type in (RotatedKeyCodec, RotatedValueCodec):
        enc = codec_type(bits=bits, subspaces=subspaces).encode(x)
        assert 64 * bits // 8 + 4 * subspaces == per_token
        assert tier1_bytes(enc) == 2 * 3 * 32 * per_token


# ---------------------------------------------------------------- in the certified store


@pytest.mark.parametrize(("key_codec", "value_codec"), [
    (KiviKeyCodec(bits=2), GroupAffineValueCodec(bits=2, group=32)),  # KIVI-2
    (RotatedKeyCodec(bits=2), RotatedValueCodec(bits=2)),
    (KiviKeyCodec(bits=3), RotatedValueCodec(bits=3, subspaces=8, rotation="hadamard")),
])
def test_certificate_holds_with_the_new_codecs(key_codec, value_codec):
    store = TieredKVStore(2, 64, block_size=32, key_codec=key_codec, value_codec=value_codec)
    k, v = make_kv(2, 200, 64, seed=1, outlier_channels=3)
    store.append(k, v)
    q = make_query(k, 2, seed=1, peaked=True)
    out, cert = CertifiedAttention()(q, store)
    check_heads(out, cert, q, store)


# ---------------------------------------------------------------- configuration errors


def test_bad_parameters_name_the_fix():
    with pytest.raises(ConfigError, match=r"bits=5 is not supported; use one of \(2, 3, 4, 8\)"):
        KiviKeyCodec(bits=5)
    with pytest.raises(ConfigError, match="bits=1 is not supported"):
        RotatedValueCodec(bits=1)
    with pytest.raises(ConfigError, match="head_dim=12 cannot hold 3-bit key codes"):
        KiviKeyCodec(bits=3).validate(12, 16)
    with pytest.raises(ConfigError, match="head_dim=96 is not a power of two"):
        RotatedKeyCodec().validate(96, 16)
    with pytest.raises(ConfigError, match="head_dim=512 exceeds 256"):
        RotatedValueCodec().validate(512, 16)
    with pytest.raises(ConfigError, match="subspaces=8 does not divide head_dim=4"):
        RotatedKeyCodec(subspaces=8).validate(4, 16)
    with pytest.raises(ConfigError, match="head_dim=4 cannot hold 3-bit value codes"):
        RotatedValueCodec(bits=3, subspaces=2).validate(4, 16)
    with pytest.raises(ConfigError, match="rotation='orthogonal' is not supported"):
        RotatedKeyCodec(rotation="orthogonal")
    with pytest.raises(ConfigError, match="subspaces=0 must be a positive integer"):
        RotatedKeyCodec(subspaces=0)
    with pytest.raises(ConfigError, match="not a power of two"):
        RotatedKeyCodec().encode(torch.zeros(1, 1, 2, 48, dtype=torch.float16))
    for codec in (KiviKeyCodec(bits=3), RotatedKeyCodec(bits=3), RotatedValueCodec(bits=3)):
        codec.validate(64, 16)
    assert math.isfinite(RotatedValueCodec().decode_rounding())
