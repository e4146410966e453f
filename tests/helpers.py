"""Shared test helpers: synthetic KV data and the FP64 reference attention."""

from __future__ import annotations

import torch

from certkv import TieredKVStore
from certkv.kernels.reference import dense_attention

FP32_U = 2.0**-24


def make_kv(hkv, n, d, *, seed=0, outlier_channels=0, heavy_tail=False, key_offset=0.0):
    """Keys ``[Hkv, n, d]`` with optional outlier channels, values optionally heavy-tailed."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(hkv, n, d, generator=gen) + key_offset
    if outlier_channels:
        idx = torch.randperm(d, generator=gen)[:outlier_channels]
        k[..., idx] *= 10 + 90 * torch.rand(outlier_channels, generator=gen)
    if heavy_tail:  # Cauchy (Student-t, 1 dof) from the seeded generator: deterministic
        u = torch.rand(hkv, n, d, generator=gen).clamp(1e-6, 1 - 1e-6)
        v = torch.tan(torch.pi * (u - 0.5)).clamp(-3e4, 3e4)
    else:
        v = torch.randn(hkv, n, d, generator=gen)
    return k, v


def make_query(k, group, *, seed=0, scale=1.0, peaked=False):
    """Queries ``[Hq, d]``; ``peaked`` aligns each with one cached key (sharp attention)."""
    gen = torch.Generator().manual_seed(seed + 1)
    hkv, n, d = k.shape
    q = torch.randn(hkv * group, d, generator=gen)
    if peaked:
        pick = torch.randint(0, n, (hkv * group,), generator=gen)
        kv = torch.arange(hkv * group) // group
        q = k[kv, pick] + 0.1 * q
    return q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12) * scale * d**0.5


def cuda_layer(hkv, n, d, group, seed=1):
    """A CUDA store of ``n`` synthetic tokens (outlier channels) and a peaked query."""
    k, v = make_kv(hkv, n, d, seed=seed, outlier_channels=4)
    store = TieredKVStore(hkv, d, device="cuda")
    store.append(k.cuda(), v.cuda())
    return store, make_query(k, group, seed=seed + 1, scale=2.0, peaked=True).cuda()


def originals(store: TieredKVStore):
    """FP16 originals ``[Hkv, N, d]`` of every token in the store (Tier-2 + tail)."""
    return store.dense_kv()


def reference_fp64(q, store, scaling=None):
    """O_ref: softmax attention on the original K/V, computed in FP64 -> ``[Hq, d]``."""
    k, v = originals(store)
    group = q.shape[0] // store.num_kv_heads
    k, v = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    scaling = store.head_dim**-0.5 if scaling is None else scaling
    w = torch.softmax(torch.einsum("hd,hnd->hn", q.double(), k) * scaling, dim=-1)
    return torch.einsum("hn,hnd->hd", w, v)


def dense_reference(q, store, scaling=None):
    """Dense SDPA on the FP16 originals (what rungs 3-4 must return) -> ``[Hq, d]``."""
    k, v = originals(store)
    group = q.shape[0] // store.num_kv_heads
    scaling = store.head_dim**-0.5 if scaling is None else scaling
    return dense_attention(q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), scaling)


def _logit_rounding(q, keys, scaling):
    """Max ``|s_fp32 - s_exact|`` over tokens, per head, for keys ``[Hq, N, d]`` (FP32 input)."""
    s32 = torch.einsum("hd,hnd->hn", q.float(), keys.float()) * scaling
    s64 = torch.einsum("hd,hnd->hn", q.float().double(), keys.float().double()) * scaling
    return (s32.double() - s64).abs().amax(dim=-1), s64.abs().amax(dim=-1)


def float_tolerance(q, store, scaling=None):
    """Per-head FP32 arithmetic allowance ``[Hq]`` for comparing with the FP64 reference.

    The FP32 logits differ from exact ones by a measured ``delta`` (original keys and the
    dequantized keys the kernel scores; 4x margin for a different summation order, plus the
    rounding of ``s - m``); a logit shift of ``delta`` moves the output by at most
    ``2 V_max tanh(delta)`` (Lemma A.2); softmax sums and the weighted value sum add
    ``O((N + d + B) u) V_max``.
    """
    k, v = originals(store)
    group = q.shape[0] // store.num_kv_heads
    d = store.head_dim
    scaling = d**-0.5 if scaling is None else scaling
    k_hat = torch.cat([store.dequantized_keys().flatten(1, 2), store.tail()[0].float()], dim=1)
    err_orig, mag = _logit_rounding(q, k.repeat_interleave(group, 0), scaling)
    err_hat, mag_hat = _logit_rounding(q, k_hat.repeat_interleave(group, 0), scaling)
    delta = 4 * torch.maximum(err_orig, err_hat) + 4 * FP32_U * torch.maximum(mag, mag_hat)
    v_max = v.double().norm(dim=-1).amax(dim=-1).repeat_interleave(group)
    n = k.shape[1]
    return v_max * (2 * torch.tanh(2 * delta) + 8 * (n + d + store.block_size) * FP32_U) + 1e-12
