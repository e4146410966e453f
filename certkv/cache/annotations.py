"""Write-time annotations of completed blocks: what the certificate reads per block and kv
head instead of the blocks themselves (:func:`block_annotations`), measured exactly in FP64 and
rounded up so that each is an upper bound."""

from __future__ import annotations

import torch

from certkv.certify.bounds import centred_radius, spectral_norm_upper
from certkv.quant import Blocks, KeyCodec, ValueCodec
from certkv.quant.base import round_up_fp32

ANNOTATIONS = ("eta", "nu", "value_spec", "key_err", "key_spec", "v_radius")
"""Per-block, per-kv-head FP32 annotations ``[Hkv, n]`` (:func:`block_annotations`)."""

ERROR_NOTES = ("eta", "value_spec", "key_err", "key_spec")
"""The annotations that state a block's reconstruction error: 0 where a block is served from its
FP16 originals (a corrupted block, :meth:`TieredKVStore.corrupted_mask`)."""

HEALTH = ("corrected", "erased", "corrupted")
"""What reading a protected block found, ``[Hkv, n]`` each: words the code corrected, words it
erased (detected, not fixable), and whether the integrity check failed (the block is served
from its FP16 originals). Telemetry, not Tier-1."""

INFLATE = 1.0 + 1e-12  # covers the FP64 rounding of the measurements (norms, eigenvalues)


def _error_norms(err: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max_t ||e_t||, ||E||_2 upper bound)`` of FP64 error blocks ``[Hkv, n, B, d]``."""
    return err.norm(dim=-1).amax(dim=-1), spectral_norm_upper(err)


def block_annotations(k16: torch.Tensor, v16: torch.Tensor, key_codec: KeyCodec,
                      value_codec: ValueCodec, key_blocks: Blocks, value_blocks: Blocks,
                      centre: torch.Tensor) -> dict[str, torch.Tensor]:
    """The write-time annotations of completed blocks (FP16 originals ``k16, v16 [Hkv, n, B,
    d]``, their codes, the fixed value centre ``c [Hkv, d]``) -> FP32 ``[Hkv, n]`` each, never
    below the exact values (FP64, inflated by ``1e-12`` relative, rounded up):

    * ``eta``: ``max_t ||v_hat_t - v_t||`` (Cor. 4.2); ``value_spec``: ``||V_hat_b - V_b||_2``
      (:func:`~certkv.certify.bounds.value_block_terms`); both on the codec's own decode (a
      kernel's differs by the codec's ``decode_rounding``, which E_arith carries);
    * ``nu``: ``max_t ||v_t||`` (V_max); ``v_radius``: ``max_t ||v_t - c||`` (centred V_max);
    * ``key_err``: ``max_t ||k_hat_t - k_t||`` and ``key_spec``: ``||K_hat_b - K_b||_2``, each
      plus what the codec's ``decode_slack`` ``sigma [d]`` can add for *any* FP32 decode
      (``||sigma||`` per token, ``||Sigma||_2 <= ||Sigma||_F <= sqrt(B) ||sigma||`` per block).
    """
    v64, k64 = v16.double(), k16.double()
    zeros = torch.zeros(v64.shape[:2], dtype=torch.float64, device=v64.device)
    errors = {}  # the lossy ones' error blocks, measured in one batch
    if not value_codec.exact:
        errors["v"] = value_codec.decode(value_blocks).double() - v64
    if not key_codec.exact:
        errors["k"] = key_codec.decode(key_blocks).double() - k64
    measured = {}
    if errors:
        per_token, spectral = _error_norms(torch.stack(list(errors.values())))
        measured = {name: (per_token[i], spectral[i]) for i, name in enumerate(errors)}
    eta, value_spec = measured.get("v", (zeros, zeros))
    key_err, key_spec = measured.get("k", (zeros, zeros))
    if "k" in errors:
        slack = key_codec.decode_slack(key_blocks).double().norm(dim=-1)  # [Hkv, n]
        key_err = key_err + slack
        key_spec = key_spec + slack * k64.shape[2] ** 0.5
    found = {"eta": eta, "nu": v64.norm(dim=-1).amax(dim=-1), "value_spec": value_spec,
             "key_err": key_err, "key_spec": key_spec,
             "v_radius": centred_radius(v64, centre.unsqueeze(1))}
    rounded = round_up_fp32(torch.stack([found[name] for name in ANNOTATIONS]) * INFLATE)
    return dict(zip(ANNOTATIONS, rounded.unbind(), strict=True))


