"""PyTorch reference of the two phases (paper Algorithm 1) and the dense fallback.

Runs on any device and is the oracle the Triton kernels are tested against. Shapes use
``Hkv`` kv heads, ``G = Hq / Hkv`` query heads per kv head, ``n`` blocks of ``B`` token slots
(empty slots of the partial tail block hold ``-inf`` scores), head dimension ``d``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from certkv.certify.arith import U32, Rounding, matmul_input_rounding
from certkv.certify.audit import reference_fp64
from certkv.certify.bounds import block_deltas
from certkv.certify.checks import canary_violations, rank_checks
from certkv.kernels.base import Backend

SUM_CHUNK = 64  # terms per chunk of the two-level sums over blocks
LOG2E = 1.4426950408889634  # log2(e)


def exp_weights(x: torch.Tensor) -> torch.Tensor:
    """``e^x`` as ``2^(x log2 e)`` (``x <= 0``: softmax weights). The scaling of the argument is
    one of the roundings arith item 4 counts for every exponential (``ARG_ROUNDING``, as GPUs
    compute ``ex2``); on CPU ``exp2`` also keeps its speed where ``exp`` takes a slow path for
    results below ``e^-87`` (up to 30 times slower, and peaked attention has many)."""
    return torch.exp2(x * LOG2E)


class BlockSoftmax(NamedTuple):
    """The online-softmax state of each block of logits ``s [..., n, B]`` (``-inf`` on empty
    slots): its max ``m [..., n]`` (``-inf`` for a block without a token), the weights ``w =
    e^{s - m} [..., n, B]``, their sum ``l`` and sum of squares ``l2`` ``[..., n]``."""

    m: torch.Tensor
    w: torch.Tensor
    l: torch.Tensor  # noqa: E741 (the paper's l_b)
    l2: torch.Tensor


def block_softmax(s: torch.Tensor) -> BlockSoftmax:
    """:class:`BlockSoftmax` of logits ``s [..., n, B]`` in their dtype (a block whose slots
    are all ``-inf`` gets ``m = -inf`` and no weight, never NaN)."""
    m = s.amax(dim=-1)
    w = exp_weights(s - m.clamp_min(torch.finfo(s.dtype).min).unsqueeze(-1))
    return BlockSoftmax(m, w, w.sum(dim=-1), (w * w).sum(dim=-1))


def chunked_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x.sum(dim)`` in two levels (chunks of ``SUM_CHUNK``, then across chunks): no term
    passes through more than ``SUM_CHUNK + n / SUM_CHUNK`` additions, whatever order each
    level uses (a flat sum may take ``n``). A partial last chunk is summed on its own (no
    padded copy of ``x``)."""
    dim = dim % x.ndim
    n = x.shape[dim]
    if n <= SUM_CHUNK:
        return x.sum(dim=dim)
    full = n - n % SUM_CHUNK
    sums = x.narrow(dim, 0, full).unflatten(dim, (-1, SUM_CHUNK)).sum(dim=dim + 1)
    if full < n:
        sums = torch.cat([sums, x.narrow(dim, full, n - full).sum(dim=dim, keepdim=True)], dim)
    return sums.sum(dim=dim)


def block_scores(q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, scaling: float):
    """Token logits ``s_{b,t} = scaling * q . k_{b,t}`` (Alg. 1 Phase 1), FP32, in one
    ``baddbmm``.

    Args:
        q: ``[Hkv, G, d]``; keys: ``[Hkv, n, B, d]`` FP32; bias: ``[n B]``, 0 on token slots and
            ``-inf`` on empty ones (:attr:`~certkv.kernels.layout.StepLayout.slot_bias`).
    Returns:
        ``[Hkv, G, n, B]`` with ``-inf`` on empty slots.
    """
    hkv, n, bsz, d = keys.shape
    flat = keys.reshape(hkv, n * bsz, d).transpose(1, 2)  # a view: BLAS reads k^T
    return torch.baddbmm(bias, q.float(), flat, alpha=scaling).view(hkv, -1, n, bsz)


@dataclass
class Scored:
    """Phase-1 result: logits ``scores [Hkv, G, n, B]``, block log-masses
    ``log_mass = logsumexp_t s_{b,t}``, ``delta_b`` (eq. 8; 0 on the exact tail block) and the
    block log-spreads ``log_spread = log ||e^{s_b}||_2 = logsumexp_t(2 s_{b,t}) / 2`` (the l2
    norm of the block's unnormalised weights; minus the log-sum-exp of ``log_mass`` over blocks
    it is ``log ||p_hat_b||_2``), all ``[Hkv, G, n]``; the PyTorch reference also keeps the
    blocks' softmax ``state`` (:class:`BlockSoftmax`), which Phase 2 reuses for every block
    whose logits it does not replace."""

    scores: torch.Tensor
    log_mass: torch.Tensor
    delta_b: torch.Tensor
    log_spread: torch.Tensor | None = None
    state: BlockSoftmax | None = None
    arrays: tuple | None = None  # a backend's own views of scores and state (numba: NumPy)


class CheckInputs(NamedTuple):
    """What the ranking and boundary checks (eq. 17-18) read besides Phase 2's log-masses:
    Phase 1's ``l_int8``, the tightened ``delta_b`` and ``promoted`` (``[Hq, n]``), the
    ``quantized [n]`` blocks and ``r``. A backend may run them in Phase 2's epilogue."""

    l_int8: torch.Tensor
    delta_b: torch.Tensor
    promoted: torch.Tensor
    quantized: torch.Tensor
    r: int


def without_blocks(scored: Scored, dropped: torch.Tensor) -> Scored:
    """``scored`` with the ``dropped [n]`` blocks left out of attention: logits, log-masses
    and log-spreads ``-inf``, ``Delta_b`` 0 (naive eviction, :mod:`certkv.certify.dropped`)."""
    neg_inf = torch.tensor(float("-inf"), device=scored.scores.device)
    gone = dropped.view(1, 1, -1)
    spread = scored.log_spread
    return Scored(scores=torch.where(gone.unsqueeze(-1), neg_inf, scored.scores),
                  log_mass=torch.where(gone, neg_inf, scored.log_mass),
                  delta_b=torch.where(gone, 0.0, scored.delta_b),
                  log_spread=None if spread is None else torch.where(gone, neg_inf, spread),
                  state=None)  # Phase 2 recomputes it from the scores


@dataclass
class Attended:
    """Phase-2 result: ``out [Hkv, G, d]``; block masses ``rho``, log-masses and spreads
    ``spread = ||p_b||_2`` (the l2 norm of the block's normalised token weights, for the
    spectral value bound and the block TV bound) ``[Hkv, G, n]``; ``canary [Hkv, G, n]`` marks
    gated blocks whose FP16 logits left ``Delta_b`` (Section 6)."""

    out: torch.Tensor
    rho: torch.Tensor
    log_mass: torch.Tensor
    canary: torch.Tensor | None = None
    spread: torch.Tensor | None = None
    ranking: torch.Tensor | None = None  # [Hq] eq. 17, where Phase 2 checked it
    boundary: torch.Tensor | None = None  # [Hq] eq. 18, likewise
    certified: object = None  # the certificate, where Phase 2's merge computed it (Triton)


def phase1(q: torch.Tensor, lay, scaling: float, scalar: torch.dtype = torch.float32) -> Scored:
    """Phase 1 on the step layout's decoded keys: logits, each block's softmax state (in
    ``scalar``: FP64 with the FP64-scalars option), hence its log-mass ``m_b + log l_b`` and
    log-spread ``m_b + log(l2_b) / 2``, and ``Delta_b``.

    Args:
        q: ``[Hkv, G, d]``; lay: the step's :class:`~certkv.kernels.layout.StepLayout`.
    """
    s = block_scores(q, lay.keys, lay.slot_bias, scaling)
    state = block_softmax(s.to(scalar))
    return Scored(scores=s, log_mass=(state.m + torch.log(state.l)).float(),
                  delta_b=block_deltas(q, lay.key_bound, scaling),
                  log_spread=(state.m + 0.5 * torch.log(state.l2)).float(), state=state)


def attend_blocks(state: BlockSoftmax, values: torch.Tensor, staged=None) -> Attended:
    """Phase 2 (Alg. 1) from each block's softmax state: the softmax-weighted sum over all
    blocks, split per block then reduced by log-sum-exp (the online-softmax state of each
    block combined exactly, as in split-KV decode; the sums over blocks run in two levels,
    :func:`chunked_sum`).

    The softmax scalars (block max ``m_b``, sums ``l_b`` and ``l2_b = sum_t w_t^2``, masses
    ``rho_b``, spreads ``||p_b||_2 = e^{m_b - m} sqrt(l2_b) / total``) are in the state's dtype
    (FP32, or FP64 with ``fp64_scalars``, paper 9.10); each weight is rescaled by ``e^{m_b -
    m}`` before its block's product, whose accumulator is FP32.

    Args:
        state: :class:`BlockSoftmax` of the logits, ``[Hkv, G, n, ...]``.
        values: ``[Hkv, n, B, d]`` FP32 (read only: it may be the store's decoded mirror).
        staged: :class:`~certkv.kernels.layout.StagedBlocks` of FP16 values (value promotion)
            that replace their blocks of ``values``, or None. Their blocks' weighted sums are
            recomputed from the staged data, the same per-block product as every other block,
            so ``values`` is never copied (at 4K, d = 128 the copy was a fifth of the step).
    """
    m_b, w, l_b, l2_b = state
    alpha = exp_weights(m_b - m_b.amax(dim=-1, keepdim=True))  # [Hkv, G, n]
    mass = alpha * l_b
    total = chunked_sum(mass, -1).unsqueeze(-1)
    scaled = (w * alpha.unsqueeze(-1)).float()  # each weight rescaled before its block's sum
    o_b = block_products(scaled, values.float())
    if staged is not None:
        kv, blk = staged.kv_heads, staged.blocks
        o_b[kv, :, blk] = torch.bmm(scaled[kv, :, blk], staged.gathered().float())
    out = chunked_sum(o_b, -2) / total.float()
    return Attended(out=out, rho=(mass / total).float(),
                    log_mass=(m_b + torch.log(l_b)).float(),
                    spread=(alpha * torch.sqrt(l2_b) / total).float())


def block_products(w: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per-block weighted value sums ``o_b [Hkv, G, n, d] = sum_t w[k, g, n, t] v[k, n, t]``
    (``w [Hkv, G, n, B]``, ``values [Hkv, n, B, d]``): one product of ``B`` terms per block, in
    any order (arith item 4 counts ``B - 1`` additions). One batched matmul over every (block,
    kv head) where ``values`` is a view of block-major ``[n, Hkv, B, d]`` memory (the CPU
    mirror's) or flattens to (kv head, block); else one per kv head, as for a ``[:, :n]`` view
    of a larger head-major buffer (a single matmul would first copy all of it). The result may
    be a permuted view."""
    hkv, n, bsz, d = values.shape
    by_block = values.transpose(0, 1)
    if n > 1 and by_block.is_contiguous():
        wb = w.permute(2, 0, 1, 3).reshape(n * hkv, -1, bsz)
        out = torch.bmm(wb, by_block.view(n * hkv, bsz, d))
        return out.view(n, hkv, -1, d).permute(1, 2, 0, 3)
    if n <= 1 or values.stride(0) == n * values.stride(1):
        return torch.einsum("kgnt,kntd->kgnd", w, values)
    per_head = [torch.bmm(w[k].transpose(0, 1), values[k]) for k in range(hkv)]  # [n, G, d]
    return torch.stack(per_head).transpose(1, 2)


def exact_attention(q: torch.Tensor, store, scaling: float | None = None) -> torch.Tensor:
    """``O_ref``: softmax attention on the store's FP16 originals computed in FP64 (the oracle of
    the certificate's contract) -> ``[Hq, d]`` FP64. Its own rounding is about 1e-12 relative."""
    k, v = store.dense_kv()
    scaling = store.head_dim**-0.5 if scaling is None else scaling
    return reference_fp64(q, k, v, scaling)


DENSE_CHUNK = 256  # tokens per chunk of the dense path's two-level sums


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float):
    """Dense attention on FP16 originals: the Dense baseline's code path and rungs 3-4 (paper 3.4).

    Args:
        q: ``[n, d]``; k, v: ``[h, N, d]`` with ``n`` a multiple of ``h`` (query head ``i`` reads
            kv head ``i // (n / h)``, GQA without copying the cache).
    Returns:
        ``[n, d]`` in ``q``'s dtype, finite for finite inputs. An FP16 ``q`` on CUDA runs SDPA
        in FP16 on the cache in place (production decode; the CUDA kernels keep logits and
        softmax in FP32, so FP16 inputs cannot overflow them); everything else runs
        :func:`prescaled_attention` (FP32, FP64 for an FP64 ``q``), which cannot overflow for
        any finite input. :func:`dense_rounding` describes the arithmetic of both.
    """
    if _fast_sdpa(q.dtype, k.dtype, q.device):
        out = F.scaled_dot_product_attention(
            q[None, :, None, :], k[None], v[None], scale=scaling,
            enable_gqa=k.shape[0] != q.shape[0])
        return out[0, :, 0, :]
    return prescaled_attention(q, k, v, scaling).to(q.dtype)


def _fast_sdpa(q_dtype: torch.dtype, cache_dtype: torch.dtype, device: torch.device) -> bool:
    """FP16 queries on an FP16 cache on CUDA run SDPA in place."""
    return device.type == "cuda" and q_dtype == cache_dtype == torch.float16


def prescaled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float):
    """Softmax attention that no finite input can overflow: ``[n, d]`` in FP32 (FP64 for an FP64
    ``q``); shapes as :func:`dense_attention`.

    Each query is divided by a power of two ``f >= |q|_inf`` (exact), so the scaled logits
    ``s / f`` stay far inside the range; the max-shifted logits are scaled back,
    ``x = (s/f - max) f <= 0`` (``-inf`` where that overflows: a weight of exactly 0 in the
    limit), and ``e^x`` lies in ``[0, 1]`` with 1 at the maximum. Sums run in two levels over
    chunks of ``DENSE_CHUNK`` tokens, so no value passes through more than
    ``DENSE_CHUNK + N / DENSE_CHUNK`` additions (:func:`dense_rounding`).
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    h, big_n, d = k.shape
    qg = q.to(dtype).reshape(h, -1, d)
    _, exponent = torch.frexp(qg.abs().amax(dim=-1, keepdim=True))  # |q| < 2^exponent
    top = 1023 if dtype == torch.float64 else 127  # largest finite power of two
    f = torch.ldexp(torch.ones_like(qg[..., :1]), exponent.clamp(0, top))
    s = ((qg / f) @ k.to(dtype).transpose(1, 2)) * scaling
    w = torch.exp((s - s.amax(dim=-1, keepdim=True)) * f)  # [h, G, N]
    chunks = -(-big_n // DENSE_CHUNK)
    pad = chunks * DENSE_CHUNK - big_n
    w = F.pad(w, (0, pad)).reshape(h, qg.shape[1], chunks, DENSE_CHUNK)
    vc = F.pad(v.to(dtype), (0, 0, 0, pad)).reshape(h, chunks, DENSE_CHUNK, d)
    num = torch.einsum("kgmc,kmcd->kgmd", w, vc).sum(dim=2)
    den = w.sum(dim=-1).sum(dim=-1, keepdim=True)
    return (num / den).reshape(q.shape[0], d)


def dense_rounding(q: torch.Tensor, cache_dtype: torch.dtype) -> tuple[Rounding, float]:
    """The dense path's rounding chain and unit roundoff for a query like ``q``
    (:mod:`certkv.certify.arith`, item 4).

    * :func:`prescaled_attention`: one exponential; a numerator term takes the product, at most
      ``DENSE_CHUNK - 1`` then ``N / DENSE_CHUNK`` additions and the division; logits take the
      prescaling, the scaling cast and product and the scaling back.
    * FP16 SDPA on CUDA (flash / memory-efficient / cuDNN kernels, or the math kernel with its
      default FP32 upcast), assumed conservatively: FP32 logits from tensor cores (truncating
      accumulation: twice the roundings), an online softmax rescaling at least every 16 tokens,
      weights rounded to FP16 before the value product, the FP32 sum in any order.
    """
    if _fast_sdpa(q.dtype, cache_dtype, q.device):
        return Rounding(exps=3, exps_per_token=1 / 16, depth=8, depth_per_token=2, dot_scale=2,
                        weight_u=2.0**-11, weight_abs=2.0**-25), U32
    u = 2.0**-53 if q.dtype == torch.float64 else U32
    product_u = 0.0 if q.dtype == torch.float64 else matmul_input_rounding()
    return Rounding(exps=1, depth=DENSE_CHUNK + 6, depth_per_token=1 / DENSE_CHUNK,
                    logit_roundings=5, product_u=product_u), u


@dataclass
class TorchBackend(Backend):
    """Reference backend: every phase in PyTorch on decoded FP32 blocks (CPU or CUDA)."""

    fp64_scalars: bool = False
    name: str = "torch"

    @property
    def scalar(self) -> torch.dtype:
        """The softmax scalars' dtype (paper 9.10)."""
        return torch.float64 if self.fp64_scalars else torch.float32

    def in_place(self, store) -> str:
        """Which FP16 originals Phase 2 reads from Tier-2 itself rather than from staged
        blocks: ``"k"`` (keys: their logits come from one product with the originals)."""
        return "k"

    def decoded_mirror(self, device: torch.device) -> bool | str:
        """What a store this backend attends should keep decoded (:class:`TieredKVStore`'s
        ``decoded_mirror``): on a CPU the whole mirror (the reference's products read decoded
        keys and values and the FP32 originals every step), nothing elsewhere."""
        return device.type == "cpu"

    def phase1(self, q, lay, scaling) -> Scored:
        return phase1(q, lay, scaling, self.scalar)

    def phase2(self, q, scored, lay, gate, staged, scaling, eps_guard,
               checks: CheckInputs | None = None) -> Attended:
        """Phase 2 over decoded values. Where blocks are gated to FP16 keys (``staged`` keys not
        None), the FP16-key logits of every block come from one product with the original
        keys (read in place: the CPU mirror keeps them in FP32) and replace Phase 1's where
        ``gate`` is set; the blocks' softmax state is then recomputed, else Phase 1's is
        reused. Staged FP16 values (value promotion) replace their blocks' products. The
        checks are left to :meth:`checks` (``checks`` is not read: the reference times them
        as a phase of their own)."""
        scalar, s8 = self.scalar, scored.scores
        keys, values = staged
        violated = torch.zeros_like(gate)
        if keys is None:
            state = scored.state
            if state is None or state.w.dtype != scalar:
                state = block_softmax(s8.to(scalar))
        else:
            s16 = block_scores(q, lay.original_keys, lay.slot_bias, scaling)
            violated = gate & canary_violations(s8, s16, scored.delta_b, eps_guard)
            state = block_softmax(torch.where(gate.unsqueeze(-1), s16, s8).to(scalar))
        att = attend_blocks(state, lay.values, staged=values)
        att.canary = violated
        return att

    def checks(self, l_int8, l_fp16, delta_b, promoted, quantized, r):
        """Ranking (eq. 17) and boundary (eq. 18) flags ``[Hq]``."""
        return rank_checks(l_int8, l_fp16, delta_b, promoted, quantized, r)

    def dense(self, q, k, v, scaling):
        return dense_attention(q, k, v, scaling)

    def rounding(self, lay) -> Rounding:
        """Rounding chain of :func:`attend_blocks` (arith item 4): a weight takes ``exp(s -
        m_b)`` and ``exp(m_b - m)`` (each ``exp2`` of a ``log2 e``-scaled argument); a numerator
        term the rescaling product, the value product, ``B - 1`` additions in its block,
        ``SUM_CHUNK + n / SUM_CHUNK`` additions over blocks and the division (and, with FP64
        scalars, at most three casts to FP32). Logits and the per-block value sums are matmuls
        (any order over ``d``, and over a block's ``B`` tokens)."""
        return Rounding(exps=2, depth=lay.store.block_size + SUM_CHUNK + 6,
                        depth_per_block=1 / SUM_CHUNK, product_u=matmul_input_rounding())
