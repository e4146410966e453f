"""Triton quantize-on-append: completed FP16 blocks -> INT8 keys, INT4 values, eta_b, nu_b.

One program per (kv head, block), the same arithmetic as the PyTorch codecs (paper 2.3):
keys get per-channel scale ``(max - min) / 255`` and offset ``min + 128 scale`` (FP32), signed
INT8 codes; values get per-token, per-group FP16 scale ``(max - min) / 15`` rounded *up* to FP16
and FP16 offset ``min``, unsigned INT4 codes packed two per byte (low nibble first). The block
annotations are computed from the stored codes: ``eta_b = max_t ||v_t - v_hat_t||`` and
``nu_b = max_t ||v_t||``, both in FP32 and inflated by ``1 + 2^-16`` so they stay upper bounds of
the exact values (Corollary 4.2 needs an upper bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_INFLATE = 1.0 + 2.0**-16


@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _quantize_kernel(k_ptr, v_ptr, kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, eta_ptr,
                     nu_ptr, n_blocks, inflate,
                     B: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
                     NG: tl.constexpr):
    kv = tl.program_id(0)
    blk = tl.program_id(1)
    base = (kv * n_blocks + blk) * B * D
    t = tl.arange(0, B)
    c = tl.arange(0, D)
    # keys: per channel over the block's B tokens (eq. 2-3)
    k = tl.load(k_ptr + base + t[:, None] * D + c[None, :]).to(tl.float32)
    lo = tl.min(k, axis=0)
    hi = tl.max(k, axis=0)
    scale = (hi - lo) / 255.0
    offset = lo + 128.0 * scale
    safe = tl.where(scale > 0, scale, 1.0)
    codes = _round_half_even((k - offset[None, :]) / safe[None, :])
    codes = tl.minimum(tl.maximum(codes, -128.0), 127.0)
    tl.store(kc_ptr + base + t[:, None] * D + c[None, :], codes.to(tl.int8))
    meta = (kv * n_blocks + blk) * D
    tl.store(ks_ptr + meta + c, scale)
    tl.store(ko_ptr + meta + c, offset)
    # values: per token, per group of GROUP channels
    j = tl.arange(0, GROUP)
    gi = tl.arange(0, NG)
    vptr = v_ptr + base + t[:, None, None] * D + gi[None, :, None] * GROUP + j[None, None, :]
    v = tl.load(vptr).to(tl.float32)  # [B, NG, GROUP]
    vlo = tl.min(v, axis=2)
    vhi = tl.max(v, axis=2)
    s32 = (vhi - vlo) / 15.0
    s16 = s32.to(tl.float16)
    bits = s16.to(tl.int16, bitcast=True)
    s16 = tl.where(s16.to(tl.float32) < s32, (bits + 1).to(tl.float16, bitcast=True), s16)
    o16 = vlo.to(tl.float16)
    sf = s16.to(tl.float32)
    of = o16.to(tl.float32)
    vsafe = tl.where(sf > 0, sf, 1.0)
    vcode = _round_half_even((v - of[:, :, None]) / vsafe[:, :, None])
    vcode = tl.minimum(tl.maximum(vcode, 0.0), 15.0)
    vhat = vcode * sf[:, :, None] + of[:, :, None]
    err = tl.sqrt(tl.sum(tl.sum((vhat - v) * (vhat - v), axis=2), axis=1))  # [B]
    norm = tl.sqrt(tl.sum(tl.sum(v * v, axis=2), axis=1))
    tl.store(eta_ptr + kv * n_blocks + blk, tl.max(err, axis=0) * inflate)
    tl.store(nu_ptr + kv * n_blocks + blk, tl.max(norm, axis=0) * inflate)
    gmeta = ((kv * n_blocks + blk) * B + t[:, None]) * NG + gi[None, :]
    tl.store(vs_ptr + gmeta, s16)
    tl.store(vo_ptr + gmeta, o16)
    # pack two 4-bit codes per byte along the channel axis: reshape [B, D] -> [B, D/2, 2]
    flat = tl.reshape(vcode.to(tl.uint8), (B, D // 2, 2))
    lo_n, hi_n = tl.split(flat)
    packed = lo_n | (hi_n << 4)
    h = tl.arange(0, D // 2)
    tl.store(vc_ptr + ((kv * n_blocks + blk) * B + t[:, None]) * (D // 2) + h[None, :], packed)


def quantize_blocks(k16: torch.Tensor, v16: torch.Tensor, group: int):
    """Encode FP16 blocks ``[Hkv, n, B, d]``: returns ``(key_blocks, value_blocks, eta, nu)`` in
    the layout of ``ChannelAffineKeyCodec(8)`` / ``GroupAffineValueCodec(4, group)``."""
    hkv, n, bsz, d = k16.shape
    dev = k16.device
    key = {"codes": torch.empty(hkv, n, bsz, d, dtype=torch.int8, device=dev),
           "scale": torch.empty(hkv, n, d, device=dev),
           "offset": torch.empty(hkv, n, d, device=dev)}
    ng = d // group
    value = {"codes": torch.empty(hkv, n, bsz, d // 2, dtype=torch.uint8, device=dev),
             "scale": torch.empty(hkv, n, bsz, ng, dtype=torch.float16, device=dev),
             "offset": torch.empty(hkv, n, bsz, ng, dtype=torch.float16, device=dev)}
    eta = torch.empty(hkv, n, device=dev)
    nu = torch.empty(hkv, n, device=dev)
    if n:
        _quantize_kernel[(hkv, n)](
            k16.contiguous(), v16.contiguous(), key["codes"], key["scale"], key["offset"],
            value["codes"], value["scale"], value["offset"], eta, nu, n, _INFLATE,
            B=bsz, D=d, GROUP=group, NG=ng)
    return key, value, eta, nu
