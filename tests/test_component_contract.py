"""One contract property test over every component in ``conf/`` (issue 52).

Every quantizer x protection x eviction policy the config groups hold (read from ``conf/``, so a
new YAML joins by itself), built as a run builds it, on every CPU backend (the PyTorch
reference, numba, and the Triton kernels in their interpreter), in certified and naive mode:
every head of every decode step within its bound of FP64 attention on the test's own copy of
what was appended (:func:`helpers.check_heads`, no allowance but the FP64 reference's own
rounding). Draws are strict: the prompt always leaves at least one block at a quantized
precision, and an eviction budget is drawn at or above what its policy can reach
(:func:`certkv.eval.feasible.smallest_budget`), so no exception is excused.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from helpers import check_steps, examples, kernel_launches, make_kv
from helpers.components import (
    ARCHIVES,
    CODES,
    QUANTIZERS,
    D,
    component,
    composes,
    pipeline,
    pipelines,
)
from hypothesis import HealthCheck, given, seed, settings

from certkv.cache.store import TieredKVStore
from certkv.errors import ConfigError
from certkv.quant.rope import RopeSpec


def run_pipeline(sc) -> TieredKVStore:
    store, attn = pipeline(sc)
    k, v = make_kv(sc["hkv"], sc["tokens"], D, seed=sc["seed"],
                   outlier_channels=sc["outliers"], heavy_tail=sc["heavy_tail"],
                   key_offset=sc["key_offset"])
    check_steps(store, attn, k, v, sc, observe=True)
    assert store.num_quantized() > 0, "the draw held no quantized block: nothing was certified"
    return store


# a draw costs 0.2-0.4 s (a few hundred tokens, up to three decode rounds): 6 per cell, 96 in all
@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_every_component_keeps_the_contract_on_the_cpu_backends(quantizer, backend):
    @seed(zlib.crc32(f"{quantizer}-{backend}".encode()))  # each cell its own derandomized draws
    @settings(max_examples=examples(6), suppress_health_check=[HealthCheck.too_slow])
    @given(sc=pipelines(quantizer, backend))
    def contract(sc):
        run_pipeline(sc)
    contract()


# What the Triton kernels do not read: a block held at a codec with no kernel layout is scored
# and attended by the reference (the rest of the step still runs the kernels). Each entry is a
# quantizer whose draws may hold such blocks; every quantizer of conf/ is read whole today.
TRITON_REFERENCE_BLOCKS: dict[str, str] = {}


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_every_component_keeps_the_contract_on_the_triton_kernels(quantizer):
    """Draws of each quantizer through the Triton kernels (interpreter): the contract on every
    head, and both phases' kernels launched (not the reference they fall back to) wherever the
    kernels cover the quantizer whole."""
    runs: list = []

    @seed(zlib.crc32(f"{quantizer}-triton".encode()))
    @settings(max_examples=examples(2), suppress_health_check=[HealthCheck.too_slow])
    @given(sc=pipelines(quantizer, "triton", max_tokens=180))
    def contract(sc):
        with kernel_launches() as launches:
            run_pipeline(sc)
        runs.append(launches)
    contract()
    if quantizer not in TRITON_REFERENCE_BLOCKS:
        assert all(r["phase1"] > 0 and r["phase2"] > 0 for r in runs), runs


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_every_quantizer_holds_quantized_blocks_at_the_drawn_lengths(quantizer):
    """The strict draws' premise, per quantizer: 160 tokens leave at least one block at a
    quantized precision (past every exact window the configs keep)."""
    store = TieredKVStore(1, D, **component("quantizer", quantizer)
                          .with_rope(RopeSpec.from_theta(1e4, D)).store_kwargs())
    store.append(*(x.to(torch.float16) for x in make_kv(1, 160, D)))
    assert store.num_quantized() > 0


@pytest.mark.parametrize("archive", ARCHIVES)
@pytest.mark.parametrize("quantizer", ["smartkv", "tiers"])
@pytest.mark.parametrize("protect", CODES)
def test_pairs_that_do_not_compose_are_refused_naming_the_fix(quantizer, archive, protect):
    sc = {"quantizer": quantizer, "archive": archive, "protect": protect}
    changes = {"archive": archive} if quantizer == "tiers" else {}
    codec = component("quantizer", quantizer, **changes).with_protection(
        component("protect", protect))
    if composes(sc):
        TieredKVStore(1, D, **codec.store_kwargs())
        return
    with pytest.raises(ConfigError, match=r"needs 4-bit aligned codes.*use protect=none"):
        TieredKVStore(1, D, **codec.store_kwargs())
