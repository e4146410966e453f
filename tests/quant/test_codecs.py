"""Codecs: round trip within the stated bound, packing, byte counts (paper 2.3, Table 13)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from certkv import ChannelAffineKeyCodec, FP16KeyCodec, FP16ValueCodec, GroupAffineValueCodec
from certkv.errors import ConfigError
from certkv.quant.packing import pack_bits, unpack_bits


def blocks(seed, shape, scale, outliers=False, constant_channel=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * scale
    if outliers:
        x[..., 0] *= 300
    if constant_channel:
        x[..., 1] = 1.5
    return x.clamp(-6e4, 6e4).half()


@given(bits=st.sampled_from([2, 4, 8]), n=st.integers(1, 64))
def test_pack_unpack_round_trip(bits, n):
    n = n * (8 // bits)
    codes = torch.randint(0, 1 << bits, (3, n), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (3, n * bits // 8)
    assert torch.equal(unpack_bits(packed, bits), codes)


def test_pack_rejects_unpackable_width():
    with pytest.raises(ConfigError, match="multiple of 4"):
        pack_bits(torch.zeros(2, 6, dtype=torch.uint8), 2)


@given(bits=st.sampled_from([8, 4, 2]), seed=st.integers(0, 10_000),
       scale=st.sampled_from([1e-4, 1.0, 50.0, 3e3]), outliers=st.booleans(),
       constant=st.booleans(), block=st.sampled_from([1, 2, 16]))
def test_key_round_trip_within_channel_bound(bits, seed, scale, outliers, constant, block):
    codec = ChannelAffineKeyCodec(bits=bits)
    k = blocks(seed, (2, 3, block, 16), scale, outliers, constant)
    enc = codec.encode(k)
    err = (codec.decode(enc).double() - k.double()).abs().amax(dim=-2)  # [Hkv, n, d]
    assert (err <= codec.channel_bound(enc).double()).all()


def test_key_codes_follow_eq_2_3_and_never_clip():
    k = blocks(0, (1, 1, 16, 8), 2.0)
    codec = ChannelAffineKeyCodec(bits=8)
    enc = codec.encode(k)
    codes = codec.codes(enc)
    lo, hi = k.float().amin(dim=2), k.float().amax(dim=2)
    torch.testing.assert_close(enc["scale"], (hi - lo) / 255)
    torch.testing.assert_close(enc["offset"], lo + 128 * (hi - lo) / 255)
    assert codes.min() == -128 and codes.max() == 127  # channel min/max map to the end codes
    assert enc["codes"].dtype == torch.int8


def test_constant_channel_reconstructs_exactly():
    k = torch.full((1, 1, 16, 4), 0.75, dtype=torch.float16)
    codec = ChannelAffineKeyCodec()
    enc = codec.encode(k)
    assert torch.equal(codec.decode(enc), k.float())
    assert (codec.channel_bound(enc) == 0).all()


@given(bits=st.sampled_from([4, 8, 2]), group=st.sampled_from([4, 8, 16, 32]),
       seed=st.integers(0, 10_000), scale=st.sampled_from([1e-3, 1.0, 100.0, 2e4]),
       outliers=st.booleans())
def test_value_round_trip_within_token_bound(bits, group, seed, scale, outliers):
    codec = GroupAffineValueCodec(bits=bits, group=group)
    v = blocks(seed, (2, 2, 4, 32), scale, outliers)
    enc = codec.encode(v)
    err = (codec.decode(enc).double() - v.double()).norm(dim=-1)
    assert (err <= codec.token_bound(enc).double()).all()
    assert enc["scale"].dtype == torch.float16 and enc["offset"].dtype == torch.float16


@pytest.mark.parametrize(("key_bits", "value_bits", "d", "expected"), [
    (8, 4, 128, 288),  # Table 13: 128 + 64 + 64 + 32
    (8, 4, 64, 144),  # SmolLM2 head_dim
    (4, 4, 128, 64 + 64 + 64 + 32),
    (2, 4, 128, 32 + 64 + 64 + 32),
    (8, 8, 128, 128 + 64 + 128 + 32),
    (8, 2, 128, 128 + 64 + 32 + 32),
])
def test_tier1_bytes_per_token_match_table_13(key_bits, value_bits, d, expected):
    k = blocks(0, (1, 4, 16, d), 1.0)
    key = ChannelAffineKeyCodec(bits=key_bits).encode(k)
    value = GroupAffineValueCodec(bits=value_bits, group=16).encode(k)
    total = sum(t.numel() * t.element_size() for t in (*key.values(), *value.values()))
    assert total / (4 * 16) == expected


def test_fp16_codecs_are_exact():
    x = blocks(1, (2, 3, 16, 8), 3.0)
    for codec in (FP16KeyCodec(), FP16ValueCodec()):
        enc = codec.encode(x)
        assert torch.equal(codec.decode(enc), x.float())
    assert (FP16KeyCodec().channel_bound(FP16KeyCodec().encode(x)) == 0).all()
    assert (FP16ValueCodec().token_bound(FP16ValueCodec().encode(x)) == 0).all()


def test_bad_codec_parameters_name_the_fix():
    with pytest.raises(ConfigError, match="bits=5 is not supported"):
        ChannelAffineKeyCodec(bits=5)
    with pytest.raises(ConfigError, match="does not divide head_dim=48"):
        GroupAffineValueCodec(group=32).validate(48, 16)
    with pytest.raises(ConfigError, match="positive integer"):
        GroupAffineValueCodec(group=0)


@pytest.mark.parametrize("codec, head_dim, fixed", [
    (GroupAffineValueCodec(bits=4, group=4), 7, 8),
    (ChannelAffineKeyCodec(bits=2), 6, 8),
])
def test_an_unpackable_head_dim_is_named_before_the_group(codec, head_dim, fixed):
    """The first message names a fix that works: following it passes validation (it used to
    advise value_group=7 for head_dim=7, which 4-bit packing then refused)."""
    with pytest.raises(ConfigError, match=f"head_dim={head_dim} cannot hold .* e.g. {fixed}"):
        codec.validate(head_dim, 16)
    codec.validate(fixed, 16)
