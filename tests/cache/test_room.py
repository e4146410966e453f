"""The budget check before an append (:mod:`certkv.cache.room`) says exactly what the append
would find after it: it refuses the appends whose store would raise BudgetError afterwards, and
no other."""

from __future__ import annotations

from dataclasses import replace

from helpers import examples, make_kv
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from certkv import TieredKVStore
from certkv.cache import room
from certkv.errors import BudgetError
from certkv.evict import AgeEviction, HeavyHitterEviction, StreamingEviction
from certkv.quant import GroupAffineValueCodec, KiviKeyCodec, KVQuantizer

POLICIES = {"streaming": lambda b: StreamingEviction(budget=b, sink=4),
            "age": lambda b: AgeEviction(budget=b, min_materialized=32),
            "heavy_hitter": lambda b: HeavyHitterEviction(budget=b, recent=32)}


def quantizer(sc) -> KVQuantizer:
    if sc["codec"] == "kivi2":  # an exact residual window that graduates by age
        q = KVQuantizer(KiviKeyCodec(bits=2), GroupAffineValueCodec(bits=2, group=16), 16,
                        residual=32)
    else:
        q = KVQuantizer(block_size=16)
    if sc["limit"] == "budget_bytes":
        return replace(q, budget_bytes=sc["budget_bytes"])
    return q.with_eviction(POLICIES[sc["limit"]](sc["budget"]))


@st.composite
def scenarios(draw):
    return {"codec": draw(st.sampled_from(["int8_int4", "kivi2"])),
            "limit": draw(st.sampled_from([*POLICIES, "budget_bytes"])),
            "budget": draw(st.sampled_from([0.05, 0.1, 0.2, 0.3, 0.5])),
            "budget_bytes": draw(st.sampled_from([1500, 3000, 6000, 12000])),
            "chunks": draw(st.lists(st.sampled_from([1, 5, 16, 40, 90]), min_size=1,
                                    max_size=6)),
            "seed": draw(st.integers(0, 2**16))}


def outcomes(sc, checked: bool, monkeypatch) -> list:
    """Per append: None, or the error it raised; the first refused append ends the run."""
    with monkeypatch.context() as mp:
        if not checked:
            mp.setattr(room, "check_room", lambda *args, **kwargs: None)
        store = TieredKVStore(1, 32, **quantizer(sc).store_kwargs())
        found = []
        for i, n in enumerate(sc["chunks"]):
            try:
                store.append(*make_kv(1, n, 32, seed=sc["seed"] + i))
                found.append(None)
            except BudgetError:
                found.append(BudgetError)
                break
        return found


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(sc=scenarios())
def test_the_check_refuses_exactly_the_appends_the_store_would_refuse_after(sc, monkeypatch):
    found = outcomes(sc, True, monkeypatch)
    event("refused" if found[-1] is BudgetError else "admitted")
    assert found == outcomes(sc, False, monkeypatch)


def test_the_draws_reach_both_outcomes(monkeypatch):
    """The property's premise: its budgets refuse some appends and admit others."""
    refused = {"age": [0.05, [8, 40]], "budget_bytes": [None, [8, 90]]}
    for limit, (budget, chunks) in refused.items():
        sc = {"codec": "int8_int4", "limit": limit, "budget": budget, "budget_bytes": 1500,
              "chunks": chunks, "seed": 0}
        assert outcomes(sc, True, monkeypatch) == [None, BudgetError]
    sc = {"codec": "kivi2", "limit": "streaming", "budget": 0.5, "budget_bytes": 1500,
          "chunks": [90, 16, 1], "seed": 0}
    assert outcomes(sc, True, monkeypatch) == [None, None, None]
