"""The certificate segment's named inputs and outputs
(:func:`certkv.certify.step_certify.certify_step`): one object each way instead of 30
positional tensors, so that no swapped argument can silently change a bound.

Shapes: ``[Hq, n]`` per block, ``[Hq]`` per head, ``out [Hq, d]`` (FP32), ``q`` in the caller's
dtype, ``q_norm [Hkv, G]``, ``exact [n]`` (blocks read exactly), ``eta, value_spec, key_spec,
value_kv [Hkv, n]``, ``canary_blocks [Hkv, G, n]``, ``key_abs_max [Hkv, d]``, ``eta_max_kv
[Hkv]``, ``kv_of [Hq]`` (each head's kv head), ``v_max_kv [Hkv]`` (device path only).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class CertifyInputs(NamedTuple):
    """What the certificate reads: Phase 1 and 2's per-block quantities, the selection, the
    checks, the store's annotations and maxima."""

    l8: torch.Tensor  # [Hq, n] INT8 log-masses (Phase 1)
    l16: torch.Tensor  # [Hq, n] Phase 2's log-masses
    rho: torch.Tensor  # [Hq, n] Phase 2's block masses
    spread: torch.Tensor  # [Hq, n] value spread per block
    out: torch.Tensor  # [Hq, d] FP32 output before the fallback
    log_p: torch.Tensor  # [Hq, n] estimated log-masses
    delta_b: torch.Tensor  # [Hq, n] tight logit bounds (eq. 8 tightened)
    delta: torch.Tensor  # [Hq] max logit bound over quantized keys
    delta_chan: torch.Tensor  # [Hq, n] eq. 8's per-channel Delta_b (paper form)
    v_max: torch.Tensor  # [Hq]
    v_rad: torch.Tensor  # [Hq]
    q_norm: torch.Tensor  # [Hkv, G]
    promoted: torch.Tensor  # [Hq, n] FP16 keys
    exact: torch.Tensor  # [n] blocks read exactly
    expanded: torch.Tensor  # [Hq] rung 1 taken
    value_kv: torch.Tensor  # [Hkv, n] FP16 values read
    eta: torch.Tensor  # [Hkv, n]
    value_spec: torch.Tensor  # [Hkv, n]
    key_spec: torch.Tensor  # [Hkv, n]
    ranking: torch.Tensor  # [Hq] eq. 17 passed
    boundary: torch.Tensor  # [Hq] eq. 18 passed
    canary_blocks: torch.Tensor  # [Hkv, G, n] score canary violations
    q: torch.Tensor  # [Hq, d] the caller's query
    kv_bad: torch.Tensor  # 0-d bool: non-finite K/V appended
    key_abs_max: torch.Tensor  # [Hkv, d]
    eta_max_kv: torch.Tensor  # [Hkv]
    kv_of: torch.Tensor  # [Hq]
    v_max_kv: torch.Tensor | None = None  # [Hkv], device path only


class CertifyOutputs(NamedTuple):
    """The certificate of one pass, per query head ``[Hq]`` (``flags [Hq + 2]``)."""

    e_key: torch.Tensor
    e_val: torch.Tensor
    e_arith: torch.Tensor
    tail_mass: torch.Tensor
    k_star: torch.Tensor
    canary: torch.Tensor
    rung: torch.Tensor
    value_blocks: torch.Tensor
    flags: torch.Tensor  # heads needing dense attention, then non-finite q and K/V
    paper_key: torch.Tensor
    paper_val: torch.Tensor
    returned: tuple  # E_key, E_val as returned (0 on rungs 3-4)
    e_final: torch.Tensor | None  # e_arith after the device fallback (device path)


class SelectInputs(NamedTuple):
    """What the selection segment reads
    (:func:`~certkv.certify.step_select.select_step`)."""

    qg: torch.Tensor  # [Hkv, G, d] FP32 queries
    l8_kv: torch.Tensor  # [Hkv, G, n] Phase-1 log-masses
    delta_kv: torch.Tensor  # [Hkv, G, n] Delta_b, eq. 8's channel form
    log_spread_kv: torch.Tensor  # [Hkv, G, n] log value spreads
    quantized: torch.Tensor  # [n]
    eta: torch.Tensor  # [Hkv, n]
    value_spec: torch.Tensor  # [Hkv, n]
    key_err: torch.Tensor  # [Hkv, n]
    v_max_kv: torch.Tensor  # [Hkv]
    v_rad_kv: torch.Tensor  # [Hkv]
    kv_of: torch.Tensor  # [Hq] each head's kv head
    draw: torch.Tensor | None  # [Hq, n] uniform draws for exploration
    n_q: object  # quantized block count: a host int, or a 0-d device tensor (device path)
    scaling: float  # the softmax scale
    boost: torch.Tensor | None = None  # [Hq] bound-tolerance escalation level
    force: torch.Tensor | None = None  # [Hq, n] blocks promoted whatever the selector says


class Selection(NamedTuple):
    """The selection of one pass: which blocks get FP16 keys and values, and the per-head
    quantities the certificate reuses."""

    log_p: torch.Tensor  # [Hq, n] estimated log-masses
    delta_b: torch.Tensor  # [Hq, n] tightened logit bounds
    delta: torch.Tensor  # [Hq]
    delta_chan: torch.Tensor  # [Hq, n] eq. 8's channel form
    v_max: torch.Tensor  # [Hq]
    v_rad: torch.Tensor  # [Hq]
    q_norm: torch.Tensor  # [Hkv, G]
    promoted: torch.Tensor  # [Hq, n] FP16 keys
    expanded: torch.Tensor  # [Hq] rung 1 taken
    value_kv: torch.Tensor  # [Hkv, n] FP16 values
    plan: torch.Tensor  # [2, Hkv, n] page-in plan: FP16 keys, FP16 values
    exact: torch.Tensor  # [n] blocks read exactly (exact windows, the tail block)
