"""Auditing the contract at run time: each head's error against FP64 attention on the originals.

The certificate's contract (paper 4.6): ``||out - O_ref||_2 <= bound`` for every returned head,
``O_ref`` attention in exact arithmetic on the FP16 originals. An audit computes ``O_ref`` in
FP64 (its own rounding bounded by :func:`reference_slack`) and counts heads whose error exceeds
their bound plus that slack: a violation. With every precondition met there are none (the
property tests prove it); under storage faults without the integrity check there can be (what
``experiment=faults_pg19_4k`` counts). Costs one FP64 attention pass per layer step: a
measurement tool, off by default (``audit=true``).
"""

from __future__ import annotations

import torch


def reference_fp64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scaling: float) -> torch.Tensor:
    """``O_ref [Hq, d]`` in FP64 from ``q [Hq, d]`` and the originals ``k, v [Hkv, N, d]``."""
    group = q.shape[0] // k.shape[0]
    k64 = k.double().repeat_interleave(group, 0)
    v64 = v.double().repeat_interleave(group, 0)
    w = torch.softmax(torch.einsum("hd,hnd->hn", q.to(k.device).double(), k64) * scaling, dim=-1)
    return torch.einsum("hn,hnd->hd", w, v64)


def reference_slack(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scaling: float) -> torch.Tensor:
    """The FP64 reference's own rounding ``[Hq]`` (the audit's only allowance).

    Higham-style, in FP64 (``u = 2^-53``): logits within ``gamma_{d+2} S`` of exact (``S`` the
    logit magnitude), so TV within ``tanh`` of half that; softmax normalisation and the weighted
    sum over ``N`` tokens within ``gamma_{N+8}`` relative; times ``V_max``. About 1e-12 of
    ``V_max`` at model sizes.
    """
    group = q.shape[0] // k.shape[0]
    n, d = k.shape[1], k.shape[2]
    kmax = k.double().abs().amax(dim=1).repeat_interleave(group, 0)
    magnitude = scaling * (q.to(k.device).double().abs() * kmax).sum(dim=-1)
    v_max = v.double().norm(dim=-1).amax(dim=-1).repeat_interleave(group)
    u = 2.0**-53
    return v_max * ((d + 2) * u * magnitude + 3 * (n + 8) * u) * 1.01 + 1e-300


def violations(out: torch.Tensor, bound: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(violated, error)``: bool ``[Hq]``, the head's error against ``O_ref`` exceeds its
    ``bound`` (plus the reference's own rounding), and FP64 ``[Hq]`` that error
    ``||out - O_ref||_2``; ``out [Hq, d]`` as returned."""
    err = (out.to(k.device).double() - reference_fp64(q, k, v, scaling)).norm(dim=-1)
    return err > bound.to(k.device).double() + reference_slack(q, k, v, scaling), err
