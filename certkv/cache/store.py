"""TieredKVStore: one layer's tiered KV cache (paper 2.3, 3.1, Table 13).

* FP16 **tail**: the trailing partial block (fewer than ``B`` tokens), in device memory, exact.
* **Tier-1** (device): completed blocks, quantized atomically when they fill, with scales taken
  from those ``B`` tokens alone and never updated (precondition P1), plus six FP32 annotations
  per block and kv head (:data:`ANNOTATIONS`, 24 bytes), measured exactly in FP64 at write time
  from the FP16 originals and rounded up: ``eta_b`` (max per-token value reconstruction error),
  ``nu_b`` (max per-token value norm), the value-error spectral norm ``s_b``, the key error's
  max token norm and spectral norm (with the codec's decode slack, so they bound the keys any
  kernel decodes) and the centred value radius ``max_t ||v_t - c||``.
* **Tier-2** (host, pinned when the device is CUDA): the FP16 originals of every completed block,
  the ground truth for promotion and for the dense fallback (precondition P4).

Shapes: ``append`` takes ``k, v: [Hkv, T, d]``; block tensors are ``[Hkv, n_blocks, B, d]``.
"""

from __future__ import annotations

import copy
import importlib.util

import torch

from certkv.certify.bounds import centred_radius, spectral_norm_upper
from certkv.errors import (
    ConfigError,
    NonFiniteError,
    ShapeError,
    Tier2UnavailableError,
    require,
)
from certkv.quant import (
    Blocks,
    ChannelAffineKeyCodec,
    FP16KeyCodec,
    FP16ValueCodec,
    GroupAffineValueCodec,
    KeyCodec,
    ValueCodec,
)

_TIER2_MISSING = (
    "the FP16 originals (Tier-2) of this store were dropped, so no block can be promoted and no "
    "dense fallback can run; build the store with keep_originals=True."
)


NONFINITE_KV = ("k or v holds NaN or Inf (or values beyond the FP16 range); fix the model outputs "
                "before caching them.")


class _GrowingBlocks:
    """Tensors that grow along dim 1 (the block axis) with amortised doubling.

    Holds a dict of named tensors with leading dims ``[Hkv, capacity]``; ``view()`` returns the
    first ``size`` blocks of each without copying.
    """

    def __init__(self, device: torch.device, pin: bool = False, spare: int = 0) -> None:
        self.device = device
        self.pin = pin
        self.spare = spare  # blocks kept free after ``size`` (room for the padded tail block)
        self.size = 0
        self._data: Blocks = {}
        self._copied = None  # CUDA event after the last asynchronous copy into pinned memory

    def _wait(self) -> None:
        """Host reads of pinned memory wait for the asynchronous device-to-host copies into it
        (usually long done: every decode step reads from the device once)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def _allocate(self, like: torch.Tensor, capacity: int) -> torch.Tensor:
        shape = (like.shape[0], capacity, *like.shape[2:])
        return torch.empty(shape, dtype=like.dtype, device=self.device, pin_memory=self.pin)

    def extend(self, blocks: Blocks) -> None:
        n = next(iter(blocks.values())).shape[1]
        capacity = next(iter(self._data.values())).shape[1] if self._data else 0
        if self.size + n + self.spare > capacity or not self._data:
            self._wait()  # growing copies the old buffer on the host
            new_capacity = max(2 * capacity, self.size + n + self.spare, 4)
            for name, new in blocks.items():
                grown = self._allocate(new, new_capacity)
                if name in self._data:
                    grown[:, : self.size].copy_(self._data[name][:, : self.size])
                self._data[name] = grown
        for name, new in blocks.items():
            self._data[name][:, self.size : self.size + n].copy_(new, non_blocking=self.pin)
        if self.pin and n and next(iter(blocks.values())).is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.size += n

    def view(self, extra: int = 0) -> Blocks:
        """The first ``size + extra`` blocks (``extra <= spare``) of each tensor, no copy."""
        self._wait()
        return {name: t[:, : self.size + extra] for name, t in self._data.items()}

    def nbytes(self) -> int:
        return sum(t.element_size() * t[:, : self.size].numel() for t in self._data.values())

    def clear(self) -> None:
        self._data = {}
        self.size = 0

    def clone(self) -> _GrowingBlocks:
        """An independent copy (same capacity; pinned where this one is)."""
        self._wait()
        new = _GrowingBlocks(self.device, self.pin, self.spare)
        new.size = self.size
        for name, t in self._data.items():
            new._data[name] = self._allocate(t, t.shape[1]).copy_(t)
        return new


def _round_up_fp32(x: torch.Tensor) -> torch.Tensor:
    """FP64 -> FP32 rounding up, so a stored bound is never below the exact value."""
    y = x.float()
    return torch.where(y.double() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


ANNOTATIONS = ("eta", "nu", "value_spec", "key_err", "key_spec", "v_radius")
"""Per-block, per-kv-head FP32 annotations ``[Hkv, n]`` (:func:`block_annotations`)."""

_INFLATE = 1.0 + 1e-12  # covers the FP64 rounding of the measurements (norms, eigenvalues)


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
    lossless_v = isinstance(value_codec, FP16ValueCodec)
    lossless_k = isinstance(key_codec, FP16KeyCodec)
    zeros = torch.zeros(v64.shape[:2], dtype=torch.float64, device=v64.device)
    eta, value_spec = (zeros, zeros) if lossless_v else _error_norms(
        value_codec.decode(value_blocks).double() - v64)
    if lossless_k:
        key_err = key_spec = zeros
    else:
        key_err, key_spec = _error_norms(key_codec.decode(key_blocks).double() - k64)
        slack = key_codec.decode_slack(key_blocks).double().norm(dim=-1)  # [Hkv, n]
        key_err = key_err + slack
        key_spec = key_spec + slack * k64.shape[2] ** 0.5
    found = {"eta": eta, "nu": v64.norm(dim=-1).amax(dim=-1), "value_spec": value_spec,
             "key_err": key_err, "key_spec": key_spec,
             "v_radius": centred_radius(v64, centre.unsqueeze(1))}
    return {name: _round_up_fp32(found[name] * _INFLATE) for name in ANNOTATIONS}


class TieredKVStore:
    """One layer's KV cache: FP16 tail, Tier-1 quantized blocks, Tier-2 FP16 originals.

    Args:
        num_kv_heads: ``Hkv``.
        head_dim: ``d``.
        block_size: ``B`` tokens per block (paper default 16).
        value_group: ``g`` channels per value group of the default value codec (paper 16).
        device: where the tail and Tier-1 live; Tier-2 is always host memory (a store with FP16
            passthrough codecs is lossless: its Tier-1 holds the originals, no Tier-2 copy).
        key_codec: default ``ChannelAffineKeyCodec(bits=8)``.
        value_codec: default ``GroupAffineValueCodec(bits=4, group=value_group)``.
        keep_originals: keep Tier-2; without it nothing can be promoted or fall back.
        decoded_mirror: also keep the FP32 reconstruction of every block, decoded once when the
            block is quantized, plus room for the padded tail block. The PyTorch reference path
            then reads it instead of decoding Tier-1 every step (a CPU speed aid; the values are
            bit-identical to decoding the codes; reported by :meth:`workspace_bytes`).
        fused_encode: quantize completed blocks with the Triton kernel
            (``certkv.kernels.triton_quantize``); ``None`` = on CUDA when the codecs are the
            defaults (INT8 keys, INT4 values) and B, d are powers of two.
    """

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        block_size: int = 16,
        value_group: int = 16,
        device: str | torch.device = "cpu",
        key_codec: KeyCodec | None = None,
        value_codec: ValueCodec | None = None,
        keep_originals: bool = True,
        decoded_mirror: bool = False,
        fused_encode: bool | None = None,
    ) -> None:
        for name, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("block_size", block_size)):
            require(isinstance(value, int) and value >= 1, ConfigError,
                    f"{name}={value!r} must be a positive integer.")
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.device = torch.device(device)
        self.key_codec = key_codec or ChannelAffineKeyCodec()
        self.value_codec = value_codec or GroupAffineValueCodec(group=value_group)
        self.key_codec.validate(head_dim, block_size)
        self.value_codec.validate(head_dim, block_size)
        self.keep_originals = keep_originals
        self.fused_encode = self._fused_supported() and (
            self.device.type == "cuda" if fused_encode is None else fused_encode)

        # FP16 passthrough codecs (dense mode, dense prefill): Tier-1 already holds the
        # originals on the device, so there is no Tier-2 copy and dense reads need no H2D copy
        self.lossless = isinstance(self.key_codec, FP16KeyCodec) and isinstance(
            self.value_codec, FP16ValueCodec)
        pin = self.device.type == "cuda"
        spare = 1 if self.lossless else 0  # room for the tail block: zero-copy dense views
        self._keys = _GrowingBlocks(self.device, spare=spare)
        self._values = _GrowingBlocks(self.device, spare=spare)
        self._annotations = _GrowingBlocks(self.device)  # ANNOTATIONS: [Hkv, n] each
        self._tier2 = _GrowingBlocks(torch.device("cpu"), pin=pin)  # k, v: [Hkv, n, B, d] fp16
        self._mirror = _GrowingBlocks(self.device, spare=1) if decoded_mirror else None
        tail_shape = (num_kv_heads, block_size, head_dim)
        self._tail_k = torch.zeros(tail_shape, dtype=torch.float16, device=self.device)
        self._tail_v = torch.zeros(tail_shape, dtype=torch.float16, device=self.device)
        self.tail_len = 0
        self._nu_max = torch.zeros(num_kv_heads, device=self.device)  # running max of nu_b
        self._eta_max = torch.zeros(num_kv_heads, device=self.device)  # running max of eta_b
        self._radius_max = torch.zeros(num_kv_heads, device=self.device)  # of v_radius_b
        # the fixed centre c of the centred value radius: per-channel midrange of the values
        # of the first append (any fixed c is valid, Theorem 4.3 centred)
        self._centre = torch.zeros(num_kv_heads, head_dim, device=self.device)
        self._centred = False
        # running channel max of |k| over every token: the logit magnitude of e_arith
        self._key_abs_max = torch.zeros(num_kv_heads, head_dim, device=self.device)
        self._nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)
        empty = torch.zeros(num_kv_heads, 0, block_size, head_dim, dtype=torch.float16,
                            device=self.device)
        self._commit_blocks(empty, empty)  # allocates every buffer, so views exist when empty

    # ------------------------------------------------------------------ writing
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k, v: [Hkv, T, d]`` (post-RoPE, any float dtype, ``T >= 1``).

        Tokens join the FP16 tail; every block that fills is quantized at once (Tier-1), its
        annotations eta_b / nu_b are measured and its FP16 originals move to Tier-2.
        """
        k16, v16 = self._check_append(k, v)
        if not self._centred:
            vf = v16.float()
            self._centre = (vf.amax(dim=1) + vf.amin(dim=1)) / 2
            self._centred = True
        self._key_abs_max = torch.maximum(self._key_abs_max, k16.abs().amax(dim=1).float())
        pending_k = torch.cat([self._tail_k[:, : self.tail_len], k16], dim=1)
        pending_v = torch.cat([self._tail_v[:, : self.tail_len], v16], dim=1)
        n_full = pending_k.shape[1] // self.block_size
        if n_full:
            cut = n_full * self.block_size
            shape = (self.num_kv_heads, n_full, self.block_size, self.head_dim)
            self._commit_blocks(pending_k[:, :cut].reshape(shape),
                                pending_v[:, :cut].reshape(shape))
            pending_k, pending_v = pending_k[:, cut:], pending_v[:, cut:]
        self.tail_len = pending_k.shape[1]
        self._tail_k[:, : self.tail_len] = pending_k
        self._tail_v[:, : self.tail_len] = pending_v

    def _check_append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        expected = f"[num_kv_heads={self.num_kv_heads}, T, head_dim={self.head_dim}]"
        for name, x in (("k", k), ("v", v)):
            require(isinstance(x, torch.Tensor) and x.dim() == 3, ShapeError,
                    f"{name} must be a 3-D tensor shaped {expected}; reshape it before append.")
            require(x.shape[0] == self.num_kv_heads and x.shape[2] == self.head_dim, ShapeError,
                    f"{name} has shape {tuple(x.shape)} but the store expects {expected}.")
            require(x.is_floating_point(), ShapeError,
                    f"{name} has dtype {x.dtype}; pass floating-point keys and values.")
        require(k.shape[1] == v.shape[1] and k.shape[1] >= 1, ShapeError,
                f"k and v must hold the same number T >= 1 of tokens (got {k.shape[1]} and "
                f"{v.shape[1]}).")
        k16 = k.to(device=self.device, dtype=torch.float16)
        v16 = v.to(device=self.device, dtype=torch.float16)
        bad = ~(torch.isfinite(k16).all() & torch.isfinite(v16).all())
        if self.device.type == "cpu":
            require(not bool(bad), NonFiniteError, NONFINITE_KV)
        else:  # no device sync per token: CertifiedAttention reads the flag with its others
            self._nonfinite = self._nonfinite | bad
        return k16, v16

    def nonfinite_appended(self) -> torch.Tensor:
        """0-d bool: some appended K/V was NaN/Inf (checked at once on CPU, deferred to the
        attention step's host read on accelerators)."""
        return self._nonfinite

    def _fused_supported(self) -> bool:
        pow2 = all(x & (x - 1) == 0 for x in (self.block_size, self.head_dim))
        return (pow2 and isinstance(self.key_codec, ChannelAffineKeyCodec)
                and self.key_codec.bits == 8 and isinstance(self.value_codec,
                                                            GroupAffineValueCodec)
                and self.value_codec.bits == 4 and importlib.util.find_spec("triton") is not None)

    def _encode(self, k16: torch.Tensor, v16: torch.Tensor):
        """Codes, metadata and :data:`ANNOTATIONS` of completed blocks ``[Hkv, n, B, d]``. The
        annotations are measured in PyTorch on either path (the fused kernel's own eta / nu are
        not used)."""
        if self.fused_encode and k16.shape[1]:
            from certkv.kernels.triton_quantize import quantize_blocks

            key_blocks, value_blocks, _, _ = quantize_blocks(k16, v16, self.value_codec.group)
        else:
            key_blocks = self.key_codec.encode(k16)
            value_blocks = self.value_codec.encode(v16)
        notes = block_annotations(k16, v16, self.key_codec, self.value_codec, key_blocks,
                                  value_blocks, self._centre)
        return key_blocks, value_blocks, notes

    def _commit_blocks(self, k16: torch.Tensor, v16: torch.Tensor) -> None:
        """Quantize completed blocks ``[Hkv, n, B, d]`` and move their originals to Tier-2."""
        key_blocks, value_blocks, notes = self._encode(k16, v16)
        self._keys.extend(key_blocks)
        self._values.extend(value_blocks)
        self._annotations.extend(notes)
        if k16.shape[1]:
            self._nu_max = torch.maximum(self._nu_max, notes["nu"].amax(dim=1))
            self._eta_max = torch.maximum(self._eta_max, notes["eta"].amax(dim=1))
            self._radius_max = torch.maximum(self._radius_max, notes["v_radius"].amax(dim=1))
        if self._mirror is not None:
            self._mirror.extend({"k": self.key_codec.decode(key_blocks),
                                 "v": self.value_codec.decode(value_blocks),
                                 "bound": self.key_codec.channel_bound(key_blocks)})
        if self.keep_originals and not self.lossless:
            self._tier2.extend({"k": k16, "v": v16})

    def clone(self) -> TieredKVStore:
        """An independent copy of this store (every tier, annotation and running statistic), so
        one quantized prefill can serve several methods without quantizing it again."""
        new = copy.copy(self)
        for name in ("_keys", "_values", "_annotations", "_tier2", "_mirror"):
            blocks = getattr(self, name)
            setattr(new, name, None if blocks is None else blocks.clone())
        for name in ("_tail_k", "_tail_v", "_nu_max", "_eta_max", "_radius_max", "_centre",
                     "_key_abs_max", "_nonfinite"):
            setattr(new, name, getattr(self, name).clone())
        return new

    def drop_originals(self) -> None:
        """Release Tier-2 (e.g. host memory is exhausted); promotion and fallback then raise."""
        self.keep_originals = False
        self._tier2.clear()

    # ------------------------------------------------------------------ reading
    @property
    def num_blocks(self) -> int:
        """Completed (quantized) blocks."""
        return self._keys.size

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size + self.tail_len

    def key_blocks(self) -> Blocks:
        """Tier-1 key codes and metadata, leading dims ``[Hkv, n_blocks]``."""
        return self._keys.view()

    def value_blocks(self) -> Blocks:
        """Tier-1 value codes and metadata, leading dims ``[Hkv, n_blocks]``."""
        return self._values.view()

    @property
    def eta(self) -> torch.Tensor:
        """``[Hkv, n_blocks]`` max per-token value reconstruction error (Cor. 4.2)."""
        return self._annotations.view()["eta"]

    @property
    def nu(self) -> torch.Tensor:
        """``[Hkv, n_blocks]`` max per-token value l2 norm (Theorem 4.3's V_max per block)."""
        return self._annotations.view()["nu"]

    def annotation(self, name: str) -> torch.Tensor:
        """FP32 ``[Hkv, n_blocks]`` annotation ``name`` (one of :data:`ANNOTATIONS`)."""
        require(name in ANNOTATIONS, ConfigError,
                f"annotation {name!r} is unknown; use one of {list(ANNOTATIONS)}.")
        return self._annotations.view()[name]

    @property
    def centre(self) -> torch.Tensor:
        """FP32 ``[Hkv, d]``: the fixed value centre ``c`` of the centred radius."""
        return self._centre

    def value_radius(self) -> torch.Tensor:
        """``[Hkv]`` upper bound on ``max_t ||v_t - c||_2`` over every token (the centred V_max
        of E_key, :func:`~certkv.certify.bounds.key_error_bound`): the running max of the
        blocks' ``v_radius`` and the tail tokens' radii."""
        if not self.tail_len:
            return self._radius_max.clone()
        tail = centred_radius(self.tail()[1], self._centre) * _INFLATE
        return torch.maximum(self._radius_max, _round_up_fp32(tail))

    def value_norm_max(self) -> torch.Tensor:
        """``[Hkv]`` upper bound on ``max_t ||v_t||_2`` over every token (V_max, Theorem 4.3):
        the running max of nu_b, and the tail tokens' norms."""
        if not self.tail_len:
            return self._nu_max.clone()
        tail_norm = self.tail()[1].double().norm(dim=-1).amax(dim=-1)
        return torch.maximum(self._nu_max, _round_up_fp32(tail_norm))

    def value_error_max(self) -> torch.Tensor:
        """``[Hkv]`` the largest eta_b (0 without quantized blocks): ``||v_hat_t|| <= V_max +
        this`` for every decoded value (the arithmetic bound's value magnitude)."""
        return self._eta_max

    def key_abs_max(self) -> torch.Tensor:
        """FP32 ``[Hkv, d]``: ``max_t |k_{t,c}|`` over every appended key (exact; NaN once a
        NaN key was appended). Bounds the logits' magnitude for the arithmetic bound."""
        return self._key_abs_max

    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """FP16 keys and values of the partial tail block, ``[Hkv, tail_len, d]`` each."""
        return self._tail_k[:, : self.tail_len], self._tail_v[:, : self.tail_len]

    def tail_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP16 tail buffers ``[Hkv, B, d]`` (rows ``>= tail_len`` are stale): kernels read
        the exact tail block in place, masked by ``tail_len``."""
        return self._tail_k, self._tail_v

    def decoded_with_tail(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """FP32 keys and values ``[Hkv, n, B, d]`` of every block with the partial tail block
        (zero-padded) last, from the decoded mirror (no copy); ``None`` without a mirror."""
        if self._mirror is None:
            return None
        extra = 1 if self.tail_len else 0
        view = self._mirror.view(extra)
        if extra:
            for name, tail in zip(("k", "v"), self.tail(), strict=True):
                block = view[name][:, -1]
                block.zero_()
                block[:, : self.tail_len] = tail.float()
        return view["k"], view["v"]

    def workspace_bytes(self) -> int:
        """Device memory of the decoded mirror (0 without one)."""
        return 0 if self._mirror is None else self._mirror.nbytes()

    def dequantized_keys(self) -> torch.Tensor:
        """FP32 ``[Hkv, n_blocks, B, d]`` keys reconstructed from Tier-1."""
        return self.key_codec.decode(self.key_blocks())

    def dequantized_values(self) -> torch.Tensor:
        """FP32 ``[Hkv, n_blocks, B, d]`` values reconstructed from Tier-1."""
        return self.value_codec.decode(self.value_blocks())

    def key_channel_bound(self) -> torch.Tensor:
        """FP32 ``[Hkv, n_blocks, d]`` per-channel key reconstruction bound (paper 2.3), from the
        stored metadata (cached in the decoded mirror when there is one)."""
        if self._mirror is not None:
            return self._mirror.view()["bound"]
        return self.key_codec.channel_bound(self.key_blocks())

    def _originals(self, extra: int = 0) -> Blocks:
        """FP16 originals ``k, v: [Hkv, n, B, d]`` of completed blocks: Tier-2 in host memory,
        or Tier-1 itself for a lossless store (with ``extra`` spare blocks)."""
        if self.lossless:
            return {"k": self._keys.view(extra)["data"], "v": self._values.view(extra)["data"]}
        require(self.keep_originals, Tier2UnavailableError, _TIER2_MISSING)
        return self._tier2.view()

    def fetch_originals(
        self, kv_heads: torch.Tensor, blocks: torch.Tensor, which: str = "kv"
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Page in FP16 originals of ``(kv_heads[i], blocks[i])`` pairs from Tier-2.

        Returns ``(k, v)``, each ``[P, B, d]`` FP16 on the store's device, or ``None`` where
        ``which`` does not ask for it (``"k"``, ``"v"`` or ``"kv"``).
        """
        originals = self._originals()
        where = self.device if self.lossless else torch.device("cpu")  # where originals live
        heads, blks = kv_heads.to(where), blocks.to(where)
        fetched = []
        for name in ("k", "v"):
            if name in which:
                fetched.append(originals[name][heads, blks].to(self.device, non_blocking=True))
            else:
                fetched.append(None)
        return fetched[0], fetched[1]

    def dense_kv(self, kv_heads: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """FP16 originals of every token (Tier-2 + tail) on the device (rungs 3-4, dense mode).

        Returns ``k, v: [h, N, d]`` for the requested ``kv_heads`` (all ``Hkv`` by default);
        only those heads are paged in.
        """
        if self.lossless and kv_heads is None:
            return self._dense_view()
        tail_k, tail_v = self.tail()
        if kv_heads is not None:
            tail_k, tail_v = tail_k[kv_heads], tail_v[kv_heads]
        if self.num_blocks == 0:
            return tail_k, tail_v
        originals = self._originals()
        heads = slice(None) if kv_heads is None else kv_heads.to(originals["k"].device)
        k = originals["k"][heads].flatten(1, 2).to(self.device, non_blocking=True)
        v = originals["v"][heads].flatten(1, 2).to(self.device, non_blocking=True)
        return torch.cat([k, tail_k], dim=1), torch.cat([v, tail_v], dim=1)

    def _dense_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Lossless store: every token as ``[Hkv, N, d]`` views of Tier-1 (the tail is copied
        into the spare block; no copy of the cache, as a dense FP16 KV cache would hold it)."""
        extra = 1 if self.tail_len else 0
        originals = self._originals(extra)
        if extra:
            for name, tail in zip(("k", "v"), self.tail(), strict=True):
                originals[name][:, -1, : self.tail_len] = tail
        n = self.num_tokens
        return originals["k"].flatten(1, 2)[:, :n], originals["v"].flatten(1, 2)[:, :n]

    # --------------------------------------------------------------- accounting
    def tier1_bytes(self) -> int:
        """Quantized codes + quantization metadata of completed blocks (Table 13's Tier-1 total).

        Table 13 lists eta_b as "<1 byte/token, amortised" and leaves it out of the 288-byte
        total; the annotations are counted by :meth:`annotation_bytes`.
        """
        return self._keys.nbytes() + self._values.nbytes()

    def annotation_bytes(self) -> int:
        """The :data:`ANNOTATIONS`: six FP32 (24 bytes) per block per kv head."""
        return self._annotations.nbytes()

    def tail_bytes(self) -> int:
        """FP16 partial tail block (device)."""
        return 2 * 2 * self.num_kv_heads * self.tail_len * self.head_dim

    def device_bytes(self) -> int:
        """Everything this store keeps in device memory: Tier-1, annotations, tail."""
        return self.tier1_bytes() + self.annotation_bytes() + self.tail_bytes()

    def tier2_bytes(self) -> int:
        """FP16 originals in host memory (Tier-2)."""
        return self._tier2.nbytes()

    def dense_bytes(self) -> int:
        """What a dense FP16 KV cache of the same tokens would hold."""
        return 2 * 2 * self.num_kv_heads * self.num_tokens * self.head_dim

    def __repr__(self) -> str:
        return (f"TieredKVStore(Hkv={self.num_kv_heads}, d={self.head_dim}, B={self.block_size}, "
                f"tokens={self.num_tokens}, keys={self.key_codec.name}/{self.key_codec.bits}b, "
                f"values={self.value_codec.name}/{self.value_codec.bits}b)")
