"""Which blocks change precision, and when: graduation by age and under a memory budget.

Host-only bookkeeping for a :class:`~certkv.cache.store.TieredKVStore` (the store does the
re-quantization). A block's **age** is the number of tokens appended after it: block ``b`` of a
sequence of ``N`` tokens (``B`` per block) has age ``N - (b + 1) B``. Stage ``0`` is where a
block starts; it enters stage ``i >= 1`` once its age reaches ``ages[i - 1]``, and a block never
goes back to an earlier stage (boundaries that move later apply to blocks that graduate from
then on). The first ``sink_blocks`` blocks never leave stage 0.

This is also the seam for eviction: a stage whose precision keeps no codes in Tier-1.
"""

from __future__ import annotations

import torch


class Stages:
    """Per-block stages ``[n]`` (host int64) and the age boundaries ``ages`` (ascending)."""

    def __init__(self, ages: list[int], block_size: int, sink_tokens: int = 0) -> None:
        self.ages = list(ages)
        self.block_size = block_size
        self.sink_blocks = -(-sink_tokens // block_size)  # blocks touching the first tokens
        self.stage = torch.zeros(0, dtype=torch.long)

    @property
    def last(self) -> int:
        return len(self.ages)

    def _by_age(self, first: int, count: int, seq_len: int) -> torch.Tensor:
        """The stage ``[count]`` that age alone gives blocks ``first .. first + count - 1``."""
        b = torch.arange(first, first + count)
        age = seq_len - (b + 1) * self.block_size
        stage = torch.zeros(count, dtype=torch.long)
        for boundary in self.ages:
            stage += (age >= boundary).long()
        return torch.where(b < self.sink_blocks, torch.zeros_like(stage), stage)

    def add(self, count: int, seq_len: int) -> torch.Tensor:
        """Stages ``[count]`` of ``count`` new (newest) blocks; a prefill's older blocks start
        at the stage their age has already reached (quantized once, at that precision)."""
        new = self._by_age(len(self.stage), count, seq_len)
        self.stage = torch.cat([self.stage, new])
        return new

    def due(self, seq_len: int) -> list[tuple[int, torch.Tensor]]:
        """``(stage, blocks [m])`` for every stage some blocks have aged into (latest stage
        first, so a block that crossed two boundaries is re-quantized once); applied at once."""
        target = self._by_age(0, len(self.stage), seq_len)
        moves = []
        for stage in range(self.last, 0, -1):
            blocks = ((target == stage) & (self.stage < stage)).nonzero(as_tuple=True)[0]
            if len(blocks):
                self.stage[blocks] = stage
                moves.append((stage, blocks))
        return moves

    def early(self) -> torch.Tensor:
        """Blocks that may graduate early to the last stage under memory pressure, oldest first
        (not a sink block, not at the last stage yet)."""
        b = torch.arange(len(self.stage))
        return ((self.stage < self.last) & (b >= self.sink_blocks)).nonzero(as_tuple=True)[0]

    def move(self, blocks: torch.Tensor, stage: int) -> None:
        self.stage[blocks] = stage

    def clone(self) -> Stages:
        new = Stages.__new__(Stages)
        new.__dict__.update(self.__dict__)
        new.ages = list(self.ages)
        new.stage = self.stage.clone()
        return new
