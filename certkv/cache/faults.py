"""Storage faults and their detection in a store (:class:`~certkv.cache.store.TieredKVStore`
inherits this; seed 003): injecting bit flips into what is written (``protect.faults``),
reading protected blocks back (corrected words, erasures, the integrity check and the
annotations' hash), serving corrupted blocks from their FP16 originals, and the counts the
certificate reports."""

from __future__ import annotations

import torch

from certkv.cache.annotations import ANNOTATIONS
from certkv.quant import Blocks
from certkv.quant.precision import Precision, exact_precision
from certkv.quant.protect.integrity import block_hash
from certkv.quant.protect.protection import protected


class FaultHandling:
    """Faults in Tier-1 caught or said (``protection.py`` states the fault model)."""

    def _inject(self, key_blocks: Blocks, value_blocks: Blocks) -> tuple[Blocks, Blocks]:
        """Persistent faults: the bits of newly written codes flip once, after the annotations
        were measured on what was written (a memory fault; transient faults flip on reads)."""
        if not self._faults.active or self._faults.transient:
            return key_blocks, value_blocks
        return self._flip(key_blocks, value_blocks)

    def _flip(self, key_blocks: Blocks, value_blocks: Blocks) -> tuple[Blocks, Blocks]:
        """``key_blocks`` and ``value_blocks`` with their stored bits flipped by the fault model
        (this store's seeded generator), counted in :attr:`bits_flipped`."""
        key_blocks, n_k = self._faults.flip(key_blocks, self._fault_rng)
        value_blocks, n_v = self._faults.flip(value_blocks, self._fault_rng)
        self.bits_flipped += n_k + n_v
        return key_blocks, value_blocks

    def _read_health(self, precision: Precision, key_blocks: Blocks, value_blocks: Blocks,
                     notes: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """:data:`HEALTH` of blocks as read now: the protected codecs' word counts, and a
        block is corrupted (every kv head of it) when any of its codes, or (``notes``, its
        :data:`ANNOTATIONS` as written) its annotations, fails the integrity check."""
        any_blocks = next(iter(key_blocks.values()))
        hkv, n = any_blocks.shape[:2]
        corrected = torch.zeros(hkv, n, dtype=torch.int32, device=self.device)
        erased = torch.zeros_like(corrected)
        bad = torch.zeros(hkv, n, dtype=torch.bool, device=self.device)
        for codec, blocks in ((precision.key_codec, key_blocks),
                              (precision.value_codec, value_blocks)):
            wrapped = protected(codec)
            if wrapped is None:
                continue
            found = wrapped.read(blocks)
            corrected += found.corrected.to(torch.int32)
            erased += found.erased.to(torch.int32)
            bad |= ~found.intact
        if notes is not None and self._checks_notes and not precision.exact:
            bad |= self._notes_fail_check(notes)
        corrupted = bad.any(dim=0, keepdim=True).expand(hkv, n).clone()
        return {"corrected": corrected, "erased": erased, "corrupted": corrupted}

    @property
    def _checks_notes(self) -> bool:
        """Faults flip annotations (``metadata``) and the integrity check sees them. Without
        the check nothing is flipped there: faults then certify nothing anyway
        (:attr:`~certkv.quant.protect.protection.Protection.covers_faults`)."""
        return self.protection.integrity and self._faults.active and self._faults.metadata

    def _notes_fail_check(self, notes: dict[str, torch.Tensor]) -> torch.Tensor:
        """Bool ``[Hkv, n]``: the blocks' annotations as read now (their words flipped by the
        fault model) fail their hash. A block that fails it is served from its FP16 originals
        and its annotations are those of its originals (what was written), so the values a
        step uses stay true."""
        clean = {name: notes[name] for name in ANNOTATIONS}
        read, flipped = self._faults.flip(clean, self._fault_rng)
        self.bits_flipped += flipped
        return (block_hash(read) != block_hash(clean)).any(dim=-1)

    def reads_draw_faults(self) -> bool:
        """Whether each step's read of Tier-1 draws fresh faults (transient ones, injected):
        a step must then read it once (:meth:`refresh_reads`)."""
        return bool(self._faults.active and self._faults.transient)

    def refresh_reads(self) -> None:
        """Called once per attention step before it reads Tier-1 (:class:`~certkv.kernels.
        layout.StepLayout`). With transient faults, the step reads every lossy block through a
        freshly flipped copy of its stored words: the decoded rows, bounds and :data:`HEALTH`
        (corrupted blocks included) are those of this read; storage stays clean. Otherwise
        nothing: persistent faults were drawn at write time and every read sees the same bits."""
        if not (self._faults.active and self._faults.transient and self.num_blocks):
            return
        n, every = self.num_blocks, torch.arange(self.num_blocks)
        shape = (self.num_kv_heads, n, self.block_size, self.head_dim)
        read = {"k": torch.empty(shape, device=self.device),
                "v": torch.empty(shape, device=self.device),
                "bound": torch.empty(shape[0], n, shape[3], device=self.device)}
        health = {name: torch.empty(shape[:2], dtype=t.dtype, device=self.device)
                  for name, t in self._health.view().items()}
        for pid, where, slots in self._table.groups():
            precision = self.precisions[pid]
            keys, values = ({name: t[:, slots] for name, t in self._table.view(pid, w).items()}
                            for w in ("key", "value"))
            if not precision.exact:
                keys, values = self._flip(keys, values)
                self._step_codes[pid, "key"], self._step_codes[pid, "value"] = keys, values
            written = ({name: t[:, where] for name, t in self._annotations.view().items()}
                       if self._checks_notes else None)
            for name, t in self._read_health(precision, keys, values, written).items():
                health[name][:, where] = t
            read["k"][:, where] = precision.key_codec.decode(keys)
            read["v"][:, where] = precision.value_codec.decode(values)
            read["bound"][:, where] = precision.key_codec.channel_bound(keys)
        self._health.put(every, health)
        read = self._serve_corrupted(read, every)
        if self._mirror is not None:
            self._mirror.put(every, self._mirror_rows(read))
        else:
            self._step_read = read

    def _serve_corrupted(self, decoded: Blocks, blocks: torch.Tensor) -> Blocks:
        """Rows of ``blocks [m]`` (host) as decoded (``k``, ``v`` ``[Hkv, m, B, d]``, ``bound``
        ``[Hkv, m, d]``, any of them), with corrupted blocks' rows replaced by their FP16
        originals (Tier-2) and a bound of 0: what the step reads for them."""
        if self._health is None or not len(blocks):
            return decoded
        bad = self._health.view()["corrupted"][0][blocks.to(self.device)].cpu()
        if not bool(bad.any()):
            return decoded
        rows = bad.nonzero(as_tuple=True)[0]
        originals = self._originals()
        for name, x in decoded.items():
            if name == "bound":
                x[:, rows.to(x.device)] = 0
            else:
                x[:, rows.to(x.device)] = originals[name][:, blocks[rows]].to(x.device).float()
        return decoded

    def corrupted_mask(self) -> torch.Tensor:
        """Bool ``[n_blocks]`` on the device: the block's codes failed the integrity check when
        read (protection with ``integrity``), so every step reads its FP16 originals instead,
        as an exact block (keys and values; its error annotations read 0)."""
        if self._health is None:
            return torch.zeros(self.num_blocks, dtype=torch.bool, device=self.device)
        return self._health.view()["corrupted"][0]

    def fault_counts(self) -> dict[str, int]:
        """What a step reads, over every completed block: words the code corrected, words it
        erased, corrupted blocks (served from FP16), and bits the injector flipped so far."""
        out = {"corrected_words": 0, "erased_words": 0, "corrupted_blocks": 0,
               "bits_flipped": self.bits_flipped}
        if self._health is not None and self.num_blocks:
            health = self._health.view()
            out["corrected_words"] = int(health["corrected"].sum())
            out["erased_words"] = int(health["erased"].sum())
            out["corrupted_blocks"] = int(health["corrupted"][0].sum())
        return out

    def _corrupted_apart(self, groups: list, which: str) -> list:
        """:meth:`block_groups` with corrupted blocks taken out of their precision's launch
        and served by one more, exact one: their FP16 originals (paged in from Tier-2)."""
        if self._health is None or not self.num_blocks:
            return groups
        bad = self.corrupted_mask()
        if not bool(bad.any()):
            return groups
        kept = []
        for precision, codes, where, slots in groups:
            keep = ~bad[where]
            if bool(keep.any()):
                kept.append((precision, codes, where[keep], slots[keep]))
        blocks = bad.nonzero(as_tuple=True)[0]
        data = self._originals()["k" if which == "key" else "v"][:, blocks.cpu()]
        served = {"data": data.to(self.device)}
        rows = torch.arange(len(blocks), device=self.device)
        return [*kept, (exact_precision(), served, blocks, rows)]
