"""Page-in without the host (issue 24): copy FP16 blocks from Tier-2 into scratch slots chosen
on the device.

One launch fills every slot the device-side scratch bookkeeping
(:mod:`certkv.cache.device_scratch`) marked this step, keys and values alike (one program row
per pool): a program walks ``SLOTS`` slots and
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
def _fill(need_ptr, src_ptr, tier2_ptr, pool_ptr, start, n_slots, s_2p, s_2t, s_pp, s_pt,
          B: tl.constexpr, D: tl.constexpr, SLOTS: tl.constexpr):
    """Slots ``start .. start + SLOTS`` of one pool."""
    t = tl.arange(0, B)
    c = tl.arange(0, D)
    for i in range(SLOTS):
        slot = start + i
        if tl.load(need_ptr + slot, mask=slot < n_slots, other=0) != 0:
            row = tl.load(src_ptr + slot)
            block = tl.load(tier2_ptr + row * s_2p + t[:, None] * s_2t + c[None, :])
            tl.store(pool_ptr + slot.to(tl.int64) * s_pp + t[:, None] * s_pt + c[None, :],
                     block)


@triton.jit
def _fill_kernel(need_a, src_a, tier2_a, pool_a, slots_a, need_b, src_b, tier2_b, pool_b,
                 slots_b, s_2p, s_2t, s_pp, s_pt,
                 B: tl.constexpr, D: tl.constexpr, SLOTS: tl.constexpr):
    """Grid ``(programs, pools)``: program row 0 fills pool ``a``, row 1 pool ``b``."""
    start = tl.program_id(0) * SLOTS
    if tl.program_id(1) == 0:
        _fill(need_a, src_a, tier2_a, pool_a, start, slots_a, s_2p, s_2t, s_pp, s_pt,
              B, D, SLOTS)
    else:
        _fill(need_b, src_b, tier2_b, pool_b, start, slots_b, s_2p, s_2t, s_pp, s_pt,
              B, D, SLOTS)


def fill_slots(fills: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
               ) -> None:
    """``pool[s] = tier2[src[s]]`` for every slot ``s`` with ``need[s]``, for one or two
    ``(need, src, tier2, pool)`` (keys and values), in one launch.

    Args (each fill):
        need: int8 ``[S]`` on the device; src: int64 ``[S]`` Tier-2 rows.
        tier2: FP16 ``[R, B, d]`` row view of Tier-2 (read in place; strides only).
        pool: FP16 ``[S, B, d]`` scratch slots on the device, written in place.
    The Tier-2 views share their strides, as the pools do (keys and values of one store).
    """
    assert 1 <= len(fills) <= 2
    slots = max(pool.shape[0] for *_, pool in fills)
    if slots == 0:
        return
    (_, _, tier2, pool), last = fills[0], fills[-1]
    assert all(t.stride() == tier2.stride() and p.stride() == pool.stride()
               for _, _, t, p in fills)
    assert tier2.stride(-1) == 1 and pool.stride(-1) == 1
    _fill_kernel[(triton.cdiv(slots, SLOTS), len(fills))](
        *fills[0], fills[0][3].shape[0], *last, last[3].shape[0], tier2.stride(0),
        tier2.stride(1), pool.stride(0), pool.stride(1), B=pool.shape[1], D=pool.shape[2],
        SLOTS=SLOTS)
