"""certkv.kernels.launch_hooks: the interpreter's NumPy stays quiet about the IEEE infinities
and NaNs the kernels mean (a GPU computes them silently)."""

from __future__ import annotations

import warnings

from helpers import make_kv, make_query

from certkv import CertifiedAttention, TieredKVStore
from certkv.cache.scratch import ScratchCache
from certkv.certify.ladder import Ladder
from certkv.config import option
from certkv.eval.runner import build


def test_a_triton_step_under_the_interpreter_warns_of_nothing():
    """A peaked step over InnerQ's groups with heads on rungs 3-4 (empty tail sums, vacuous
    bounds, masked lanes, symmetric groups' sign words read as floats): without the quiet
    wrapper NumPy warns of ``invalid value`` here."""
    k, v = make_kv(2, 16 * 16 + 1, 32, seed=3, outlier_channels=2)
    q = make_query(k, 3, seed=3, scale=4.0, peaked=True)
    store = TieredKVStore(2, 32, **build(option("quantizer", "innerq"), "quantizer")
                          .store_kwargs())
    store.append(k, v)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, _ = CertifiedAttention(backend="triton", ladder=Ladder(r=3))(
            q, store, scratch=ScratchCache(8, 8))
        CertifiedAttention(backend="triton", mode="naive")(q, store)
    assert [str(w.message) for w in caught] == []
    assert out.isfinite().all()
