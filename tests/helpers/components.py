"""The components of ``conf/`` built as a run builds them, and hypothesis draws of whole
pipelines (quantizer x protection x eviction x data x decode steps), shared by the contract
property tests over every component (``tests/test_component_contract.py``) and over batches
(``tests/test_attention_batch.py``)."""

from __future__ import annotations

from hypothesis import strategies as st
from omegaconf import OmegaConf

from certkv import CertifiedAttention, Ladder
from certkv.cache.store import TieredKVStore
from certkv.config import CONF_DIR, config_groups
from certkv.eval.feasible import smallest_budget
from certkv.eval.runner import build
from certkv.kernels import get_backend
from certkv.kernels.triton_backend import TritonBackend
from certkv.quant.rope import RopeSpec
from certkv.registry import SUMMARIES
from helpers import step_draws

D, BLOCK = 32, 32  # the configs' group and block sizes (32) at the smallest head_dim they fit
GROUPS = config_groups()
QUANTIZERS, PROTECTIONS, EVICTIONS = GROUPS["quantizer"], GROUPS["protect"], GROUPS["evict"]
# the configs' windows sized to a few hundred tokens, so that every stage is reached: tiers'
# hot / warm / archive ages and its archive choice by length, and eviction's protected windows
SCALED = {
    ("quantizer", "tiers"): {"hot": 32, "stale": 96, "mid_from": 192, "long_from": 288},
    ("evict", "age"): {"min_materialized": 64},
    ("evict", "heavy_hitter"): {"recent": 32},
    ("evict", "snapkv"): {"window": 16},
}


# pairs that do not compose, each refused with one sentence when the store is made (tested
# below): an error-correcting code needs 2, 4 or 8-bit codes, and these hold 3-bit blocks
CODES = [p for p in PROTECTIONS if p != "none"]
THREE_BITS = {"smartkv": "its 3-bit tier", "tiers": "the kvquant archive's 3-bit keys (archive "
              "auto or kvquant; kivi2 and rotation compose)"}
ARCHIVES = ("auto", "kivi2", "rotation", "kvquant")


def composes(sc) -> bool:
    """Whether the drawn quantizer and protection compose (:data:`THREE_BITS`)."""
    three_bits = sc["quantizer"] == "smartkv" or (
        sc["quantizer"] == "tiers" and sc["archive"] in ("auto", "kvquant"))
    return sc["protect"] == "none" or not three_bits


def component(group: str, name: str, **changes):
    """The component ``conf/<group>/<name>.yaml`` builds, as a run builds it, with ``changes``
    (and the windows of :data:`SCALED`) applied."""
    node = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{name}.yaml"))
    node.update({**SCALED.get((group, name), {}), **changes})
    return build(node, group)


def pipeline(sc, lengths: list[int] | None = None):
    """``(store, attention)`` for a draw of :func:`pipelines`, with an eviction budget that a
    sequence of each of ``lengths`` tokens can meet (default: the draw's one length)."""
    archive = {"archive": sc["archive"]} if sc["quantizer"] == "tiers" else {}
    quantizer = component("quantizer", sc["quantizer"], **archive)
    quantizer = quantizer.with_rope(RopeSpec.from_theta(1e4, D))
    quantizer = quantizer.with_protection(component("protect", sc["protect"]))
    summary = {"summary": sc.get("summary", "box")} if sc["evict"] != "none" else {}
    policy = component("evict", sc["evict"], **summary)
    if policy.enabled:  # a budget its policy can meet on this prompt, never under it
        probe = quantizer.with_eviction(policy)
        need = max(smallest_budget(probe, sc["hkv"], D, n, sc["steps"] * sc["per_step"])
                   for n in lengths or [sc["tokens"]])
        policy = component("evict", sc["evict"], budget=min(1.0, need + sc["budget_margin"]),
                           **summary)
    quantizer = quantizer.with_eviction(policy)
    store = TieredKVStore(sc["hkv"], D, device=sc.get("device", "cpu"),
                          **quantizer.store_kwargs())
    backend = TritonBackend(split=4) if sc["backend"] == "triton" else get_backend(sc["backend"])
    ladder = Ladder(page_in_budget=sc.get("page_in_budget", 0))
    return store, CertifiedAttention(backend=backend, mode=sc["mode"], ladder=ladder)


@st.composite
def pipelines(draw, quantizer: str, backend: str, max_tokens: int = 420):
    """One pipeline of ``quantizer`` on ``backend`` (every quantizer x backend cell is its own
    test: random draws over all of them left cells empty); protection, eviction, the data and
    the step drawn."""
    sc = {"quantizer": quantizer, "archive": draw(st.sampled_from(ARCHIVES))}
    sc["protect"] = draw(st.sampled_from([p for p in PROTECTIONS
                                          if composes({**sc, "protect": p})]))
    return {
        **sc,
        **step_draws(draw, 1, [1, 9, BLOCK]),
        "tokens": draw(st.integers(160, max_tokens)),  # past every config's exact windows
        "evict": draw(st.sampled_from(EVICTIONS)),
        "summary": draw(st.sampled_from(SUMMARIES.names())),  # what an evicted block keeps
        "page_in_budget": draw(st.sampled_from([0, None, 2])),  # targeted page-in: off, all, 2
        "budget_margin": draw(st.sampled_from([0.0, 0.05, 0.3])),
        "backend": backend,
        "mode": draw(st.sampled_from(["certified", "certified", "naive"])),
    }


