"""Pre-RoPE key codec, the model's RoPE spec, and the dense-and-sparse value codec (KVQuant)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from certkv.errors import ConfigError
from certkv.models import cache_kwargs
from certkv.quant import (
    ChannelAffineKeyCodec,
    FP16KeyCodec,
    GroupAffineValueCodec,
    KVQuantizer,
    OutlierValueCodec,
    PreRoPEKeyCodec,
)
from certkv.quant.outlier_value import normal_float_levels
from certkv.quant.packing import SUPPORTED_BITS
from certkv.quant.rope import RopeSpec, rope_spec

U = 2.0**-24
SMOLLM2_ROPE = RopeSpec.from_theta(1e5, 64)  # SmolLM2-135M: rope_theta 1e5, head_dim 64
VALUE_BITS = [b for b in (2, 3, 4, 8) if b in SUPPORTED_BITS]


def pre_rope_keys(seed, shape, scale, rope, start):
    """Adversarial keys: pre-RoPE outlier channels (one pair both outliers), a constant
    channel, a massive token; rotated at positions ``start + t`` and rounded to FP16 (what the
    store receives)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale
    d = shape[-1]
    x[..., 3] *= 300
    x[..., 3 + d // 2] *= 40
    x[..., 9] *= 80
    x[..., 5] = 1.5 * scale  # constant before RoPE
    x[:, :, 0] *= 20  # an attention-sink-like token
    positions = start[:, None] + torch.arange(shape[2])
    return rope.rotate(x, positions).clamp(-3e4, 3e4).half()


def check_key_bound(codec, k, start):
    enc = codec.encode_at(k, start)
    err = (codec.decode(enc).double() - k.double()).abs().amax(dim=-2)  # [Hkv, n, d]
    bound = codec.channel_bound(enc)
    assert bound.dtype == torch.float32 and bound.shape == err.shape
    assert (err <= bound.double()).all(), float((err / bound.double()).max())
    return enc, err, bound.double()


def fp32_rotation(codec, enc):
    """Another FP32 evaluation of the pre-RoPE decode: FP32 cos/sin of the stored angles, FP32
    products and sums, scaling folded into the tables (as transformers does)."""
    pre = codec.inner.decode({k: v for k, v in enc.items() if k != "pos"})
    pos = enc["pos"].long()[..., None] + torch.arange(pre.shape[-2])
    theta = codec.rope.angles(pos)
    a = codec.rope.attention_scaling
    cos, sin = (torch.cos(theta) * a).float(), (torch.sin(theta) * a).float()
    half = pre.shape[-1] // 2
    x, y = pre[..., :half], pre[..., half:]
    return torch.cat([x * cos - y * sin, y * cos + x * sin], dim=-1)


# ---------------------------------------------------------------------- (a) key round trip
@pytest.mark.parametrize("scaling", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("scale", [1e-4, 1.0, 3e3])
@pytest.mark.parametrize("inner", [ChannelAffineKeyCodec(bits=2), ChannelAffineKeyCodec(bits=4),
                                   ChannelAffineKeyCodec(bits=8), FP16KeyCodec()],
                         ids=["k2", "k4", "k8", "fp16"])
def test_pre_rope_round_trip_within_channel_bound(inner, scale, scaling):
    rope = RopeSpec(SMOLLM2_ROPE.inv_freq, scaling)
    start = torch.tensor([0, 32, 8000, 30000])
    k = pre_rope_keys(int(scale * 7 + scaling * 10), (2, 4, 32, 64), scale, rope, start)
    codec = PreRoPEKeyCodec(inner, rope=rope)
    enc, err, bound = check_key_bound(codec, k, start)
    assert enc["pos"].dtype == torch.int32 and enc["pos"].shape == (2, 4)
    assert torch.equal(enc["pos"][0], start.int())
    # the bound is a bound, not a blanket: its largest ratio is close to 1 where errors are big
    if inner.bits <= 4:
        assert (err / bound).max() > 0.5
    # any FP32 evaluation of the decode stays within decode_slack of the codec's own
    slack = codec.decode_slack(enc).double()
    other = fp32_rotation(codec, enc).double()
    assert ((other - codec.decode(enc).double()).abs() <= slack.unsqueeze(-2)).all()


@settings(max_examples=examples(25))
@given(seed=st.integers(0, 10_000), bits=st.sampled_from([2, 4, 8]),
       scale=st.sampled_from([1e-6, 1e-3, 1.0, 1e3, 2e4]),
       start=st.integers(0, 100_000), block=st.sampled_from([1, 2, 16]))
def test_arbitrary_post_rope_keys_stay_within_bound(seed, bits, scale, start, block):
    """Keys that are not RoPE of anything tame (FP16 noise, subnormals, constant and zero
    channels) at arbitrary positions."""
    gen = torch.Generator().manual_seed(seed)
    k = (torch.randn(2, 2, block, 16, generator=gen) * scale).clamp(-4e4, 4e4)
    k[..., 1] = 0.0
    k[..., 2] = 0.75
    k = k.half()
    codec = PreRoPEKeyCodec(ChannelAffineKeyCodec(bits=bits),
                            rope=RopeSpec.from_theta(1e4, 16))
    check_key_bound(codec, k, torch.tensor([start, start + 7 * block]))


def test_zero_block_decodes_to_zero_with_a_tiny_bound():
    k = torch.zeros(1, 2, 16, 64, dtype=torch.float16)
    codec = PreRoPEKeyCodec(ChannelAffineKeyCodec(bits=2), rope=SMOLLM2_ROPE)
    _, err, bound = check_key_bound(codec, k, torch.tensor([0, 16]))
    assert (err == 0).all() and (bound < 1e-7).all()


# ---------------------------------------------------------------------- (b) modes agree
def test_pre_rope_8bit_and_post_rope_agree_with_the_originals():
    start = torch.tensor([0, 64, 8000])
    k = pre_rope_keys(3, (3, 3, 32, 64), 1.0, SMOLLM2_ROPE, start)
    inner = ChannelAffineKeyCodec(bits=8)
    pre = PreRoPEKeyCodec(inner, rope=SMOLLM2_ROPE)
    post = PreRoPEKeyCodec(inner, key_mode="post_rope")
    pre_err = check_key_bound(pre, k, start)[1]
    enc, post_err, post_bound = check_key_bound(post, k, start)
    # post_rope is exactly the inner codec on the post-RoPE keys (no positions stored)
    plain = inner.encode(k)
    assert enc.keys() == plain.keys()
    assert torch.equal(post.decode(enc), inner.decode(plain))
    assert torch.equal(post_bound.float(), inner.channel_bound(plain))
    assert post.bits == pre.bits == 8 and post.name == inner.name != pre.name
    # both reconstruct the keys to well under 1 % of their magnitude (pre-RoPE: of the pair's,
    # which RoPE mixes)
    magnitude = k.double().abs().amax(dim=-2)
    magnitude = torch.maximum(magnitude, magnitude.roll(32, dims=-1))
    for err in (pre_err, post_err):
        assert (err <= 0.01 * magnitude + 1e-3).all()


def test_bytes_count_the_stored_positions():
    k = pre_rope_keys(0, (3, 4, 32, 64), 1.0, SMOLLM2_ROPE, torch.arange(4) * 32)
    codec = PreRoPEKeyCodec(ChannelAffineKeyCodec(bits=4), rope=SMOLLM2_ROPE)
    enc = codec.encode_at(k, torch.arange(4) * 32)
    total = sum(t.numel() * t.element_size() for t in enc.values())
    # 4-bit codes (32) + FP32 scale and offset per channel (512 / 32 tokens) + int32 start
    assert total / (3 * 4 * 32) == 32 + 16 + 4 / 32


# ---------------------------------------------------------------------- (c) real RoPE
def smollm2_like(layers: int = 1):
    """A random LLaMA with SmolLM2-135M's attention geometry and rotary embedding."""
    config = AutoConfig.for_model(
        "llama", hidden_size=576, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=128,
        max_position_embeddings=8192, rope_parameters={"rope_type": "default",
                                                       "rope_theta": 100000.0})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(4.0)
    return model


def test_rope_spec_reads_the_model_rotary_embedding():
    model = smollm2_like()
    spec = rope_spec(model)
    assert spec == SMOLLM2_ROPE and hash(spec) == hash(SMOLLM2_ROPE)
    assert spec.head_dim == 64 and spec.attention_scaling == 1.0
    assert rope_spec(model.model) == spec  # the base model too
    assert rope_spec(torch.nn.Linear(2, 2)) is None
    same = RopeSpec(torch.tensor(spec.inv_freq, dtype=torch.float64), 1.0, 64)
    assert same == spec and isinstance(same.inv_freq, tuple)


def test_inverse_rope_recovers_the_model_pre_rope_keys_and_attention():
    model = smollm2_like()
    attn = model.model.layers[0].self_attn
    seen = {}
    hooks = [attn.k_proj.register_forward_hook(lambda m, i, o: seen.update(k=o)),
             attn.q_proj.register_forward_hook(lambda m, i, o: seen.update(q=o))]
    ids = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    for hook in hooks:
        hook.remove()
    spec = rope_spec(model)
    t = ids.shape[1]
    positions = torch.arange(t)
    post = cache.layers[0].keys[0]  # [Hkv, T, d], post-RoPE FP32
    values = cache.layers[0].values[0]
    k_pre = seen["k"][0].view(t, 3, 64).transpose(0, 1)  # the k_proj output per head
    q_pre = seen["q"][0].view(t, 9, 64).transpose(0, 1)

    # the hook's un-rotation gives the model's own pre-RoPE keys, to FP32 rounding
    recovered = spec.unrotate(post, positions)
    scale = k_pre.double().abs().amax()
    assert (recovered - k_pre.double()).abs().amax() <= 64 * U * scale
    # and rotating forward in FP64 reproduces the model's post-RoPE keys
    assert (spec.rotate(k_pre, positions) - post.double()).abs().amax() <= 64 * U * scale

    # inverse then forward RoPE of the FP16 keys the store holds: far below FP16 rounding
    k16 = post.half().double()
    round_trip = spec.rotate(spec.unrotate(k16, positions), positions)
    assert ((round_trip - k16).abs() <= 2.0**-40 * k16.abs().amax()).all()

    # attention with the round-tripped keys equals attention with the originals
    q = spec.rotate(q_pre, positions).float()  # the model's post-RoPE queries

    def attention(keys):
        k = keys.float().repeat_interleave(3, dim=0)
        v = values.float().repeat_interleave(3, dim=0)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    ref, out = attention(k16), attention(round_trip)
    assert (out - ref).norm() <= 1e-6 * ref.norm()


def test_prefill_hands_the_model_rope_to_pre_rope_codecs():
    from certkv.eval.decode import Decoder, Method, Prefill
    from certkv.models.hook import enable
    from certkv.models.loading import LoadedModel, ModelSpec

    model = smollm2_like()
    enable(model)
    lm = LoadedModel(model, None, ModelSpec(name="smollm2_like"))
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    quantizer = KVQuantizer(PreRoPEKeyCodec(ChannelAffineKeyCodec(bits=8)),
                            GroupAffineValueCodec(), block_size=16)
    method = Method.build("pre_rope", "naive", quantizer=quantizer)
    cache = Prefill(lm, ids).cache_for(method)
    store = cache.layers[0].store
    assert method.quantizer.key_codec.rope is None  # the method's own quantizer is untouched
    assert store.key_codec.rope == rope_spec(model)
    assert store.num_blocks == 2
    n = store.num_blocks
    originals = store.dense_kv()[0][:, : n * 16].double().view(3, n, 16, 64)
    err = (store.dequantized_keys().double() - originals).abs().amax(dim=-2)
    assert (err <= store.key_channel_bound().double()).all()
    decoder = Decoder(lm, cache)
    for token in ids[:3]:
        assert torch.isfinite(decoder.step(token)).all()
    cache.log.flush()
    assert len(cache.log.steps) == 3  # certificates of decode steps on the pre-RoPE store
    assert all(math.isfinite(step["bound_max"]) for step in cache.log.steps)


# ---------------------------------------------------------------------- (d) values
def outlier_values(seed, shape, scale):
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(*shape, generator=gen) * scale
    v[..., 7] *= 300  # an outlier channel
    v[:, :, 5] *= 50  # a massive token
    v[..., 9] = 1.5 * scale  # a constant channel
    v[:, 0, 3] = 0.0  # an all-zero token
    return v.clamp(-6e4, 6e4).half()


@pytest.mark.parametrize("levels", ["nonuniform", "uniform"])
@pytest.mark.parametrize("bits", VALUE_BITS)
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.1])
@pytest.mark.parametrize("scale", [1e-4, 1.0, 3e3])
def test_outlier_values_round_trip_within_token_bound(levels, bits, fraction, scale):
    codec = OutlierValueCodec(bits=bits, group=16, levels=levels, outlier_fraction=fraction)
    v = outlier_values(bits, (2, 3, 32, 64), scale)
    codec.validate(64, 32)
    enc = codec.encode(v)
    dec = codec.decode(enc)
    err = (dec.double() - v.double()).norm(dim=-1)
    bound = codec.token_bound(enc)
    assert bound.dtype == torch.float32 and bound.shape == (2, 3, 32)
    assert (err <= bound.double()).all(), float((err / bound.double()).max())
    # the sparse entries are the m largest magnitudes, stored and decoded exactly
    m = math.ceil(fraction * 32 * 64)
    idx = enc["sparse_idx"].long()
    assert idx.shape == (2, 3, m) and enc["sparse_idx"].dtype == torch.int16
    flat_v, flat_dec = v.reshape(2, 3, -1), dec.reshape(2, 3, -1)
    assert torch.equal(flat_dec.gather(-1, idx), flat_v.float().gather(-1, idx))
    if m:
        kept = flat_v.abs().float().gather(-1, idx).amin(dim=-1)
        assert (flat_v.abs().float().topk(m, dim=-1).values[..., -1] <= kept).all()
    # the documented byte count
    total = sum(t.numel() * t.element_size() for t in enc.values())
    assert total == 2 * 3 * codec.bytes_per_block(32, 64)
    meta = (4 if levels == "uniform" else 2) * 64 // 16
    assert total / (2 * 3 * 32) == 64 * bits / 8 + meta + 4 * m / 32
    # any FP32 evaluation of the decode is within decode_rounding of this one (FP64 here)
    exact = exact_decode(codec, enc)
    norms = v.double().norm(dim=-1) + U * 64**0.5
    assert ((exact - dec.double()).norm(dim=-1) <= codec.decode_rounding() * U * norms).all()


def exact_decode(codec, enc):
    """The decode in FP64 (no rounding at all on these inputs)."""
    from certkv.quant.packing import unpack_bits

    codes = unpack_bits(enc["codes"], codec.bits).long()
    grouped = codes.reshape(*codes.shape[:-1], -1, codec.group)
    scale = enc["scale"].double().unsqueeze(-1)
    if codec.levels == "uniform":
        dense = grouped.double() * scale + enc["offset"].double().unsqueeze(-1)
    else:
        levels = torch.tensor(normal_float_levels(codec.bits), dtype=torch.float64)
        dense = levels[grouped] * scale
    flat = dense.reshape(*codes.shape[:2], -1)
    flat = flat.scatter(-1, enc["sparse_idx"].long(), enc["sparse_val"].double())
    return flat.reshape(codes.shape)


def test_dense_and_sparse_values_alone_make_a_store_that_decodes_its_first_empty_blocks():
    """Regression: a store whose only value codec is dense-and-sparse encodes zero blocks at
    allocation; decoding them reshaped with ``-1`` failed."""
    from helpers import make_kv

    from certkv import TieredKVStore

    store = TieredKVStore(2, 32, value_codec=OutlierValueCodec(bits=3, group=32))
    k, v = make_kv(2, 40, 32)
    store.append(k, v)
    assert store.num_quantized() == 2


def test_bytes_per_token_at_d64_b32():
    for levels, expected in (("nonuniform", 30.625), ("uniform", 34.625)):
        codec = OutlierValueCodec(bits=3, group=32, levels=levels)
        assert codec.num_outliers(32, 64) == 21
        assert codec.bytes_per_block(32, 64) / 32 == expected


def test_normal_float_levels_are_nf4():
    nf4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
           -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
           0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
           0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
    assert torch.allclose(torch.tensor(normal_float_levels(4)), torch.tensor(nf4), atol=1e-6)
    for bits in (2, 3, 8):
        levels = normal_float_levels(bits)
        assert len(levels) == 2**bits and levels[0] == -1 and levels[-1] == 1 and 0.0 in levels
        assert list(levels) == sorted(levels)


def test_sparse_outliers_beat_plain_groups_on_outlier_channels():
    v = outlier_values(0, (2, 3, 32, 64), 1.0)
    plain = GroupAffineValueCodec(bits=4, group=16)
    ours = OutlierValueCodec(bits=4, group=16, levels="uniform")
    err = [(c.decode(c.encode(v)).double() - v.double()).norm(dim=-1).mean()
           for c in (plain, ours)]
    assert err[1] < 0.5 * err[0]


# ---------------------------------------------------------------------- (e) errors
def test_clear_errors():
    k = torch.zeros(1, 1, 16, 64, dtype=torch.float16)
    with pytest.raises(ConfigError, match="with_rope"):
        PreRoPEKeyCodec().encode_at(k, torch.tensor([0]))
    with pytest.raises(ConfigError, match="call encode_at"):
        PreRoPEKeyCodec(rope=SMOLLM2_ROPE).encode(k)
    with pytest.raises(ConfigError, match="key_mode='rope'"):
        PreRoPEKeyCodec(key_mode="rope")
    with pytest.raises(ConfigError, match="head_dim=64 but the layer has head_dim=32"):
        PreRoPEKeyCodec(rope=SMOLLM2_ROPE).validate(32, 16)
    with pytest.raises(ConfigError, match="even head_dim"):
        PreRoPEKeyCodec(ChannelAffineKeyCodec(bits=8)).validate(63, 16)
    with pytest.raises(ConfigError, match="FP16 range"):
        PreRoPEKeyCodec(FP16KeyCodec(), rope=RopeSpec(SMOLLM2_ROPE.inv_freq, 0.5)).encode_at(
            torch.full((1, 1, 16, 64), 6e4, dtype=torch.float16), torch.tensor([0]))
    with pytest.raises(ConfigError, match="full-width"):
        RopeSpec(SMOLLM2_ROPE.inv_freq, 1.0, 128)
    with pytest.raises(ConfigError, match="bits=5 is not supported"):
        OutlierValueCodec(bits=5)
    for fraction in (-0.1, 1.0):
        with pytest.raises(ConfigError, match="outlier_fraction"):
            OutlierValueCodec(outlier_fraction=fraction)
    with pytest.raises(ConfigError, match="levels='nf'"):
        OutlierValueCodec(levels="nf")
    with pytest.raises(ConfigError, match="does not divide head_dim=48"):
        OutlierValueCodec(bits=4, group=32).validate(48, 16)
    with pytest.raises(ConfigError, match="int16 outlier index"):
        OutlierValueCodec(bits=4).validate(128, 512)


def test_with_rope_sets_the_spec_on_a_copy():
    quantizer = KVQuantizer(PreRoPEKeyCodec(), OutlierValueCodec(bits=4), block_size=32)
    roped = quantizer.with_rope(SMOLLM2_ROPE)
    assert roped.key_codec.rope == SMOLLM2_ROPE and quantizer.key_codec.rope is None
    assert roped == quantizer.with_rope(RopeSpec.from_theta(1e5, 64))
    assert KVQuantizer().with_rope(SMOLLM2_ROPE) == KVQuantizer()
