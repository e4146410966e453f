"""Triton Phase 1 (paper Alg. 1): block logits, log-masses and Delta_b from INT8 key codes.

Grid ``(kv head, split)``: each program walks ``SPLIT`` consecutive blocks; per block it loads
the INT8 codes ``[B, d]`` and FP32 per-channel scale/offset once for all ``G`` query heads of
the kv head (GQA-aware), dequantizes in registers (eq. 3) and writes

* the logits ``s_{b,t}`` (read again by Phase 2 for the blocks it keeps at INT8; the exact tail
  block's FP16 keys are read in place from the store's tail buffer),
* the block log-mass ``l_b = m_b + log sum_t exp(s_{b,t} - m_b)`` (eq. 8's ``p_hat`` before
  normalisation),
* ``Delta_b = scaling * sum_c |q_c| r_c`` (eq. 8) with ``r_c = a sigma_c + b |z_c|`` computed from
  the scales already in registers (the codec's ``bound_coefficients``),
* the block log-spread ``m_b + log sum_t exp(2 (s_{b,t} - m_b)) / 2`` (``log ||e^{s_b}||_2``,
  the value policy's spread estimate), one more sum over the logits already in registers.

FP32 multiply-adds throughout (no TF32), so the results match the PyTorch reference to FP32
rounding; dot products sum in two levels (:func:`channel_dot`), which the arithmetic
bound counts on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from certkv.certify.arith import dot_chunk


@triton.jit
def load_group_queries(q_ptr, kv, s_qk, s_qg, G: tl.constexpr, BLOCK_G: tl.constexpr,
                       D: tl.constexpr):
    """The ``G`` query heads of kv head ``kv`` as ``[BLOCK_G, D]`` (padding rows are 0)."""
    g = tl.arange(0, BLOCK_G)
    c = tl.arange(0, D)
    return tl.load(q_ptr + kv * s_qk + g[:, None] * s_qg + c[None, :], mask=(g < G)[:, None],
                   other=0.0)


@triton.jit
def channel_dot(q, k, BLOCK_G: tl.constexpr, B: tl.constexpr, D: tl.constexpr,
                DOT_C: tl.constexpr):
    """``q [BLOCK_G, D] . k [B, D] -> [BLOCK_G, B]`` summed in two levels: chunks of ``DOT_C``
    channels, then across chunks, so no product takes more than ``DOT_C + D / DOT_C - 1``
    roundings whatever order each reduction uses (``arith.dot_depth``)."""
    prod = tl.reshape(q[:, None, :] * k[None, :, :], (BLOCK_G, B, D // DOT_C, DOT_C))
    return tl.sum(tl.sum(prod, axis=3), axis=2)


@triton.jit
def _score_kernel(q_ptr, code_ptr, scale_ptr, offset_ptr, tail_ptr, s_out, l_out, d_out, ls_out,
                  s_qk, s_qg, s_ck, s_cn, s_ct, s_sk, s_sn, s_tk, s_tt, s_ok, s_og, s_on,
                  s_lk, s_lg, n_blocks, n_quant, tail_len, scaling, bound_a, bound_b,
                  G: tl.constexpr, BLOCK_G: tl.constexpr, B: tl.constexpr, D: tl.constexpr,
                  DOT_C: tl.constexpr, SPLIT: tl.constexpr):
    kv = tl.program_id(0)
    g = tl.arange(0, BLOCK_G)
    t = tl.arange(0, B)
    c = tl.arange(0, D)
    gmask = g < G
    q = load_group_queries(q_ptr, kv, s_qk, s_qg, G, BLOCK_G, D)
    q_abs = tl.abs(q)
    for i in range(SPLIT):
        blk = tl.program_id(1) * SPLIT + i
        quant = (c * 0 + blk) < n_quant  # [D]: an INT8 block
        tail = (t * 0 + blk) == n_quant  # [B]: the exact FP16 tail block
        codes = tl.load(code_ptr + kv * s_ck + blk * s_cn + t[:, None] * s_ct + c[None, :],
                        mask=quant[None, :], other=0)
        scale = tl.load(scale_ptr + kv * s_sk + blk * s_sn + c, mask=quant, other=0.0)
        offset = tl.load(offset_ptr + kv * s_sk + blk * s_sn + c, mask=quant, other=0.0)
        k = codes.to(tl.float32) * scale[None, :] + offset[None, :]  # eq. 3, in registers
        k16 = tl.load(tail_ptr + kv * s_tk + t[:, None] * s_tt + c[None, :],
                      mask=(tail & (t < tail_len))[:, None], other=0.0)
        k = tl.where(tail[:, None], k16.to(tl.float32), k)
        s = channel_dot(q, k, BLOCK_G, B, D, DOT_C) * scaling  # [BLOCK_G, B]
        s = tl.where((tail & (t >= tail_len))[None, :], float("-inf"), s)  # empty slots
        live_g = gmask & ((g * 0 + blk) < n_blocks)
        tl.store(s_out + kv * s_ok + g[:, None] * s_og + blk * s_on + t[None, :], s,
                 mask=live_g[:, None])
        m = tl.max(s, axis=1)
        m = tl.where(m == float("-inf"), 0.0, m)  # past the last block: nothing is stored
        w = tl.exp(s - m[:, None])
        log_mass = m + tl.log(tl.sum(w, axis=1))
        log_spread = m + 0.5 * tl.log(tl.sum(w * w, axis=1))
        bound = tl.where(scale > 0, bound_a * scale + bound_b * tl.abs(offset), 0.0)  # r_c
        delta = tl.sum(q_abs * bound[None, :], axis=1) * scaling  # eq. 8 (0 on the tail)
        tl.store(l_out + kv * s_lk + g * s_lg + blk, log_mass, mask=live_g)
        tl.store(d_out + kv * s_lk + g * s_lg + blk, delta, mask=live_g)
        tl.store(ls_out + kv * s_lk + g * s_lg + blk, log_spread, mask=live_g)


MAX_SPLIT = 64  # most blocks one program walks on a GPU (bounds the rounding chain)


def blocks_per_program(n: int, hkv: int, device: torch.device, waves: int = 4) -> int:
    """Blocks each program walks (power of two, 1-``MAX_SPLIT``): enough programs for ``waves``
    per SM on a GPU, few large ones in the interpreter. Used by Phase 1 and Phase 2."""
    if device.type != "cuda":
        return 4
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLIT, triton.next_power_of_2(triton.cdiv(n * hkv, waves * sms))))


def int8_phase1(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                offset: torch.Tensor, tail: torch.Tensor, tail_len: int, scaling: float,
                bound: tuple[float, float], split: int | None = None):
    """Phase 1 of ``q [Hkv, G, d]`` over the ``n_q`` INT8 blocks ``codes [Hkv, n_q, B, d]``
    (FP32 ``scale, offset [Hkv, n_q, d]``) and, when ``tail_len > 0``, the exact FP16 tail block
    read in place from ``tail [Hkv, B, d]``. ``bound = (a, b)`` of ``r_c = a sigma_c + b |z_c|``;
    ``split`` blocks per program (``None``: :func:`blocks_per_program`).

    Returns ``(s [Hkv, G, n, B], log_mass, delta_b, log_spread [Hkv, G, n])``, all FP32, with
    ``n = n_q + (tail_len > 0)``, ``-inf`` logits on empty tail slots and ``Delta_b = 0`` there.
    """
    hkv, group, d = q.shape
    n_q, bsz = codes.shape[1], codes.shape[2]
    n = n_q + (tail_len > 0)
    q = q.float().contiguous()
    s = torch.empty(hkv, group, n, bsz, device=q.device, dtype=torch.float32)
    log_mass = torch.empty(hkv, group, n, device=q.device, dtype=torch.float32)
    delta = torch.empty_like(log_mass)
    log_spread = torch.empty_like(log_mass)
    if n == 0:
        return s, log_mass, delta, log_spread
    assert codes.stride(3) == 1 and scale.stride(2) == 1 and scale.stride() == offset.stride()
    assert tail.stride(2) == 1
    split = split or blocks_per_program(n, hkv, q.device)
    _score_kernel[(hkv, triton.cdiv(n, split))](
        q, codes, scale, offset, tail, s, log_mass, delta, log_spread,
        q.stride(0), q.stride(1), codes.stride(0), codes.stride(1), codes.stride(2),
        scale.stride(0), scale.stride(1), tail.stride(0), tail.stride(1),
        s.stride(0), s.stride(1), s.stride(2), log_mass.stride(0), log_mass.stride(1),
        n, n_q, tail_len, float(scaling), float(bound[0]), float(bound[1]),
        G=group, BLOCK_G=triton.next_power_of_2(group), B=bsz, D=d, DOT_C=dot_chunk(d),
        SPLIT=split)
    return s, log_mass, delta, log_spread
