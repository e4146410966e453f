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
from certkv.kernels import launch_hooks


def _triton_steps():
    """A peaked step over InnerQ's groups with heads on rungs 3-4 (empty tail sums, vacuous
    bounds, masked lanes, symmetric groups' sign words read as floats), certified and naive,
    on the Triton backend: ``(out, the warnings raised)``."""
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
    return out, [str(w.message) for w in caught]


def test_a_triton_step_under_the_interpreter_warns_of_nothing():
    """Without the quiet wrapper NumPy warns of ``invalid value`` in :func:`_triton_steps`."""
    out, caught = _triton_steps()
    assert caught == []
    assert out.isfinite().all()


def test_wrappers_come_and_go_in_any_order():
    """The quiet wrapper, installed while another wrapper is in place (a launch counter, a
    graph's recorder), stays in place when that one is removed, which then sees no launch:
    patching Triton's launch methods per wrapper and restoring them on removal dropped it, and
    the step above warned or not depending on the tests run before it in the process."""
    seen = []

    def count(kernel, launch, args, kwargs):
        seen.append(kernel)
        return launch(*args, **kwargs)

    if launch_hooks._QUIET:  # this process's quiet wrapper goes, to be installed anew below
        launch_hooks._QUIET.pop()()
    try:
        remove_count = launch_hooks.wrap_triton_launches(count)
        launch_hooks.quiet_interpreter()
        remove_count()
        out, caught = _triton_steps()
    finally:
        launch_hooks.quiet_interpreter()  # in place for the tests after this one
    assert caught == [] and out.isfinite().all()
    assert seen == []
