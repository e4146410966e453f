"""Triton Phase 1 (paper Alg. 1): block logits, log-masses and Delta_b from INT8 key codes.

One program per (kv head, block): it loads the block's INT8 codes ``[B, d]`` and FP32
per-channel scale/offset once for all ``G`` query heads of the kv head (GQA-aware),
dequantizes in registers (eq. 3) and writes

* the logits ``s_{b,t}`` (read again by Phase 2 for the blocks it keeps at INT8),
* the block log-mass ``l_b = m_b + log sum_t exp(s_{b,t} - m_b)`` (eq. 8's ``p_hat`` before
  normalisation),
* ``Delta_b = scaling * sum_c |q_c| r_c`` (eq. 8) with ``r_c = a sigma_c + b |z_c|`` computed from
  the scales already in registers (the codec's ``bound_coefficients``).

FP32 multiply-adds throughout (no TF32), so the results match the PyTorch reference to FP32
rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _score_kernel(q_ptr, code_ptr, scale_ptr, offset_ptr, s_out, l_out, d_out,
                  s_qk, s_qg, s_ck, s_cn, s_ct, s_sk, s_sn, s_ok, s_og, s_on, s_lk, s_lg,
                  scaling, bound_a, bound_b,
                  G: tl.constexpr, BLOCK_G: tl.constexpr, B: tl.constexpr, D: tl.constexpr):
    kv = tl.program_id(0)
    blk = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    t = tl.arange(0, B)
    c = tl.arange(0, D)
    gmask = g < G
    q = tl.load(q_ptr + kv * s_qk + g[:, None] * s_qg + c[None, :], mask=gmask[:, None],
                other=0.0)
    codes = tl.load(code_ptr + kv * s_ck + blk * s_cn + t[:, None] * s_ct + c[None, :])
    scale = tl.load(scale_ptr + kv * s_sk + blk * s_sn + c)
    offset = tl.load(offset_ptr + kv * s_sk + blk * s_sn + c)
    k = codes.to(tl.float32) * scale[None, :] + offset[None, :]  # eq. 3, in registers
    s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scaling  # [BLOCK_G, B]
    tl.store(s_out + kv * s_ok + g[:, None] * s_og + blk * s_on + t[None, :], s,
             mask=gmask[:, None])
    m = tl.max(s, axis=1)
    log_mass = m + tl.log(tl.sum(tl.exp(s - m[:, None]), axis=1))
    bound = tl.where(scale > 0, bound_a * scale + bound_b * tl.abs(offset), 0.0)  # r_c
    delta = tl.sum(tl.abs(q) * bound[None, :], axis=1) * scaling  # eq. 8
    tl.store(l_out + kv * s_lk + g * s_lg + blk, log_mass, mask=gmask)
    tl.store(d_out + kv * s_lk + g * s_lg + blk, delta, mask=gmask)


def int8_phase1(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                offset: torch.Tensor, scaling: float, bound: tuple[float, float]):
    """Phase 1 of ``q [Hkv, G, d]`` against INT8 blocks ``codes [Hkv, n, B, d]`` with FP32
    ``scale, offset [Hkv, n, d]``; ``bound = (a, b)`` of ``r_c = a sigma_c + b |z_c|``.

    Returns ``(s [Hkv, G, n, B], log_mass [Hkv, G, n], delta_b [Hkv, G, n])``, all FP32.
    """
    hkv, group, d = q.shape
    n, bsz = codes.shape[1], codes.shape[2]
    q = q.float().contiguous()
    s = torch.empty(hkv, group, n, bsz, device=q.device, dtype=torch.float32)
    log_mass = torch.empty(hkv, group, n, device=q.device, dtype=torch.float32)
    delta = torch.empty_like(log_mass)
    if n == 0:
        return s, log_mass, delta
    assert codes.stride(3) == 1 and scale.stride(2) == 1 and scale.stride() == offset.stride()
    _score_kernel[(hkv, n)](
        q, codes, scale, offset, s, log_mass, delta,
        q.stride(0), q.stride(1), codes.stride(0), codes.stride(1), codes.stride(2),
        scale.stride(0), scale.stride(1), s.stride(0), s.stride(1), s.stride(2),
        log_mass.stride(0), log_mass.stride(1),
        float(scaling), float(bound[0]), float(bound[1]),
        G=group, BLOCK_G=triton.next_power_of_2(group), B=bsz, D=d)
    return s, log_mass, delta
