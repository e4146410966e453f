"""Block storage of one layer: growing tensors and the block table of a mixed-precision Tier-1.

Every completed block is held at one :class:`~certkv.quant.kv.Precision` (a key codec and a
value codec, or FP16 for an exact window). The :class:`BlockTable` keeps one growing buffer of
codes and metadata per precision and, per block ``b`` (oldest first), which precision holds it
and in which slot. A block that changes precision frees its slot, which the next block entering
that precision reuses, so Tier-1 holds exactly the live blocks' bytes.

Shapes: buffers are ``[Hkv, slots, ...]`` (every tensor of a codec's blocks dict); decoded
blocks ``[Hkv, n, B, d]`` FP32 in block order.
"""

from __future__ import annotations

import torch

from certkv.quant import Blocks


def head_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A head-major ``[Hkv, n, ...]`` view ``x`` of a ``[Hkv, W, ...]`` buffer (a
    :class:`GrowingBlocks` tensor) as its rows ``[Hkv * W, ...]`` in place, contiguous, and
    ``W``: block ``b`` of kv head ``h`` is row ``h W + b``. What kernels that index blocks by
    row read; a contiguous copy (``W = n``) where ``x`` is laid out otherwise."""
    hkv, n, *inner = x.shape
    strides = x.stride()
    row = strides[1]
    if n and row and strides[0] % row == 0 and strides[1:] == _contiguous(x.shape[1:]):
        width = strides[0] // row
        try:
            return x.as_strided((hkv * width, *inner), strides[1:]), width
        except RuntimeError:  # the buffer ends before the last head's W rows
            pass
    return x.contiguous().view(hkv * n, *inner), n


def _contiguous(shape) -> tuple[int, ...]:
    """The strides of a C-contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _run(blocks: torch.Tensor) -> tuple[int, int] | None:
    """``(first, stop)`` when the host block indices ``blocks [m]`` (``m >= 1``) are ``first,
    first + 1, ..., stop - 1``, else None."""
    if not len(blocks):
        return None
    first, last = int(blocks[0]), int(blocks[-1])
    if last - first != len(blocks) - 1:
        return None
    if len(blocks) > 2 and not bool((blocks[1:] - blocks[:-1] == 1).all()):
        return None
    return first, last + 1


class GrowingBlocks:
    """Tensors that grow along dim 1 (the block axis) with amortised doubling.

    Holds a dict of named tensors with leading dims ``[Hkv, capacity]``; ``view()`` returns the
    first ``size`` blocks of each without copying; ``put`` overwrites blocks in place.
    """

    def __init__(self, device: torch.device, pin: bool = False, spare: int = 0,
                 fill: dict[str, float] | None = None) -> None:
        self.device = device
        self.pin = pin
        self.spare = spare  # blocks kept free after ``size`` (room for the padded tail block)
        self.fill = fill  # name -> value of the spare blocks after every extend (None: as left)
        self.size = 0
        self._data: Blocks = {}
        self._views: dict = {}  # extra (or 'spare') -> views, until the next extend
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
        capacity = self.capacity
        grow = self.size + n + self.spare > capacity or not self._data
        if grow:
            self._grow(blocks, max(2 * capacity, self.size + n + self.spare, 4))
        self._write_at(self.size, blocks)
        self.size += n
        self._views = {}
        # the spare blocks again (a step may have written into them, e.g. the mirror's tail)
        self._fill_after(self.size + self.spare)

    def _grow(self, like: Blocks, capacity: int) -> None:
        """New buffers of ``capacity`` blocks (shaped and typed as ``like``'s tensors) holding
        the first ``size`` blocks, ``fill`` after them where it is set."""
        self._wait()  # growing copies the old buffer on the host
        for name, new in like.items():
            grown = self._allocate(new, capacity)
            if name in self._data:
                grown[:, : self.size].copy_(self._data[name][:, : self.size])
            self._data[name] = grown
        self._views = {}
        self._fill_after(capacity)

    def _fill_after(self, end: int) -> None:
        """``fill`` into the blocks from ``size`` to ``end`` (where ``fill`` is set)."""
        for name, value in (self.fill or {}).items():
            self._data[name][:, self.size : end].fill_(value)

    def reserve(self, capacity: int) -> None:
        """Grow to at least ``capacity`` blocks now (buffers that grow together keep their
        views in place together: a step captured in a graph, :mod:`certkv.graphs`); blocks
        after ``size`` hold ``fill`` where it is set."""
        if self._data and capacity > self.capacity:
            self._grow(self._data, capacity)

    @property
    def capacity(self) -> int:
        """Blocks the buffers hold before the next growth (0 before the first extend)."""
        return next(iter(self._data.values())).shape[1] if self._data else 0

    def put(self, index: torch.Tensor, blocks: Blocks) -> None:
        """Write ``blocks`` (leading dims ``[Hkv, len(index)]``) at block positions ``index``
        (host int64, each below the capacity)."""
        if not len(index):
            return
        run = _run(index)
        if run:
            self._write_at(run[0], blocks)
            return
        self._wait()
        for name, new in blocks.items():
            self._data[name][:, index.to(self.device)] = new.to(self.device)
        self._note_copy(blocks)

    def _write_at(self, first: int, blocks: Blocks) -> None:
        """Write ``blocks`` (leading dims ``[Hkv, m]``) at block positions ``first ..
        first + m - 1``."""
        self._wait()
        for name, new in blocks.items():
            self._data[name][:, first : first + new.shape[1]].copy_(new, non_blocking=self.pin)
        self._note_copy(blocks)

    def _note_copy(self, blocks: Blocks) -> None:
        """After a write into pinned memory from the device: an event the next host read of
        the buffers waits for (:meth:`_wait`)."""
        if self.pin and next(iter(blocks.values())).is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def view(self, extra: int = 0) -> Blocks:
        """The first ``size + extra`` blocks (``extra <= capacity - size``; blocks after ``size``
        hold ``fill`` where it is set) of each tensor, no copy (the same view objects until the
        next :meth:`extend`: a decode step slices nothing)."""
        self._wait()
        if extra not in self._views:
            self._views[extra] = {name: t[:, : self.size + extra]
                                  for name, t in self._data.items()}
        return self._views[extra]

    def buffers(self) -> Blocks:
        """Each tensor over its whole capacity, no copy (the same tensors until a growth)."""
        return self._data

    def spare_view(self) -> Blocks:
        """The spare blocks after ``size`` (``[Hkv, spare, ...]`` each), no copy (the same view
        objects until the next :meth:`extend`)."""
        if "spare" not in self._views:
            self._views["spare"] = {name: t[:, self.size : self.size + self.spare]
                                    for name, t in self._data.items()}
        return self._views["spare"]

    def block_bytes(self) -> int:
        """Bytes of one block (every tensor's slice at one block index)."""
        return sum(t.element_size() * t[:, :1].numel() for t in self._data.values())

    def nbytes(self) -> int:
        return self.block_bytes() * self.size

    def clear(self) -> None:
        self._data, self._views = {}, {}
        self.size = 0

    def clone(self) -> GrowingBlocks:
        """An independent copy (same capacity; pinned where this one is)."""
        self._wait()
        new = GrowingBlocks(self.device, self.pin, self.spare, self.fill)
        new.size = self.size
        for name, t in self._data.items():
            new._data[name] = self._allocate(t, t.shape[1]).copy_(t)
        return new


class BlockTable:
    """Which precision holds each completed block, and the codes of every precision.

    Args:
        precisions: the :class:`~certkv.quant.kv.Precision` list (ids are list positions).
        device: where the codes live (Tier-1).
        shape: ``(Hkv, B, d)``.
        spare: spare blocks per buffer (a lossless store reads the padded tail block there).
    """

    def __init__(self, precisions: list, device: torch.device, shape: tuple[int, int, int],
                 spare: int = 0) -> None:
        self.precisions = precisions
        self.num_kv_heads, self.block_size, self.head_dim = shape
        self.device = device
        self._keys = [GrowingBlocks(device, spare=spare) for _ in precisions]
        self._values = [GrowingBlocks(device, spare=spare) for _ in precisions]
        self._free: list[list[int]] = [[] for _ in precisions]
        self.precision = torch.zeros(0, dtype=torch.long)  # [n] host: precision id per block
        self.slot = torch.zeros(0, dtype=torch.long)  # [n] host: slot in that precision
        self._first = 0  # the precision of an empty table (where new blocks start)
        # device buffers a step reads in place (a step captured in a graph replays on them
        # while blocks complete, :mod:`certkv.graphs`): the lossy mask (False after the
        # blocks), 0..len-1 (the block and slot lists of one precision in block order), and
        # the lossy count (0-d int64)
        self._lossy = torch.zeros(0, dtype=torch.bool, device=device)
        self._arange = torch.arange(0, device=device)
        self._lossy_count = torch.zeros((), dtype=torch.long, device=device)
        self._single: int | None = None
        self._refresh()

    @property
    def num_blocks(self) -> int:
        return self._num_blocks  # len(self.precision), kept by _refresh (a step asks ~16 times)

    def _place(self, pid: int, count: int) -> torch.Tensor:
        """Slots for ``count`` new blocks of precision ``pid``: freed slots first (oldest
        first), then the end of its buffer (grown by the caller's write)."""
        free = self._free[pid]
        reused = free[:count]
        del free[:count]
        size = self._keys[pid].size
        fresh = list(range(size, size + count - len(reused)))
        return torch.tensor(reused + fresh, dtype=torch.long)

    def _write(self, pid: int, slots: torch.Tensor, keys: Blocks, values: Blocks) -> None:
        """Write blocks at ``slots`` of precision ``pid``: reused slots in place, new ones at
        the end of its buffers."""
        size = self._keys[pid].size
        old, new = slots < size, slots >= size
        pairs = ((self._keys[pid], keys), (self._values[pid], values))
        if not bool(old.any()):  # the usual case: every block at the end of its buffers
            for store, blocks in pairs:
                store.extend(blocks)
            return
        for store, blocks in pairs:
            if old.any():
                store.put(slots[old], {k: t[:, old.to(t.device)] for k, t in blocks.items()})
            if new.any():
                store.extend({k: t[:, new.to(t.device)] for k, t in blocks.items()})

    def add(self, pids: torch.Tensor, keys: list[Blocks], values: list[Blocks]) -> None:
        """Append blocks (the newest) with precision ids ``pids [m]`` (host); ``keys[j]`` and
        ``values[j]`` hold, in block order, the codes of the blocks whose id is the ``j``-th of
        ``pids.unique()``."""
        slots = torch.empty_like(pids)
        for j, pid in enumerate(pids.unique().tolist()):
            where = pids == pid
            slots[where] = self._place(pid, int(where.sum()))
            self._write(pid, slots[where], keys[j], values[j])
        self.precision = torch.cat([self.precision, pids])
        self.slot = torch.cat([self.slot, slots])
        self._refresh()

    def move(self, blocks: torch.Tensor, pid: int, keys: Blocks, values: Blocks) -> None:
        """Re-assign ``blocks [m]`` (host, ascending) to precision ``pid`` with their new codes
        (leading dims ``[Hkv, m]``); their old slots are freed."""
        for b in blocks.tolist():
            self._free[int(self.precision[b])].append(int(self.slot[b]))
        for free in self._free:
            free.sort()
        slots = self._place(pid, len(blocks))
        self._write(pid, slots, keys, values)
        self.precision[blocks] = pid
        self.slot[blocks] = slots
        self._refresh()

    def _refresh(self) -> None:
        """Recompute what decode steps read (host values and the device mask) once per change
        of the table, so a step reads no host tensor (``tests/test_host_reads``)."""
        self._num_blocks = len(self.precision)
        exact = torch.tensor([p.exact for p in self.precisions], dtype=torch.bool)
        lossy = ~exact[self.precision]
        self._num_quantized = int(lossy.sum())
        self._held = self.precision.unique().tolist()
        pid = int(self.precision[0]) if self.num_blocks else self._first
        same = bool((self.precision == pid).all())
        in_order = torch.equal(self.slot, torch.arange(self.num_blocks))
        self._single = pid if same and in_order else None
        self._lossy_count.fill_(self._num_quantized)
        self._write_lossy(lossy)
        if self._single is None:
            self._all_groups = self._groups(torch.arange(self.num_blocks))
        else:
            self._single_group()

    def _single_group(self) -> None:
        """One group: every block, in its slot (views of one buffer, kept in place until
        :meth:`_reserve` grows it, which makes them again)."""
        n = self.num_blocks
        every, on_device = torch.arange(n), self._arange[:n]
        self._all_groups = [(self._single, every, every, on_device, on_device)] if n else []

    def reserve(self, length: int) -> None:
        """Grow every buffer to at least ``length`` blocks now: the codes of each precision
        holding blocks, and the device buffers :meth:`quantized` and :meth:`groups` view (a
        growth makes new buffers, which :meth:`capacities` reports)."""
        for buffers in self._keys + self._values:
            buffers.reserve(length)
        self._reserve(length)

    def _reserve(self, length: int) -> None:
        """Grow the device buffers :meth:`quantized` and :meth:`groups` view to at least
        ``length`` entries (exactly: the store reserves its block capacity, :meth:`reserve`)."""
        if length <= self._lossy.numel():
            return
        grown = torch.zeros(length, dtype=torch.bool, device=self.device)
        grown[: self._lossy.numel()] = self._lossy
        self._lossy, self._arange = grown, torch.arange(length, device=self.device)
        if self._single is not None:  # (a captured step must not keep the old buffer's views)
            self._single_group()

    def _write_lossy(self, lossy: torch.Tensor) -> None:
        """The lossy mask (host ``[n]``) into the device buffer, False after it, in place."""
        self._reserve(len(lossy) + 1)
        padded = torch.zeros(self._lossy.numel(), dtype=torch.bool)
        padded[: len(lossy)] = lossy
        self._lossy.copy_(padded, non_blocking=True)

    def allocate(self, pid: int, keys: Blocks, values: Blocks) -> None:
        """Allocate precision ``pid``'s buffers from empty codes (leading dims ``[Hkv, 0]``), so
        its views exist before any block."""
        self._keys[pid].extend(keys)
        self._values[pid].extend(values)
        self._first = pid

    def _groups(self, blocks: torch.Tensor) -> list:
        """``(pid, positions [m] in blocks, slots [m])`` per precision holding ``blocks``
        (host tensors, then their device copies)."""
        held = self.precision[blocks]
        groups = []
        for pid in held.unique().tolist():
            where = (held == pid).nonzero(as_tuple=True)[0]
            slots = self.slot[blocks[where]]
            groups.append((pid, where, slots, where.to(self.device), slots.to(self.device)))
        return groups

    def _gather(self, which: str, fn, blocks: torch.Tensor | None) -> torch.Tensor | None:
        """``fn(codec, codes)`` (a tensor ``[Hkv, m, ...]``) for ``blocks`` (host; all by
        default), each with its precision's codec, in the order of ``blocks``. A single
        precision whose slots are in block order is read without a gather."""
        if self._single is not None and self.num_blocks:
            buffers = (self._keys if which == "key" else self._values)[self._single]
            run = None if blocks is None else _run(blocks)
            if buffers.size == self.num_blocks and (blocks is None or run):
                # no freed slots: the buffer is the table, a run of blocks a slice of it
                view = buffers.view()
                if run:
                    view = {k: t[:, run[0] : run[1]] for k, t in view.items()}
                return fn(getattr(self.precisions[self._single], f"{which}_codec"), view)
        groups = self._all_groups if blocks is None else self._groups(blocks)
        count = self.num_blocks if blocks is None else len(blocks)
        out = None
        for pid, _, _, where, slots in groups:
            view = (self._keys if which == "key" else self._values)[pid].view()
            codec = getattr(self.precisions[pid], f"{which}_codec")
            part = fn(codec, {k: t[:, slots] for k, t in view.items()})
            if out is None:
                out = part.new_zeros(part.shape[0], count, *part.shape[2:])
            out[:, where] = part
        return out

    def decode(self, which: str, blocks: torch.Tensor | None = None) -> torch.Tensor:
        """FP32 ``[Hkv, m, B, d]`` keys (``which="key"``) or values of ``blocks`` (all by
        default), each block decoded with its own codec."""
        out = self._gather(which, lambda codec, codes: codec.decode(codes), blocks)
        return self._empty(which) if out is None else out

    def channel_bound(self, blocks: torch.Tensor | None = None) -> torch.Tensor:
        """FP32 ``[Hkv, m, d]`` per-channel key bounds of ``blocks`` (0 on exact blocks)."""
        out = self._gather("key", lambda codec, codes: codec.channel_bound(codes), blocks)
        return self._empty("bound") if out is None else out

    def _empty(self, which: str) -> torch.Tensor:
        """An empty decode: leading dims ``[Hkv, 0]``."""
        hkv, block, d = self.num_kv_heads, self.block_size, self.head_dim
        shape = (hkv, 0, d) if which == "bound" else (hkv, 0, block, d)
        return torch.zeros(shape, device=self.device)

    def single(self) -> int | None:
        """The precision id when one precision holds every block in slot order (what the fused
        kernels read in place), else None. An empty table counts as precision 0's."""
        return self._single if self.num_blocks else self._first

    def groups(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(pid, blocks [m], slots [m])`` per precision holding blocks now: device int64
        block indices and their slots in that precision's buffers (cached per table change,
        what the fused kernels walk, one launch per precision)."""
        return [(pid, where, slots) for pid, _, _, where, slots in self._all_groups]

    def view(self, pid: int, which: str, extra: int = 0) -> Blocks:
        """Precision ``pid``'s buffer (``"key"`` or ``"value"``) in slot order, no copy."""
        return (self._keys if which == "key" else self._values)[pid].view(extra)

    def quantized(self, extra: int = 0) -> torch.Tensor:
        """Bool ``[n + extra]`` on the device: the block is held by a lossy precision (not an
        exact window); the ``extra`` appended entries are False (the exact tail block, and the
        empty blocks of a padded layout). A view of one buffer, written in place at every
        change of the table."""
        self._reserve(self.num_blocks + extra)
        return self._lossy[: self.num_blocks + extra]

    def quantized_count(self) -> torch.Tensor:
        """0-d int64 on the device: :meth:`num_quantized`, written in place."""
        return self._lossy_count

    def capacities(self) -> tuple[int, ...]:
        """The lengths of every device buffer a step reads in place (codes of each
        precision, the mask and block lists): any growth reallocates, and changes them."""
        return (self._lossy.numel(), *(b.capacity for b in self._keys + self._values))

    def held(self) -> list[int]:
        """Precision ids holding blocks now (an empty table: the one new blocks start at)."""
        return self._held or [self._first]

    def num_quantized(self) -> int:
        """Blocks held by a lossy precision."""
        return self._num_quantized

    def precision_bytes(self) -> list[int]:
        """Tier-1 bytes (codes and metadata of live blocks) per precision id."""
        counts = torch.bincount(self.precision, minlength=len(self.precisions)).tolist()
        return [(k.block_bytes() + v.block_bytes()) * c if c else 0
                for k, v, c in zip(self._keys, self._values, counts, strict=True)]

    def clone(self) -> BlockTable:
        new = BlockTable.__new__(BlockTable)
        new.__dict__.update(self.__dict__)
        new._keys = [b.clone() for b in self._keys]
        new._values = [b.clone() for b in self._values]
        new._free = [list(f) for f in self._free]
        new.precision, new.slot = self.precision.clone(), self.slot.clone()
        new._held = list(self._held)
        new._lossy, new._lossy_count = self._lossy.clone(), self._lossy_count.clone()
        return new
