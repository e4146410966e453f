"""Triton Phase 2 (paper Alg. 1): one split-KV pass over mask-gated logits and INT4 values.

Grid ``(kv head, split)``: each program walks ``SPLIT`` consecutive blocks for all ``G`` query
heads of its kv head. Per block it reads the Phase-2 logits (FP16-key logits on promoted blocks,
INT8 elsewhere), the INT4 value codes unpacked in registers with their FP16 group scale/offset,
or, where ``slot[kv, block] >= 0``, FP16 values staged from Tier-2 / the scratch cache (value
promotion and the exact tail block). FP32 online softmax; per-block max ``m_b`` and sum ``l_b``
are written for the block masses; the splits are merged by log-sum-exp in :func:`reduce_splits`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from certkv.kernels.reference import Attended


@triton.jit
def _attend_kernel(s_ptr, code_ptr, vs_ptr, vo_ptr, slot_ptr, staged_ptr,
                   mb_ptr, lb_ptr, m_ptr, l_ptr, acc_ptr,
                   s_sk, s_sg, s_sn, s_ck, s_cn, s_ct, s_vk, s_vn, s_vt, s_lk,
                   s_pp, s_pt, s_bk, s_bg, s_mk, s_mg, s_ak, s_ag, s_as,
                   n_blocks, n_quant,
                   G: tl.constexpr, BLOCK_G: tl.constexpr, B: tl.constexpr, D: tl.constexpr,
                   GROUP: tl.constexpr, SPLIT: tl.constexpr):
    kv = tl.program_id(0)
    split = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    t = tl.arange(0, B)
    c = tl.arange(0, D)
    gmask = g < G
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    lsum = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    zero_bd = t[:, None] * 0 + c[None, :] * 0  # [B, D] int zeros: broadcast scalars to masks
    for i in range(SPLIT):
        blk = split * SPLIT + i
        live_g = (g * 0 + blk) < n_blocks
        s = tl.load(s_ptr + kv * s_sk + g[:, None] * s_sg + blk * s_sn + t[None, :],
                    mask=(gmask & live_g)[:, None] & (t[None, :] < B), other=float("-inf"))
        slot = tl.load(slot_ptr + kv * s_lk + tl.minimum(blk, n_blocks - 1))
        int4 = ((zero_bd + blk) < n_quant) & ((zero_bd + slot) < 0)
        fp16 = ((zero_bd + slot) >= 0) & ((zero_bd + blk) < n_blocks)
        byte = tl.load(code_ptr + kv * s_ck + blk * s_cn + t[:, None] * s_ct + c[None, :] // 2,
                       mask=int4, other=0)
        code = (byte >> ((c[None, :] % 2) * 4).to(tl.uint8)) & 0xF  # unsigned nibble
        grp = c[None, :] // GROUP
        vs = tl.load(vs_ptr + kv * s_vk + blk * s_vn + t[:, None] * s_vt + grp, mask=int4,
                     other=0.0).to(tl.float32)
        vo = tl.load(vo_ptr + kv * s_vk + blk * s_vn + t[:, None] * s_vt + grp, mask=int4,
                     other=0.0).to(tl.float32)
        v_int4 = code.to(tl.float32) * vs + vo
        v16 = tl.load(staged_ptr + slot * s_pp + t[:, None] * s_pt + c[None, :], mask=fp16,
                      other=0.0).to(tl.float32)
        v = tl.where(fp16, v16, v_int4)  # [B, D]
        m_b = tl.max(s, axis=1)  # [BLOCK_G]
        m_safe = tl.where(m_b == float("-inf"), 0.0, m_b)
        w = tl.exp(s - m_safe[:, None])
        l_b = tl.sum(w, axis=1)
        o_b = tl.sum(w[:, :, None] * v[None, :, :], axis=1)  # [BLOCK_G, D]
        tl.store(mb_ptr + kv * s_bk + g * s_bg + blk, m_b, mask=gmask & live_g)
        tl.store(lb_ptr + kv * s_bk + g * s_bg + blk, l_b, mask=gmask & live_g)
        m_new = tl.maximum(m, m_b)
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_new_safe)
        beta = tl.exp(m_b - m_new_safe)
        lsum = lsum * alpha + l_b * beta
        acc = acc * alpha[:, None] + o_b * beta[:, None]
        m = m_new
    tl.store(m_ptr + kv * s_mk + g * s_mg + split, m, mask=gmask)
    tl.store(l_ptr + kv * s_mk + g * s_mg + split, lsum, mask=gmask)
    tl.store(acc_ptr + kv * s_ak + g[:, None] * s_ag + split * s_as + c[None, :], acc,
             mask=gmask[:, None])


def reduce_splits(m_b, l_b, m, lsum, acc) -> Attended:
    """Merge per-split online-softmax states by log-sum-exp; block masses from ``m_b, l_b``.

    Shapes: ``m_b, l_b [Hkv, G, n]``; ``m, lsum [Hkv, G, S]``; ``acc [Hkv, G, S, d]``.
    """
    top = m.amax(dim=-1, keepdim=True)
    weight = torch.exp(m - top)
    total = (weight * lsum).sum(dim=-1, keepdim=True)
    out = (weight.unsqueeze(-1) * acc).sum(dim=-2) / total
    rho = torch.exp(m_b - top) * l_b / total
    return Attended(out=out, rho=rho, log_mass=m_b + torch.log(l_b))


def int4_attend(scores: torch.Tensor, codes: torch.Tensor, vscale: torch.Tensor,
                voffset: torch.Tensor, slot: torch.Tensor, staged: torch.Tensor, group: int,
                split: int = 16) -> Attended:
    """Phase 2 over ``n`` blocks: ``scores [Hkv, G, n, B]``; INT4 ``codes [Hkv, n_q, B, d/2]``
    with FP16 ``vscale, voffset [Hkv, n_q, B, d/g]``; ``slot [Hkv, n]`` (int32) indexes FP16
    blocks ``staged [P, B, d]`` that replace the INT4 values (-1: none)."""
    hkv, g, n, bsz = scores.shape
    d = staged.shape[-1]
    n_splits = triton.cdiv(n, split)
    dev = scores.device
    m_b = torch.empty(hkv, g, n, device=dev)
    l_b = torch.empty_like(m_b)
    m = torch.empty(hkv, g, n_splits, device=dev)
    lsum = torch.empty_like(m)
    acc = torch.empty(hkv, g, n_splits, d, device=dev)
    scores = scores.contiguous()
    slot = slot.to(torch.int32).contiguous()
    staged = staged.contiguous()
    _attend_kernel[(hkv, n_splits)](
        scores, codes, vscale, voffset, slot, staged, m_b, l_b, m, lsum, acc,
        scores.stride(0), scores.stride(1), scores.stride(2),
        codes.stride(0), codes.stride(1), codes.stride(2),
        vscale.stride(0), vscale.stride(1), vscale.stride(2), slot.stride(0),
        staged.stride(0), staged.stride(1), m_b.stride(0), m_b.stride(1),
        m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        n, codes.shape[1],
        G=g, BLOCK_G=triton.next_power_of_2(g), B=bsz, D=d, GROUP=group, SPLIT=split)
    return reduce_splits(m_b, l_b, m, lsum, acc)
