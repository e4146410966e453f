"""Bad input to CertifiedAttention: one clear sentence each, never a traceback from deep inside."""

from __future__ import annotations

import pytest
import torch

from certkv import CertifiedAttention, TieredKVStore
from certkv.errors import CertKVError, ConfigError, EmptyStoreError, NonFiniteError, ShapeError


@pytest.fixture
def store():
    s = TieredKVStore(2, 16)
    s.append(torch.randn(2, 40, 16), torch.randn(2, 40, 16))
    return s


@pytest.mark.parametrize(("q", "error", "match"), [
    (torch.randn(1, 4, 16), ShapeError, "2-D tensor"),
    (torch.randn(4, 8), ShapeError, "head_dim 8"),
    (torch.randn(3, 16), ShapeError, "not a multiple of the store's 2 kv heads"),
    (torch.zeros(4, 16, dtype=torch.long), ShapeError, "float query"),
    (torch.full((4, 16), float("nan")), NonFiniteError, "NaN or Inf"),
    (torch.full((4, 16), float("inf")), NonFiniteError, "NaN or Inf"),
])
def test_bad_query(store, q, error, match):
    with pytest.raises(error, match=match):
        CertifiedAttention()(q, store)


def test_empty_store():
    with pytest.raises(EmptyStoreError, match="append the prompt"):
        CertifiedAttention()(torch.randn(2, 16), TieredKVStore(2, 16))


def test_unknown_mode_and_backend():
    with pytest.raises(ConfigError, match="mode='fast' is unknown"):
        CertifiedAttention(mode="fast")
    with pytest.raises(ConfigError, match="unknown backend 'cuda9'"):
        CertifiedAttention(backend="cuda9")


def test_errors_are_single_sentences(store):
    with pytest.raises(CertKVError) as info:
        CertifiedAttention()(torch.randn(3, 16), store)
    message = str(info.value)
    assert message.endswith(".") and "\n" not in message


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_any_float_query_dtype(store, dtype):
    out, cert = CertifiedAttention()(torch.randn(4, 16).to(dtype), store)
    assert out.dtype == dtype and out.shape == (4, 16)
    assert cert.rung.shape == (4,)

