"""Page-in without the host (issue 24): copy FP16 blocks from Tier-2 into scratch slots chosen
on the device.

One launch fills every slot the device-side scratch bookkeeping
(:mod:`certkv.cache.device_scratch`) marked this step: a program walks ``SLOTS`` slots and
copies, for each marked one, block row ``src[slot]`` of Tier-2 (pinned host memory read through
unified addressing on CUDA; ordinary memory under ``TRITON_INTERPRET=1``) into ``pool[slot]``.
The host never learns which blocks moved. A copy changes no value (FP16 to FP16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SLOTS = 16  # slots per program


@triton.jit
def _fill_kernel(need_ptr, src_ptr, tier2_ptr, pool_ptr, n_slots, s_2p, s_2t, s_pp, s_pt,
                 B: tl.constexpr, D: tl.constexpr, SLOTS: tl.constexpr):
    start = tl.program_id(0) * SLOTS
    t = tl.arange(0, B)
    c = tl.arange(0, D)
    for i in range(SLOTS):
        slot = start + i
        if tl.load(need_ptr + slot, mask=slot < n_slots, other=0) != 0:
            row = tl.load(src_ptr + slot)
            block = tl.load(tier2_ptr + row * s_2p + t[:, None] * s_2t + c[None, :])
            tl.store(pool_ptr + slot.to(tl.int64) * s_pp + t[:, None] * s_pt + c[None, :],
                     block)


def fill_slots(need: torch.Tensor, src: torch.Tensor, tier2: torch.Tensor,
               pool: torch.Tensor) -> None:
    """``pool[s] = tier2[src[s]]`` for every slot ``s`` with ``need[s]``, in one launch.

    Args:
        need: int8 ``[S]`` on the device; src: int64 ``[S]`` Tier-2 rows.
        tier2: FP16 ``[R, B, d]`` row view of Tier-2 (read in place; strides only).
        pool: FP16 ``[S, B, d]`` scratch slots on the device, written in place.
    """
    slots, block, d = pool.shape
    if slots == 0:
        return
    assert tier2.stride(-1) == 1 and pool.stride(-1) == 1
    _fill_kernel[(triton.cdiv(slots, SLOTS),)](
        need, src, tier2, pool, slots, tier2.stride(0), tier2.stride(1), pool.stride(0),
        pool.stride(1), B=block, D=d, SLOTS=SLOTS)
