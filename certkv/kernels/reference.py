"""PyTorch reference of the two phases (paper Algorithm 1) and the dense fallback.

Runs on any device and is the oracle the Triton kernels are tested against. Shapes use
``Hkv`` kv heads, ``G = Hq / Hkv`` query heads per kv head, ``n`` blocks of ``B`` token slots
(empty slots of the partial tail block hold ``-inf`` scores), head dimension ``d``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from certkv.certify.bounds import block_deltas
from certkv.certify.checks import boundary_ok, canary_violations, ranking_consistent


def block_scores(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float):
    """Token logits ``s_{b,t} = scaling * q . k_{b,t}`` (Alg. 1 Phase 1), FP32.

    Args:
        q: ``[Hkv, G, d]``; keys: ``[Hkv, n, B, d]`` FP32; valid: ``[n, B]`` bool.
    Returns:
        ``[Hkv, G, n, B]`` with ``-inf`` on empty slots.
    """
    s = torch.einsum("kgd,kntd->kgnt", q.float(), keys.float()) * scaling
    return s.masked_fill(~valid, float("-inf"))


@dataclass
class Scored:
    """Phase-1 result: logits ``scores [Hkv, G, n, B]``, block log-masses
    ``log_mass = logsumexp_t s_{b,t}`` and ``delta_b`` (eq. 8; 0 on the exact tail block), both
    ``[Hkv, G, n]``."""

    scores: torch.Tensor
    log_mass: torch.Tensor
    delta_b: torch.Tensor


@dataclass
class Attended:
    """Phase-2 result: ``out [Hkv, G, d]``; block masses ``rho`` and log-masses ``[Hkv, G, n]``;
    ``canary [Hkv, G, n]`` marks gated blocks whose FP16 logits left ``Delta_b`` (Section 6)."""

    out: torch.Tensor
    rho: torch.Tensor
    log_mass: torch.Tensor
    canary: torch.Tensor | None = None


def phase1(q: torch.Tensor, lay, scaling: float) -> Scored:
    """Phase 1 on the step layout's decoded keys: logits, block log-masses and ``Delta_b``.

    Args:
        q: ``[Hkv, G, d]``; lay: the step's :class:`~certkv.kernels.layout.StepLayout`.
    """
    s = block_scores(q, lay.keys, lay.valid, scaling)
    delta = torch.zeros(s.shape[:3], device=s.device)
    delta[..., : lay.num_quantized] = block_deltas(q, lay.channel_bound, scaling)
    return Scored(scores=s, log_mass=torch.logsumexp(s, dim=-1), delta_b=delta)


def gated_scores(q: torch.Tensor, scored: Scored, gate: torch.Tensor, keys, scaling: float,
                 eps_guard: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase-2 logits: FP16-key logits on the staged key blocks for the heads whose ``gate``
    (``[Hkv, G, n]``, the promoted set) is set, Phase-1 logits elsewhere.

    Returns the logits ``[Hkv, G, n, B]`` and the canary violations ``[Hkv, G, n]`` of the gated
    blocks (:func:`~certkv.certify.checks.canary_violations`).
    """
    s8 = scored.scores
    violated = torch.zeros_like(gate)
    if keys is None:
        return s8, violated
    kv, blk = keys.kv_heads, keys.blocks
    s16 = torch.einsum("pgd,ptd->pgt", q[kv].float(), keys.gathered().float()) * scaling
    s8_at, on = s8[kv, :, blk], gate[kv, :, blk]
    violated[kv, :, blk] = on & canary_violations(s8_at, s16, scored.delta_b[kv, :, blk],
                                                  eps_guard)
    s2 = s8.clone()
    s2[kv, :, blk] = torch.where(on.unsqueeze(-1), s16, s8_at)
    return s2, violated


def attend(scores: torch.Tensor, values: torch.Tensor, fp64_scalars: bool = False) -> Attended:
    """Phase 2 (Alg. 1): softmax-weighted sum over all blocks, split per block then reduced by
    log-sum-exp (the online-softmax state of each block combined exactly, as in split-KV decode).

    The softmax scalars (block max ``m_b``, sums ``l_b``, masses ``rho_b``) are FP32, or FP64 with
    ``fp64_scalars`` (paper 9.10); the output accumulator is FP32.

    Args:
        scores: ``[Hkv, G, n, B]`` logits (``-inf`` on empty slots).
        values: ``[Hkv, n, B, d]`` FP32.
    """
    scalar = torch.float64 if fp64_scalars else torch.float32
    s = scores.to(scalar)
    m_b = s.amax(dim=-1)  # [Hkv, G, n]
    w = torch.exp(s - m_b.unsqueeze(-1))
    l_b = w.sum(dim=-1)
    o_b = torch.einsum("kgnt,kntd->kgnd", w.float(), values.float())
    m = m_b.amax(dim=-1, keepdim=True)
    alpha = torch.exp(m_b - m)
    total = (alpha * l_b).sum(dim=-1, keepdim=True)
    out = (alpha.float().unsqueeze(-1) * o_b).sum(dim=-2) / total.float()
    rho = alpha * l_b / total
    return Attended(out=out, rho=rho.float(), log_mass=(m_b + torch.log(l_b)).float())


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float):
    """Dense SDPA on FP16 originals: the Dense baseline's code path and rungs 3-4 (paper 3.4).

    Args:
        q: ``[n, d]``; k, v: ``[h, N, d]`` with ``n`` a multiple of ``h`` (query head ``i`` reads
            kv head ``i // (n / h)``, GQA without copying the cache).
    Returns:
        ``[n, d]`` in ``q``'s dtype. A 16-bit ``q`` runs in the cache's dtype (production FP16
        decode: the cache is read in place, never converted); an FP32/FP64 ``q`` upcasts the
        originals (the exact reference).
    """
    half = q.dtype in (torch.float16, torch.bfloat16)
    dtype = k.dtype if half else q.dtype
    out = F.scaled_dot_product_attention(
        q.to(dtype)[None, :, None, :], k.to(dtype)[None], v.to(dtype)[None], scale=scaling,
        enable_gqa=k.shape[0] != q.shape[0],
    )
    return out[0, :, 0, :].to(q.dtype)


def merge_staged(values: torch.Tensor, staged) -> torch.Tensor:
    """``values [Hkv, n, B, d]`` with the staged FP16 blocks written in (a copy if any)."""
    if staged is None:
        return values
    values = values.clone()
    values[staged.kv_heads, staged.blocks] = staged.gathered().float()
    return values


@dataclass
class TorchBackend:
    """Reference backend: every phase in PyTorch on decoded FP32 blocks (CPU or CUDA)."""

    fp64_scalars: bool = False
    name: str = "torch"

    def phase1(self, q, lay, scaling) -> Scored:
        return phase1(q, lay, scaling)

    def phase2(self, q, scored, lay, gate, keys, values, scaling, eps_guard) -> Attended:
        """Phase 2 over decoded values: gated FP16-key logits, staged FP16 values."""
        s2, violated = gated_scores(q, scored, gate, keys, scaling, eps_guard)
        att = attend(s2, merge_staged(lay.values, values), self.fp64_scalars)
        att.canary = violated
        return att

    def checks(self, l_int8, l_fp16, delta_b, promoted, tail, r):
        """Ranking (eq. 17) and boundary (eq. 18) flags ``[Hq]``."""
        return (ranking_consistent(l_int8, l_fp16, promoted, r),
                boundary_ok(l_int8, l_fp16, delta_b, promoted, tail, r))

    def dense(self, q, k, v, scaling):
        return dense_attention(q, k, v, scaling)
