"""Selection by the PyTorch operators and by the fused CPU loop nest (or the Triton kernel) on
one scenario of the contract test, compared (test_fused_select.py, test_fused_cpu.py,
kernels/test_triton_select.py)."""

from __future__ import annotations

import torch

from certkv.certify import fused_select
from certkv.certify.segment import SelectInputs
from certkv.kernels.layout import StepLayout
from helpers.contract import build

DEFAULT = {"union": False, "value_policy": "local", "exploration": 0.0, "mode": "certified",
           "tail_mass": "tight"}


def both(sc, select=None):
    """The selection of the scenario's first step by the operators and fused (``select``: a
    function like :func:`fused_select.select`, the default; its ``n_q`` a 0-d tensor when
    ``select`` is given, as on the device path), with the attention object, the layout and the
    Phase-1 scores."""
    store, q, attn = build({**sc, **DEFAULT})
    lay = StepLayout(store)
    hkv = store.num_kv_heads
    qg = q.float().reshape(hkv, q.shape[0] // hkv, -1)
    scaling = sc["scaling"] or store.head_dim**-0.5
    scored = attn.backend.phase1(qg, lay, scaling)
    kv_of = attn._kv_of(q.shape[0], hkv, q.device)
    log_spread = scored.log_mass if scored.log_spread is None else scored.log_spread
    inputs = SelectInputs(
        qg=qg, l8_kv=scored.log_mass, delta_kv=scored.delta_b, log_spread_kv=log_spread,
        quantized=lay.quantized, eta=lay.eta, value_spec=lay.value_spec, key_err=lay.key_err,
        v_max_kv=lay.v_max, v_rad_kv=lay.v_radius, kv_of=kv_of, draw=None,
        n_q=lay.num_quantized, scaling=scaling)
    operators = attn._select_step(inputs)
    if select is None:
        select = fused_select.select
    else:
        inputs = inputs._replace(n_q=lay.quantized_count)
    fused = select(attn.selector, attn.ladder, attn.value_policy, inputs)
    return attn, lay, scored, operators, fused


def _near_coverage_tie(log_p, quantized, tau, k_a, k_b):
    """Whether coverage's ``before_j < tau * total`` is within FP32 rounding at a ``j`` between
    the two ``K`` (FP64 from the head's ``log_p``)."""
    p = log_p.double().exp()
    key = torch.where(quantized, p, -1.0)
    order = torch.sort(key, descending=True, stable=True).indices
    total, exact = p.sum(), p[~quantized].sum()
    before = exact + p[order].cumsum(0) - p[order]
    gap = (before - tau * total).abs()[min(k_a, k_b) - 1: max(k_a, k_b) + 1]
    return bool((gap <= 1e-5 * total + 1e-30).any())


def covered(sc) -> bool:
    """Whether the scenario's certified steps select with the fused loop nest (the default
    policy, :func:`fused_select.covers`) when ``fused``."""
    return all(sc.get(key) == value for key, value in DEFAULT.items())


def check_selections(sc, select=None) -> bool:
    """Assert that the scenario's selection by the operators and fused agree up to FP32
    rounding, and return whether every decision is the same (False: a coverage, expansion or
    value threshold fell within that rounding, so the two steps go on with different sets)."""
    attn, lay, scored, ops, fused = both(sc, select)
    names = ("log_p", "delta_b", "delta", "delta_chan", "v_max", "v_rad", "q_norm", "promoted",
             "expanded", "value_kv", "plan", "exact")
    o, f = dict(zip(names, ops, strict=True)), dict(zip(names, fused, strict=True))
    for name in names:
        assert o[name].shape == f[name].shape and o[name].dtype == f[name].dtype, name
    for name in ("log_p", "delta_b", "delta", "delta_chan", "v_max", "v_rad", "q_norm"):
        torch.testing.assert_close(f[name], o[name], rtol=1e-5, atol=1e-6, equal_nan=True,
                                   msg=name)
    assert torch.equal(f["exact"], o["exact"])
    sel, q = attn.selector, lay.quantized
    for h in range(o["promoted"].shape[0]):
        same = torch.equal(f["promoted"][h], o["promoted"][h])
        k_o, k_f = int((o["promoted"][h] & q).sum()), int((f["promoted"][h] & q).sum())
        if not same:  # a coverage or expansion threshold within rounding
            assert k_o != k_f, f"head {h}: same count, different blocks"
            k_base = [k for k in (k_o, k_f) if k > 0]
            assert _near_coverage_tie(o["log_p"][h], q, sel.tau_cov, k_o, k_f) or any(
                _near_coverage_tie(o["log_p"][h], q, sel.tau_cov, k, k) for k in k_base) \
                or o["expanded"][h] != f["expanded"][h], h
    contribution = _value_contributions(attn, o["log_p"], scored, lay)
    v_tol = attn.value_policy.v_tol
    near = ((contribution - v_tol).abs() <= 1e-5 * v_tol) | (contribution < 1e-30)
    differs = f["value_kv"] != o["value_kv"]
    assert not (differs & ~near.any(dim=1)).any()
    assert torch.equal(f["plan"][1], f["value_kv"])
    same = torch.equal(f["promoted"], o["promoted"]) and not differs.any()
    if same:
        assert torch.equal(f["plan"], o["plan"])
    return same and torch.equal(f["expanded"], o["expanded"])


def _value_contributions(attn, log_p, scored, lay):
    """FP64 value contributions ``[Hkv, G, n]`` of the value policy (``p eta``, or with the
    tight contribution ``min(p eta, ||p_b||_2 sigma)``)."""
    hkv, n = lay.eta.shape
    log_p = log_p.double().view(hkv, -1, n)
    paper = log_p.exp() * lay.eta.double().unsqueeze(1)
    if attn.value_policy.contribution != "tight":
        return paper
    spread = (scored.log_spread.double() - scored.log_mass.double() + log_p).exp()
    return torch.minimum(paper, spread * lay.value_spec.double().unsqueeze(1))
