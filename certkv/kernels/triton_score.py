"""Triton Phase 1 (paper Alg. 1): block logits straight from INT8 key codes.

One program per (kv head, block): it loads the block's INT8 codes ``[B, d]`` and FP32
per-channel scale/offset, dequantizes in registers (eq. 3) and writes the logits of all ``G``
query heads of that kv head (GQA-aware: the block is read once for the whole group). FP32
multiply-adds throughout (no TF32), so the logits match the PyTorch reference to FP32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _score_kernel(q_ptr, code_ptr, scale_ptr, offset_ptr, out_ptr,
                  s_qk, s_qg, s_ck, s_cn, s_ct, s_sk, s_sn, s_ok, s_og, s_on,
                  scaling, G: tl.constexpr, BLOCK_G: tl.constexpr, B: tl.constexpr,
                  D: tl.constexpr):
    kv = tl.program_id(0)
    blk = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    t = tl.arange(0, B)
    c = tl.arange(0, D)
    q = tl.load(q_ptr + kv * s_qk + g[:, None] * s_qg + c[None, :], mask=g[:, None] < G,
                other=0.0)
    codes = tl.load(code_ptr + kv * s_ck + blk * s_cn + t[:, None] * s_ct + c[None, :])
    scale = tl.load(scale_ptr + kv * s_sk + blk * s_sn + c)
    offset = tl.load(offset_ptr + kv * s_sk + blk * s_sn + c)
    k = codes.to(tl.float32) * scale[None, :] + offset[None, :]  # eq. 3, in registers
    s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scaling  # [BLOCK_G, B]
    tl.store(out_ptr + kv * s_ok + g[:, None] * s_og + blk * s_on + t[None, :], s,
             mask=g[:, None] < G)


def int8_block_scores(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                      offset: torch.Tensor, scaling: float) -> torch.Tensor:
    """Logits ``[Hkv, G, n, B]`` of ``q [Hkv, G, d]`` against INT8 blocks ``codes [Hkv, n, B, d]``
    with per-block FP32 ``scale, offset [Hkv, n, d]``."""
    hkv, group, d = q.shape
    n, bsz = codes.shape[1], codes.shape[2]
    q = q.float().contiguous()
    out = torch.empty(hkv, group, n, bsz, device=q.device, dtype=torch.float32)
    if n == 0:
        return out
    assert codes.stride(3) == 1 and scale.stride(2) == 1 and scale.stride() == offset.stride()
    _score_kernel[(hkv, n)](
        q, codes, scale, offset, out,
        q.stride(0), q.stride(1), codes.stride(0), codes.stride(1), codes.stride(2),
        scale.stride(0), scale.stride(1), out.stride(0), out.stride(1), out.stride(2),
        float(scaling), G=group, BLOCK_G=triton.next_power_of_2(group), B=bsz, D=d)
    return out
