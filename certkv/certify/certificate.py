"""The per-step, per-head certificate (paper 4.6 contract; telemetry of Tables 11, 12, 15)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from certkv.errors import NonFiniteError

RUNG_NAMES = {0: "fast path", 1: "K* expanded", 2: "values promoted", 3: "head dense",
              4: "layer dense"}


@dataclass
class BlockStats:
    """Per-block signals of one step for quantizers that adapt to attention (SmartKV), read
    from what the step computed anyway; columns: the store's blocks, then the exact tail block
    if any (and the empty blocks of a padded layout). ``eta`` and ``quantized`` are views of
    the store's buffers, whose columns after the completed blocks the next completion writes:
    read them before it, or keep :meth:`Certificate.copy`.

    Attributes:
        mass: ``rho_b [Hq, n]``, the step's attention mass of block ``b`` (Phase 2's).
        eta: ``eta_b [Hkv, n]``; delta: ``Delta_b [Hq, n]``; radius: ``R = min(V_max,
            centred radius) [Hq]``; quantized: ``[n]``, the lossy blocks.
    """

    mass: torch.Tensor
    eta: torch.Tensor
    delta: torch.Tensor
    radius: torch.Tensor
    quantized: torch.Tensor

    @property
    def error(self) -> torch.Tensor:
        """``[Hq, n]``: the block's share of the quantized path's bound, ``rho_b (eta_b + 2 R
        tanh(Delta_b / 2))``: its value error (Cor. 4.2's term) plus its key error's
        first-order share of eq. 15; 0 on exact blocks. Computed only when asked."""
        eta = self.eta.repeat_interleave(self.mass.shape[0] // self.eta.shape[0], dim=0)
        share = eta + 2 * self.radius[:, None] * torch.tanh(self.delta / 2)
        return self.mass * share * self.quantized


_AVERAGED = ("candidate_e_key", "candidate_e_val", "e_key", "e_val", "e_arith", "bound",
             "delta", "tail_mass", "paper_e_key", "paper_e_val")
"""Per-head terms a step summary reports as a mean and a maximum."""

_SUMMED = ("value_promotions", "corrected_words", "erased_words", "corrupted_blocks",
           "violations", "paged_evicted", "targeted", "mended")
"""Per-step counts that add up over layers."""


@dataclass
class Certificate:
    """What one decode step of one layer returned, per query head (every tensor is ``[Hq]``).

    For every head ``||out - O_ref||_2 <= bound = e_key + e_val + e_arith``, ``O_ref`` being
    attention in exact arithmetic on the FP16 originals. On rungs 0-2 ``e_key`` and ``e_val``
    are the tight terms (eq. 15 and Cor. 4.2 sharpened: per-block TV with centred values, and
    ``min(rho_b eta_b, s_b ||p_b||_2)`` per block, :mod:`certkv.certify.bounds`) and ``e_arith``
    what floating point adds (:mod:`certkv.certify.arith`); on rungs 3-4 the output is dense
    attention on the FP16 originals, ``e_key = e_val = 0`` and ``e_arith`` bounds the dense
    path's own rounding. ``candidate_*`` are the terms before the ladder; ``paper_e_key`` and
    ``paper_e_val`` the paper's own forms of the candidate terms (eq. 15 capped at ``2 V_max``,
    Cor. 4.2), reported for comparison only (zeros where not computed).
    """

    candidate_e_key: torch.Tensor
    candidate_e_val: torch.Tensor
    e_key: torch.Tensor
    e_val: torch.Tensor
    e_arith: torch.Tensor  # floating point's share of the bound (all rungs)
    delta: torch.Tensor  # Delta_h: max per-block score perturbation over quantized blocks (eq. 8)
    tail_mass: torch.Tensor  # achieved INT8-estimated tail mass alpha_hat_T (eq. 15)
    k_star: torch.Tensor  # quantized blocks read with FP16 keys
    rung: torch.Tensor  # 0 fast path, 1 K* expanded, 2 values promoted, 3 head dense, 4 layer dense
    ranking_ok: torch.Tensor  # eq. 17 (True where not checked)
    boundary_ok: torch.Tensor  # eq. 18 (True where not checked)
    canary_ok: torch.Tensor  # Section 6 score consistency (True where not checked)
    value_blocks: torch.Tensor  # blocks of the head's KV group read with FP16 values
    value_promotions: int | torch.Tensor  # (kv head, block) pairs paged in with FP16 values
    # this step (a 0-d device tensor from a step that never reads the host, as paged_evicted)
    num_blocks: int  # quantized blocks in the store
    mode: str = "certified"
    paper_e_key: torch.Tensor | None = None  # eq. 15 as in the paper (telemetry)
    paper_e_val: torch.Tensor | None = None  # Cor. 4.2 as in the paper (telemetry)
    # why a head escalated past its policy: the ladder's bound tolerance (0 not escalated,
    # 1 widest key set, 2 also FP16 values, 3 dense: its bound stayed above the tolerance)
    tol_level: torch.Tensor | None = None
    blocks: BlockStats | None = None  # per-block signals (not per head; left out of records)
    # what reading a protected Tier-1 found this step (:mod:`certkv.quant.protect`): code words
    # corrected, words erased (detected, not fixable), blocks that failed the integrity check
    # and were read from their FP16 originals instead
    corrected_words: int = 0
    erased_words: int = 0
    corrupted_blocks: int = 0
    # False when faults can flip stored bits that no integrity check covers (``protect`` with
    # faults and ``integrity=false``): the bounds of heads on rungs 0-2 then assume Tier-1 reads
    # back as written and certify nothing (dense heads read the FP16 originals and still hold)
    faults_covered: bool = True
    # with ``audit`` (:mod:`certkv.certify.audit`): heads whose error against FP64 attention on
    # the originals exceeded their bound (0 whenever the certificate's preconditions hold)
    violations: int = 0
    audited: bool = False
    error: torch.Tensor | None = None  # audited: ||out - O_ref||_2 per head (FP64 reference)
    # eviction (:mod:`certkv.evict`): (kv head, block) pairs of evicted blocks this step read
    # from Tier-2 (FP16 keys or values), i.e. paged back in for the certificate
    paged_evicted: int = 0
    # targeted page-in (``ladder.page_in_budget``, :mod:`certkv.certify.targeted`): new (kv
    # head, block) pairs this step read whole (FP16 keys, and values where lossy) to mend a
    # failed boundary check (eq. 18), and the heads it mended (their check held after it)
    targeted: int = 0
    mended: int = 0
    # the sequence's index in its batch (:meth:`certkv.attention.CertifiedAttention.batch`; 0
    # for a step of one sequence; a cache's log numbers a batch's sequences as they entered it;
    # -1 for a certificate joined over several sequences, :meth:`cat`)
    sequence: int = 0

    def __post_init__(self) -> None:
        for name in ("paper_e_key", "paper_e_val"):
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros_like(self.e_key))
        if self.tol_level is None:
            self.tol_level = torch.zeros_like(self.rung)

    @property
    def bound(self) -> torch.Tensor:
        """Returned bound ``e_key + e_val + e_arith`` per head (``e_arith`` on dense heads)."""
        return self.e_key + self.e_val + self.e_arith

    @property
    def num_heads(self) -> int:
        return int(self.rung.numel())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of this certificate: the per-head fields', then the block
        statistics' (what :meth:`mapped` with ``blocks`` maps)."""
        found = [x for x in (getattr(self, f.name) for f in fields(self))
                 if isinstance(x, torch.Tensor)]
        if self.blocks is not None:
            found += [getattr(self.blocks, f.name) for f in fields(BlockStats)]
        return found

    def mapped(self, fn, blocks: bool = False) -> Certificate:
        """A copy with ``fn`` applied to every per-head tensor field and, with ``blocks``, to
        the block statistics' tensors (else they are shared)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        copied = Certificate(**{name: fn(value) if isinstance(value, torch.Tensor) else value
                                for name, value in values.items()})
        if blocks and self.blocks is not None:
            copied.blocks = BlockStats(*(fn(getattr(self.blocks, f.name))
                                         for f in fields(BlockStats)))
        return copied

    def copy(self) -> Certificate:
        """A copy whose tensors (the block statistics' included) are new."""
        return self.mapped(torch.clone, blocks=True)

    def to(self, device: str | torch.device) -> Certificate:
        """A copy with every per-head tensor on ``device``."""
        return self.mapped(lambda t: t.to(device))

    @classmethod
    def cat(cls, certs: list[Certificate]) -> Certificate:
        """One certificate over the heads of several layers (for step-level summaries), on the
        host. The per-head tensors are joined on their device and copied in one transfer (one
        host read per decode step for the whole log, not one per layer and field)."""
        merged = {}
        names = [f.name for f in fields(cls) if f.name not in _SUMMED
                 and isinstance(getattr(certs[0], f.name), torch.Tensor)]
        device = getattr(certs[0], names[0]).device
        moved = any(c.e_key.device != device for c in certs)  # a step's layers: one device
        joined = [torch.cat([getattr(c, name).to(device) if moved else getattr(c, name)
                             for c in certs]) for name in names]
        # counts: ints, summed here, or 0-d device tensors from steps that never read the host
        counts = {name: [getattr(c, name) for c in certs] for name in _SUMMED}
        on_device = [name for name, values in counts.items()
                     if any(isinstance(x, torch.Tensor) for x in values)]
        joined += [torch.stack([torch.as_tensor(x, device=device).reshape(())
                                for x in counts[name]]) for name in on_device]
        if device.type == "cpu":  # on the host already: nothing to transfer
            parts = joined
        else:  # one transfer, exact for every field
            packed = torch.cat([t.double() for t in joined]).to("cpu")
            parts = [part.to(t.dtype) for t, part in
                     zip(joined, packed.split([t.numel() for t in joined]), strict=True)]
        for name, part in zip([*names, *on_device], parts, strict=True):
            merged[name] = int(part.sum()) if name in _SUMMED else part
        for name in _SUMMED:
            if name not in on_device:
                merged[name] = int(sum(counts[name]))
        for f in fields(cls):
            name = f.name
            if name in merged:
                continue
            if name == "num_blocks":
                merged[name] = max(c.num_blocks for c in certs)
            elif name == "blocks":
                merged[name] = None  # per layer only
            elif name == "faults_covered":
                merged[name] = all(c.faults_covered for c in certs)
            elif name == "sequence":  # one sequence's layers, or a batch's sequences
                sequences = {c.sequence for c in certs}
                merged[name] = certs[0].sequence if len(sequences) == 1 else -1
            else:  # the first certificate's (the mode, the audit's flag)
                merged[name] = getattr(certs[0], name)
        return cls(**merged)

    def head_records(self) -> list[dict[str, float | int | bool]]:
        """One plain dict per head (for full per-head telemetry), with its ``sequence`` where
        the certificate is one sequence's."""
        names = [f.name for f in fields(self) if f.name not in _SUMMED
                 and isinstance(getattr(self, f.name), torch.Tensor)]
        columns = {n: getattr(self, n).tolist() for n in names}
        which = {"sequence": self.sequence} if self.sequence >= 0 else {}
        return [{"head": h, **which, **{n: columns[n][h] for n in names}}
                for h in range(self.num_heads)]

    def summary(self) -> dict[str, float | int | str]:
        """Plain-number summary of the step (means and maxima over heads, rung counts)."""
        out: dict[str, float | int | str] = {"mode": self.mode, "heads": self.num_heads,
                                             "num_blocks": self.num_blocks}
        # every statistic in a few operators (a run summarises every decode step)
        terms = torch.stack([getattr(self, name).double() for name in _AVERAGED])
        means, maxima = terms.mean(dim=1).tolist(), terms.amax(dim=1).tolist()
        for name, mean, top in zip(_AVERAGED, means, maxima, strict=True):
            out[f"{name}_mean"] = mean
            out[f"{name}_max"] = top
        out["k_star_mean"] = float(self.k_star.double().mean())
        rungs = torch.bincount(self.rung.flatten().long(), minlength=len(RUNG_NAMES)).tolist()
        for rung in RUNG_NAMES:
            out[f"rung{rung}"] = rungs[rung]
        fails = torch.stack([~self.ranking_ok, ~self.boundary_ok, ~self.canary_ok,
                             self.tol_level > 0, self.tol_level >= 3]).sum(dim=1).tolist()
        for name, count in zip(("ranking_fail", "boundary_fail", "canary_fail"), fails,
                               strict=False):
            out[name] = count
        for name in _SUMMED:  # ints, or 0-d tensors from a device step
            out[name] = int(getattr(self, name))
        out["audited"] = self.audited
        if self.error is not None:  # audit=true: the measured error beside the bound
            out["error_mean"] = float(self.error.double().mean())
            out["error_max"] = float(self.error.double().max())
        out["faults_covered"] = self.faults_covered
        out["tol_escalated"], out["tol_dense"] = fails[3:]
        return out


def _read_share(joined: Certificate, certs: list[Certificate]) -> float:
    """The share of the quantized blocks' dense bytes a step's heads read in FP16, keys and
    values, from Tier-2 or the scratch: per head of ``joined`` (``certs`` joined,
    :meth:`Certificate.cat`) its blocks read with FP16 keys (``k_star``) plus its KV group's
    blocks read with FP16 values (``value_blocks``), every block twice on rungs 3-4, against its
    own certificate's ``2 num_blocks`` (a batch's sequences hold different numbers of blocks);
    a few operators a step, whatever the layers."""
    heads = torch.tensor([c.num_heads for c in certs])
    whole = torch.repeat_interleave(torch.tensor([2 * c.num_blocks for c in certs]), heads)
    total = int(whole.sum())
    if not total:
        return 0.0
    whole = whole.to(joined.rung.device)
    read = torch.where(joined.rung >= 3, whole, joined.k_star + joined.value_blocks)
    return float(torch.minimum(read, whole).sum()) / total


def _listed(cert: Certificate | list[Certificate]) -> list[Certificate]:
    """A layer's logged certificates as a list (:meth:`CertificateLog.record`)."""
    return [cert] if isinstance(cert, Certificate) else cert


class CertificateLog:
    """Collects the certificates of every layer and decode step of a generation.

    ``keep="summary"`` stores one :meth:`Certificate.summary` per step (over all layers' heads);
    ``keep="full"`` also stores every head's record. A new step starts when layer 0 reports.
    """

    def __init__(self, keep: str = "summary") -> None:
        if keep not in ("summary", "full"):
            raise ValueError(f"records={keep!r} is unknown; use 'summary' or 'full'.")
        self.keep = keep
        self.steps: list[dict] = []
        self.heads: list[dict] = []
        self._pending: list[tuple[int, Certificate | list[Certificate]]] = []

    def copy(self) -> CertificateLog:
        """An independent log with this one's steps so far (beam search: a beam that continues
        another's sequence continues its log; the records themselves are shared, never changed)."""
        new = CertificateLog(self.keep)
        new.steps, new.heads, new._pending = list(self.steps), list(self.heads), \
            list(self._pending)
        return new

    def record(self, layer_idx: int, cert: Certificate | list[Certificate]) -> None:
        """Log ``layer_idx``'s certificate of this step, or a batch step's certificates (one per
        sequence: a layer's heads are every sequence's, joined when the step closes, so the
        batch pays one :meth:`Certificate.cat` a step, not one a layer)."""
        if layer_idx == 0 and self._pending:
            self.flush()
        self._pending.append((layer_idx, cert))

    def flush(self) -> None:
        """Close the current step."""
        if not self._pending:
            return
        step = len(self.steps)
        certs = [c for _, layer in self._pending for c in _listed(layer)]
        joined = Certificate.cat(certs)
        summary = joined.summary()
        summary["fp16_read_share"] = _read_share(joined, certs)
        if not math.isfinite(summary["bound_max"]):  # only non-finite inputs lead here
            self._pending = []
            raise NonFiniteError("a head's error bound is not finite because q, k or v held NaN "
                                 "or Inf; check the model's activations before attention.")
        self.steps.append({"step": step, "layers": len(self._pending), **summary})
        if self.keep == "full":
            for layer, cert in self._pending:
                joined = cert if isinstance(cert, Certificate) else Certificate.cat(cert)
                self.heads.extend({"step": step, "layer": layer, **r}
                                  for r in joined.head_records())
        self._pending = []

    def reset(self) -> None:
        self.steps, self.heads, self._pending = [], [], []
