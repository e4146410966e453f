"""Summary codecs (issue 23's evicted blocks): an evicted block's Tier-1 summary bounds its
keys and values, so the certificate covers it like any quantized block, and a store that keeps
nothing but summaries is still certified (it pages blocks back in, or goes dense)."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    BACKENDS,
    KINDS,
    adversarial,
    check_steps,
    examples,
    make_kv,
    step_draws,
    tier1_bytes,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from certkv import CertifiedAttention, TieredKVStore
from certkv.errors import ConfigError
from certkv.kernels.reference import TorchBackend
from certkv.quant import KVQuantizer
from certkv.quant.summary import SummaryKeyCodec, SummaryValueCodec


def codecs(block=16, d=32):
    keys, values = SummaryKeyCodec(), SummaryValueCodec()
    keys.validate(d, block)
    values.validate(d, block)
    return keys, values


@pytest.mark.parametrize("kind", KINDS)
def test_summaries_bound_every_key_and_value(kind):
    keys, values = codecs()
    k = adversarial(kind, (2, 3, 16, 32), seed=1)
    v = adversarial(kind, (2, 3, 16, 32), seed=2)
    ek, ev = keys.encode(k), values.encode(v)
    key_err = (keys.decode(ek).double() - k.double()).abs().amax(dim=-2)
    assert (key_err <= keys.channel_bound(ek).double()).all()
    value_err = (values.decode(ev).double() - v.double()).norm(dim=-1)
    assert (value_err <= values.token_bound(ev).double()).all()
    assert tier1_bytes(ek, ev) == 2 * 3 * (4 * 32 + 2 * 32 + 4)  # 4d + 2d + 4 per block


def test_the_logit_bound_holds_for_any_query_and_is_tight_for_a_repeated_key():
    keys, _ = codecs()
    gen = torch.Generator().manual_seed(0)
    k = (torch.randn(1, 1, 16, 32, generator=gen) * 50).half()
    k[..., 3] *= 300  # an outlier channel
    enc = keys.encode(k)
    low, high = enc["low"].double(), enc["high"].double()
    for _ in range(50):
        q = torch.randn(32, generator=gen, dtype=torch.float64) * 10
        upper = torch.maximum(q * low, q * high).sum(dim=-1)  # the summary's bound
        via_codec = keys.decode(enc)[0, 0, 0].double() @ q + \
            (q.abs() * keys.channel_bound(enc).double()).sum(dim=-1)
        exact = (k.double()[0, 0] @ q).max()
        assert exact <= upper.item() <= via_codec.item() * (1 + 1e-12) + 1e-9
    same = k[:, :, :1].expand(1, 1, 16, 32).contiguous()
    enc = keys.encode(same)
    assert (keys.channel_bound(enc) <= 2**-24 * same.float().abs().amax(dim=-2) * 1.01).all()


def test_decoding_before_validation_is_one_sentence():
    with pytest.raises(ConfigError, match="validate"):
        SummaryKeyCodec().decode(SummaryKeyCodec().encode(torch.zeros(1, 1, 4, 8).half()))


@st.composite
def scenarios(draw):
    return {"block": draw(st.sampled_from([4, 8, 16])), **step_draws(draw, 120, [1, 9, 17])}


# a draw costs about 0.05 s on the reference, 2-4 s interpreted: 40 and 5
@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_a_store_of_nothing_but_summaries_is_still_certified(backend, device):
    """Every completed block evicted to its summary: every head within its bound against FP64
    attention on the originals (the ladder pages blocks in from Tier-2, or goes dense)."""
    count = examples(40 if backend is TorchBackend else 5)

    @settings(max_examples=count, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(sc=scenarios())
    def summaries_only(sc):
        check_summaries_only(backend, device, sc)
    summaries_only()


def check_summaries_only(backend, device, sc) -> None:
    quantizer = KVQuantizer(SummaryKeyCodec(), SummaryValueCodec(), sc["block"])
    store = TieredKVStore(sc["hkv"], 32, block_size=sc["block"], quantizer=quantizer,
                          decoded_mirror=sc["seed"] % 2 == 0, device=device)
    k, v = make_kv(sc["hkv"], sc["tokens"], 32, seed=sc["seed"], outlier_channels=sc["outliers"],
                   heavy_tail=sc["heavy_tail"], key_offset=sc["key_offset"])
    check_steps(store, CertifiedAttention(backend=backend()), k, v, sc)
