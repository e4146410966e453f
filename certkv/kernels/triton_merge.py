"""Phase 2's merge in Triton: the split states merged by log-sum-exp, the block masses,
log-masses and spreads, and in its epilogue the ranking and boundary checks (eq. 17-18,
:mod:`~certkv.kernels.triton_checks`) and the certificate (:mod:`~certkv.kernels.
triton_certify`), for one sequence or a batch in one launch.

A batch's tensors have a leading sequence axis (``W`` block columns, ``P`` splits: the most of
any sequence); what each sequence's store holds for its certificate (its annotations, bounds,
step scalars and weights: :class:`SequenceFields`) is read through its record
(:mod:`~certkv.kernels.records`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from certkv.certify.segment import CertifyInputs
from certkv.kernels.records import integer, pointer, records
from certkv.kernels.reference import Attended, CheckInputs
from certkv.kernels.triton_certify import Certified, CertifyRequest, certify_head
from certkv.kernels.triton_checks import check_head
from certkv.kernels.triton_score import log_or_minus_inf

SPLIT_TILE = 64  # splits merged per tile (the rounding chain's chunks of 64 splits)


def block_tile(width: int, most: int) -> int:
    """A tile over ``width`` block columns (a power of two, at least 8, at most ``most``): a
    sequence's sums over its blocks then round alike alone and in a batch's wider tile, whose
    extra lanes are zeros (NumPy, which runs the interpreter's sums, adds pairwise from 8
    terms on, and the pairs of the real terms are the same in any wider power of two; a GPU's
    reduction tree over a tile depends on its size: there the batch's sums may round
    differently, within the bound's rounding chain)."""
    return max(8, min(most, triton.next_power_of_2(max(width, 1))))


class SequenceFields(NamedTuple):
    """What one sequence's store holds for its certificate (read in place through the
    sequence's record, :mod:`~certkv.kernels.records`), with its step's scalars and weights."""

    eta: torch.Tensor  # FP32 [Hkv, n] (row stride shared by value_spec and key_spec)
    value_spec: torch.Tensor
    key_spec: torch.Tensor
    key_abs_max: torch.Tensor  # [Hkv, d]
    eta_max_kv: torch.Tensor  # [Hkv]
    v_max_kv: torch.Tensor  # [Hkv]
    par: torch.Tensor  # FP64 (scalars)
    weights: torch.Tensor
    kv_bad: torch.Tensor  # 0-d bool


class CertifyBatch(NamedTuple):
    """:class:`CertifyRequest` over a batch: ``x`` with a leading sequence axis on every
    tensor the step makes (its store's fields are not read), ``stores`` one
    :class:`SequenceFields` per sequence."""

    x: CertifyInputs
    stores: list[SequenceFields]
    certified: bool
    canary: bool
    least: float
    wanted: int


STEP_FIELDS = ("l8", "delta_b", "promoted", "log_p", "delta_chan", "exact", "canary_blocks",
               "value_kv", "delta", "v_max", "v_rad", "q_norm", "q", "expanded")


def sequence_fields(x: CertifyInputs, par: torch.Tensor, weights: torch.Tensor
                    ) -> SequenceFields:
    """A sequence's :class:`SequenceFields` from its certificate inputs."""
    return SequenceFields(x.eta, x.value_spec, x.key_spec, x.key_abs_max, x.eta_max_kv,
                          x.v_max_kv, par, weights, x.kv_bad)


def as_batch(req: CertifyRequest, quantized=None) -> CertifyBatch:
    """One sequence's request as a batch of one's."""
    x = req.x._replace(**{name: getattr(req.x, name)[None] for name in STEP_FIELDS
                          if getattr(req.x, name) is not None})
    return CertifyBatch(x, [sequence_fields(req.x, req.par, req.weights)], req.certified,
                        req.canary, req.least, req.wanted)


def certify_args(req: CertifyBatch | None, nseq: int, hq: int, dev: torch.device,
                 quantized: list) -> tuple[tuple, list[tuple], Certified | None]:
    """The merge kernel's certificate arguments (after ``bound_ptr``: the step's tensors,
    contiguous ``[S, ...]``), each sequence's record fields after its counts (``quantized``,
    then its :class:`SequenceFields`) and the :class:`Certified` it will write (``[S, ...]``,
    ``kv_bad`` one per sequence); without ``req``, valid pointers never read and None."""
    if req is None:
        flag = torch.empty(nseq, 1, dtype=torch.bool, device=dev)
        out = torch.empty(nseq, 1, device=dev)
        stores = [(q, None, None, None, 0, None, None, None, None, None) for q in quantized]
        return (out, out, flag, flag, flag, out, out, out, out, out, flag, out, out, out,
                flag), stores, None
    x = req.x
    step = tuple(getattr(x, name) if name in ("v_max", "v_rad")  # views of [S, 2, Hq] radii
                 else getattr(x, name).contiguous() for name in STEP_FIELDS[3:])
    res = torch.empty(nseq, 7, hq, device=dev)
    resi = torch.empty(nseq, 2, hq, dtype=torch.int64, device=dev)
    pre = torch.empty(nseq, 2, hq, dtype=torch.int32, device=dev)
    canary = torch.empty(nseq, hq, dtype=torch.bool, device=dev)
    stores = []
    for q, f in zip(quantized, req.stores, strict=True):
        lay = (f.eta, f.value_spec, f.key_spec)
        assert all(t.stride() == f.eta.stride() and t.stride(1) == 1 for t in lay)
        stores.append((q, *lay, f.eta.stride(0), f.key_abs_max.contiguous(),
                       f.eta_max_kv.contiguous(), f.v_max_kv.contiguous(), f.par, f.weights))
    args = (*step, res, resi, pre, canary)
    done = Certified(res, resi, pre, canary, [f.kv_bad for f in req.stores], req.certified,
                     req.least)
    return args, stores, done


@triton.jit
def _reduce_kernel(mb_ptr, lb_ptr, sb_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, rho_ptr, lm_ptr,
                   sp_ptr, l8_ptr, dt_ptr, prom_ptr, rank_ptr, bound_ptr, logp_ptr, dch_ptr,
                   exact_ptr, canb_ptr, vkv_ptr, delta_ptr, vmax_ptr, vrad_ptr, qnorm_ptr,
                   q_ptr, expanded_ptr, res_ptr, resi_ptr, pre_ptr, canary_ptr, seq_ptr,
                   width, programs, KINDS: tl.constexpr, D: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr,
                   CHECKS: tl.constexpr, CERTIFY: tl.constexpr, G: tl.constexpr,
                   CERTIFIED: tl.constexpr, CANARY: tl.constexpr, WANTED: tl.constexpr):
    """Grid ``(query head, sequence)``: each program merges its head's splits and writes its
    block masses, log-masses and spreads; with ``CHECKS``, then the ranking and boundary
    checks over those log-masses (:func:`~certkv.kernels.triton_checks.check_head`); with
    ``CERTIFY``, then the head's certificate (:func:`~certkv.kernels.triton_certify.
    certify_head`). The step's tensors are contiguous with a leading sequence axis (``width``
    block columns, ``programs`` splits: :func:`reduce_batch`); sequence ``s``'s record
    (:mod:`~certkv.kernels.records`) holds its block and split counts and what its store
    holds (:class:`~certkv.kernels.triton_certify.SequenceFields`)."""
    h = tl.program_id(0)
    seq = tl.program_id(1)
    hq = tl.num_programs(0)
    rec = seq_ptr + seq * len(KINDS)
    n_blocks = integer(rec, 0)
    n_splits = integer(rec, 1)
    on_blocks = seq * hq * width  # [Hq, W] per sequence
    on_heads = seq * hq
    on_pairs = 2 * on_heads  # [2, Hq]
    m_ptr += seq * hq * programs
    l_ptr += seq * hq * programs
    acc_ptr += seq * hq * programs * D
    c = tl.arange(0, D)
    top = float("-inf")
    for start in range(0, n_splits, BLOCK_S):
        sp = start + tl.arange(0, BLOCK_S)
        mv = tl.load(m_ptr + h * programs + sp, mask=sp < n_splits, other=float("-inf"))
        top = tl.maximum(top, tl.max(mv, axis=0))
    total = 0.0
    out = tl.zeros((D,), tl.float32)
    for start in range(0, n_splits, BLOCK_S):
        sp = start + tl.arange(0, BLOCK_S)
        live = sp < n_splits
        mv = tl.load(m_ptr + h * programs + sp, mask=live, other=float("-inf"))
        weight = tl.where(live, tl.exp(mv - top), 0.0)
        total += tl.sum(weight * tl.load(l_ptr + h * programs + sp, mask=live, other=0.0),
                        axis=0)
        acc = tl.load(acc_ptr + h * programs * D + sp[:, None] * D + c[None, :],
                      mask=live[:, None], other=0.0)
        out += tl.sum(weight[:, None] * acc, axis=0)
    out = out / total
    tl.store(out_ptr + (on_heads + h) * D + c, out)
    for start in range(0, n_blocks, BLOCK_N):
        b = start + tl.arange(0, BLOCK_N)
        live = b < n_blocks
        at = on_blocks + h * width + b
        mb = tl.load(mb_ptr + at, mask=live, other=float("-inf"))
        lb = tl.load(lb_ptr + at, mask=live, other=1.0)
        sb = tl.load(sb_ptr + at, mask=live, other=1.0)
        scale = tl.exp(mb - top)
        tl.store(rho_ptr + at, scale * lb / total, mask=live)
        tl.store(sp_ptr + at, scale * tl.sqrt_rn(sb) / total, mask=live)
        tl.store(lm_ptr + at, mb + log_or_minus_inf(lb), mask=live)
    ranking = True
    boundary = True
    if CHECKS or CERTIFY:  # the epilogues read back what this program just wrote
        tl.debug_barrier()
    if CHECKS:
        ranking, boundary = check_head(l8_ptr + on_blocks, lm_ptr + on_blocks,
                                       dt_ptr + on_blocks, prom_ptr + on_blocks,
                                       pointer(rec, 2, KINDS[2]), rank_ptr + on_pairs,
                                       bound_ptr + on_pairs, h, n_blocks, width, R, BLOCK_N)
        if (WANTED & 1) == 0:  # a check the ladder leaves off passes
            ranking = True
        if (WANTED & 2) == 0:
            boundary = True
    if CERTIFY:
        certify_head(h, n_blocks, width, l8_ptr + on_blocks, lm_ptr + on_blocks,
                     rho_ptr + on_blocks, sp_ptr + on_blocks, logp_ptr + on_blocks,
                     dt_ptr + on_blocks, dch_ptr + on_blocks, prom_ptr + on_blocks,
                     exact_ptr + seq * width, canb_ptr + on_blocks,
                     vkv_ptr + seq * (hq // G) * width, width, pointer(rec, 3, KINDS[3]),
                     pointer(rec, 4, KINDS[4]), pointer(rec, 5, KINDS[5]), integer(rec, 6),
                     delta_ptr + on_heads, vmax_ptr + on_pairs, vrad_ptr + on_pairs,
                     qnorm_ptr + on_heads, q_ptr + on_heads * D, pointer(rec, 7, KINDS[7]),
                     pointer(rec, 8, KINDS[8]), pointer(rec, 9, KINDS[9]),
                     pointer(rec, 10, KINDS[10]), pointer(rec, 11, KINDS[11]), out, ranking,
                     boundary, expanded_ptr + on_heads, res_ptr + 7 * on_heads,
                     resi_ptr + on_pairs, pre_ptr + on_pairs, canary_ptr + on_heads, G, D,
                     BLOCK_N, CERTIFIED, CANARY)


def reduce_splits(m_b, l_b, m, lsum, acc, l2_b=None, checks: CheckInputs | None = None,
                  certify: CertifyRequest | None = None) -> Attended:
    """Merge per-split online-softmax states by log-sum-exp (one kernel); block masses
    ``rho_b = e^{m_b - top} l_b / total``, log-masses ``m_b + log l_b`` and spreads
    ``||p_b||_2 = e^{m_b - top} sqrt(l2_b) / total``; given ``checks``, the ranking and
    boundary flags (eq. 17-18) in the same launch; given ``certify``, the certificate too
    (``Attended.certified``, :mod:`~certkv.kernels.triton_certify`; its ``canary_blocks``
    Phase 2's, already written).

    Shapes: ``m_b, l_b, l2_b [Hkv, G, n]`` (``l2_b`` None: spreads of one-token blocks);
    ``m, lsum [Hkv, G, S]``; ``acc [Hkv, G, S, d]``; FP32.
    """
    g, n = m_b.shape[1:]
    l2_b = l_b.square() if l2_b is None else l2_b
    quantized = checks.quantized if checks is not None else None
    states = tuple(x[None] for x in (m_b, l_b, l2_b, m, lsum, acc))
    merged = reduce_batch(states, [n], [m.shape[2]], batch_checks(checks),
                          None if certify is None else as_batch(certify, quantized))
    return merged.sequence(0, [n], g)


class Merged(NamedTuple):
    """What :func:`reduce_batch` wrote, with a leading sequence axis (``W`` block columns)."""

    out: torch.Tensor  # [S, Hq, d]
    rho: torch.Tensor  # [S, Hq, W], and log_mass, spread
    log_mass: torch.Tensor
    spread: torch.Tensor
    flags: torch.Tensor | None  # bool [S, 2, Hq] (ranking, boundary) where checked
    certified: Certified | None  # res [S, 7, Hq], ...

    def sequence(self, s: int, widths: list[int], groups: int | None = None) -> Attended:
        """Sequence ``s``'s :class:`Attended` (views; ``[Hkv, G, ...]`` given ``groups``)."""
        n = widths[s]
        hq, d = self.out.shape[1:]
        g = groups or hq
        shape = (hq // g, g)
        certified = None
        if self.certified is not None:
            c = self.certified
            certified = c._replace(res=c.res[s], resi=c.resi[s], pre=c.pre[s],
                                   canary=c.canary[s], kv_bad=c.kv_bad[s])
        return Attended(out=self.out[s].reshape(*shape, d),
                        rho=self.rho[s, :, :n].reshape(*shape, n),
                        log_mass=self.log_mass[s, :, :n].reshape(*shape, n),
                        spread=self.spread[s, :, :n].reshape(*shape, n),
                        ranking=None if self.flags is None else self.flags[s, 0],
                        boundary=None if self.flags is None else self.flags[s, 1],
                        certified=certified)


def reduce_batch(states: tuple, widths: list[int], splits: list[int],
                 checks: CheckInputs | None = None, certify: CertifyBatch | None = None
                 ) -> Merged:
    """:func:`reduce_splits` over a batch in one launch: ``states`` the block and split states
    ``m_b, l_b, l2_b [S, Hkv, G, W]``, ``m, lsum [S, Hkv, G, P]``, ``acc [S, Hkv, G, P, d]``
    (contiguous), sequence ``s`` with
    ``widths[s]`` blocks and ``splits[s]`` splits; ``checks`` with a leading sequence axis on
    every tensor but ``quantized`` (one per sequence, a list); ``certify`` a
    :class:`~certkv.kernels.triton_certify.CertifyBatch`."""
    m_b, l_b, l2_b, m, lsum, acc = states
    nseq, hkv, g, width = m_b.shape
    programs, d = acc.shape[3], acc.shape[4]
    hq = hkv * g
    dev = m.device
    for x in (m_b, l_b, l2_b, m, lsum, acc):
        assert x.is_contiguous()
    out = torch.empty(nseq, hq, d, device=dev)
    rho, log_mass, spread = (torch.empty(nseq, hq, width, device=dev) for _ in range(3))
    flags = torch.empty(nseq, 2, hq, dtype=torch.bool, device=dev)
    inputs, r, quantized = _check_args(checks, certify, m_b, flags)
    step, stores, done = certify_args(certify, nseq, hq, dev, quantized)
    rows = [(n, p, *fields) for n, p, fields in zip(widths, splits, stores, strict=True)]
    rec = records(rows, dev)
    _reduce_kernel[(hq, nseq)](m_b, l_b, l2_b, m, lsum, acc, out, rho, log_mass, spread,
                               *inputs, flags[:, 0], flags[:, 1], *step, rec.table, width,
                               programs, KINDS=rec.kinds, D=d,
                               BLOCK_S=SPLIT_TILE, BLOCK_N=block_tile(width, 1024), R=r,
                               CHECKS=checks is not None, CERTIFY=certify is not None, G=g,
                               CERTIFIED=bool(certify and certify.certified),
                               CANARY=bool(certify and certify.canary),
                               WANTED=certify.wanted if certify else 3)
    return Merged(out, rho, log_mass, spread, None if checks is None else flags, done)


def batch_checks(checks: CheckInputs | None) -> CheckInputs | None:
    """One sequence's checks as a batch of one's (``quantized`` a list of one)."""
    if checks is None:
        return None
    return CheckInputs(checks.l_int8[None], checks.delta_b[None], checks.promoted[None],
                       [checks.quantized], checks.r)


def _check_args(checks: CheckInputs | None, certify: CertifyBatch | None, m_b, flags):
    """The merge's ``l8, delta_b, promoted [S, Hq, W]`` and ``r``, and each sequence's
    ``quantized [n]``: the checks', else the certificate's (it reads the first three), else
    valid pointers the kernel never reads."""
    nseq = m_b.shape[0]
    if checks is not None:
        inputs, r = (checks.l_int8.float(), checks.delta_b.float(), checks.promoted), checks.r
        quantized = checks.quantized
    elif certify is not None:
        x = certify.x
        inputs, r, quantized = (x.l8, x.delta_b, x.promoted), 1, [None] * nseq
    else:
        return (m_b, m_b, flags), 1, [None] * nseq
    inputs = tuple(x.contiguous() for x in inputs)  # the masks are read as bool
    assert all(x.numel() == m_b.numel() for x in inputs)
    return inputs, r, quantized
