"""What the Triton kernels read: the blocks of one precision at a time.

A mixed-precision Tier-1 (:class:`~certkv.cache.blocks.BlockTable`) keeps one buffer per
precision. Each phase is one launch whose programs come in groups, one per precision holding
blocks (:func:`program_groups`; the group's precision a compile-time constant of its branch of
the kernel, its buffers the group's arguments): every group walks that precision's blocks
through an index list (block index, slot in the buffer) and writes its results at the global
block indices, so the outputs are exactly those of one pass over all blocks in block order. The
exact FP16 tail block is one more entry of the last group (read from the store's tail buffer),
or a group of its own without completed blocks.

A group reads one :class:`CodeLayout`:

* ``FP16``: the originals (an exact window, or FP16 values of ``int8_fp16``);
* ``AFFINE``: unsigned ``bits``-wide codes packed ``8 // bits`` per byte along the channels
  (int8 stored as-is at 8 bits), decoded ``(code - bias) * scale + offset`` in FP32 (eq. 3) with
  the scale and offset per channel per block (keys) or per token per channel group (values).

Covered: keys of :class:`~certkv.quant.int8_channel.ChannelAffineKeyCodec` and
:class:`~certkv.quant.kivi.KiviKeyCodec` at 2, 3, 4 or 8 bits, values of
:class:`~certkv.quant.int4_group.GroupAffineValueCodec` at 2, 3, 4 or 8 bits (3-bit codes 8 to
3 bytes, :mod:`certkv.quant.packing`), SmartKV's symmetric codes with a scale per token
(:mod:`certkv.quant.symmetric_token`) at 2, 3, 4 or 8 bits, and FP16 either side.
Evicted blocks' summaries (:mod:`certkv.quant.summary`) need no kernel of their own: keys as
8-bit affine codes that are all zero (one zero row broadcast with stride 0) with the midpoint
``(l + u) / 2`` as offset and the half range as scale, so the kernel's bound ``r_c = a scale +
b |offset|`` with ``(a, b) = (1, u32)`` is the codec's channel bound; values as FP16 blocks
whose every token is the centre (stride 0 over tokens).
The same codecs ECC-protected (:mod:`certkv.quant.protect`) are read after the Triton ECC kernel
decodes their words (:mod:`certkv.kernels.triton_ecc`); blocks that failed the integrity check are
one more FP16 group over their originals (:meth:`TieredKVStore.block_groups`).
InnerQ's groups along the reduced dimension (:mod:`certkv.quant.innerq`: keys per token over
32 channels, values per channel over the block's tokens, asymmetric, symmetric or either per
group, keys with their per-channel exponents) are one more layout (``inner``), and seed 004's
rotation archive (:mod:`certkv.quant.rotation`: per-token affine codes of Hadamard-rotated
coordinates, rotated back in registers by one FP32 matmul with the codec's basis) another
(``subspaces``). KVQuant's archive (seed 004's ``kvquant``) is two more: pre-RoPE keys
(:mod:`certkv.quant.prerope`: the inner per-channel codes decoded, then rotated to post-RoPE
with FP32 cosines and sines of each token's position, ``rope``) and dense-and-sparse values
(:mod:`certkv.quant.outlier_value`: normal-float or affine group codes, then the block's exact
outliers in place, ``codebook`` and ``outliers``). Anything else (erasures to repair without
the integrity check) returns None and the phase runs on the PyTorch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certkv.quant.layout import CodeLayout
from certkv.quant.protect.protection import protected


def key_layout(codec) -> CodeLayout | None:
    """The kernel layout of a key codec (what it declares), or None where the kernels do not
    cover it."""
    return codec.kernel_layout()


def value_layout(codec, head_dim: int) -> CodeLayout | None:
    """The kernel layout of a value codec at ``head_dim``, or None where not covered."""
    return codec.kernel_layout(head_dim)


@dataclass
class BlockSource:
    """One group's blocks (one precision's, or the tail block's).

    ``data``: FP16 originals ``[Hkv, slots, B, d]`` or codes ``[Hkv, slots, B, d * bits / 8]``;
    ``scale``/``offset``: keys ``[Hkv, slots, d]``, values ``[Hkv, slots, B, d / group]`` (None
    for FP16); ``blocks``/``slots``: device int64 ``[m]``, the block indices and their rows in
    ``data``, or None for the tail block (``data [Hkv, 1, B, d]``, at block index
    ``num_completed``); ``counts``: int32 ``[2]``, the store's completed blocks (the tail
    block's column) and tail block fill in device memory
    (:meth:`~certkv.cache.store.TieredKVStore.block_counts`: kernels read them there, so a
    step captured in a graph replays as the tail fills).
    """

    layout: CodeLayout
    data: torch.Tensor
    scale: torch.Tensor | None
    offset: torch.Tensor | None
    blocks: torch.Tensor | None
    slots: torch.Tensor | None
    count: int  # blocks in this launch (host)
    counts: torch.Tensor  # int32 [2]: (completed blocks, tail fill) of the store (device)
    mode: torch.Tensor | None = None  # inner groups: packed symmetric flags [Hkv, slots, bytes]
    norm: torch.Tensor | None = None  # inner groups' keys: int8 channel exponents [Hkv, slots, d]
    basis: torch.Tensor | None = None  # rotated codes: FP32 H D [d, d] (CodeLayout.subspaces)
    aux: tuple | None = None  # outliers / codebook, or rope: see aux_pointers

    @property
    def is_tail(self) -> bool:
        return self.blocks is None

    def inner_pointers(self) -> tuple:
        """``(mode, its strides (kv head, slot), norm, its strides)`` of inner groups (the
        layout's ``inner`` and ``norm``); ``data`` with zero strides where there are none."""
        out = []
        for x in (self.mode, self.norm):
            out += [self.data, 0, 0] if x is None else [x, x.stride(0), x.stride(1)]
        return tuple(out)

    def basis_pointer(self) -> torch.Tensor:
        """The rotation's basis ``[d, d]`` (contiguous) of rotated codes, else ``data``."""
        if self.basis is None:
            return self.data
        assert self.basis.is_contiguous()
        return self.basis

    def aux_pointers(self) -> tuple:
        """``(p0, p1, p2, stride (kv head), stride (slot), count, scalar)``: a dense-and-sparse
        layout's outlier indices and values ``[Hkv, slots, m]`` and codebook levels with ``m``;
        a pre-RoPE layout's block positions ``[Hkv, slots]`` and FP32 cosine and sine tables
        ``[P, d/2]`` with ``d/2`` and the attention scaling; ``data`` with zero strides where
        there are none."""
        if self.aux is None:
            return self.data, self.data, self.data, 0, 0, 0, 0.0
        return self.aux

    def pointers(self) -> tuple[torch.Tensor, ...]:
        """``(data, scale, offset, blocks, slots)`` for a group: what the layout does not read
        (FP16 scales, the tail's index lists) is ``data``, a valid pointer never read."""
        data = self.data
        scale = data if self.layout.fp16 else self.scale
        offset = scale if self.layout.fp16 or self.offset is None else self.offset
        assert data.stride(3) == 1 and scale.stride() == offset.stride()
        if self.is_tail:
            return data, scale, offset, data, data
        return data, scale, offset, self.blocks, self.slots


def block_sources(store, which: str, tail: bool | None = None) -> list[BlockSource] | None:
    """The program groups of one phase over ``store``: one per precision holding blocks (``which``:
    ``"key"`` or ``"value"`` codes), then the exact tail block if any (``tail``: whether to
    add it, even empty; default: when it holds tokens); None when a precision is not covered
    or ``B``/``d`` is not a power of two."""
    if not (_pow2(store.block_size) and _pow2(store.head_dim)):
        return None
    sources = []
    counts = store.block_counts()
    for precision, codes, blocks, slots in store.block_groups(which):
        codec = getattr(precision, f"{which}_codec")
        wrapped = protected(codec)
        if wrapped is not None:  # ECC words: decoded to the inner codec's codes first
            if not wrapped.integrity and store.fault_counts()["erased_words"]:
                return None  # erasures are repaired in the real domain: the reference does it
            codec, codes = wrapped.inner, (_ecc_decoded(wrapped, codes) if "ecc" in codes
                                           else wrapped.inner_blocks(codes))
        layout = (key_layout(codec) if which == "key"
                  else value_layout(codec, store.head_dim))
        if layout is None or (layout.subspaces and min(store.block_size, store.head_dim) < 16):
            return None  # (a rotation is a matmul: tensor tiles of at least 16 on a GPU)
        codes = codec.kernel_blocks(codes, store.block_size)
        data = codes["data"] if layout.fp16 else codes["codes"]
        sources.append(BlockSource(layout, data, codes.get("scale"), codes.get("offset"),
                                   blocks, slots, blocks.shape[0], counts,
                                   codes.get("mode") if layout.inner else None,
                                   codes.get("norm") if layout.norm else None,
                                   codes.get("basis") if layout.subspaces else None,
                                   _aux(codec, layout, codes, data, store)))
    if store.tail_len if tail is None else tail:
        tail = store.tail_buffers()[0 if which == "key" else 1]
        sources.append(BlockSource(CodeLayout(fp16=True), tail.unsqueeze(1), None, None, None,
                                   None, 0, counts))
    return sources


def _aux(codec, layout: CodeLayout, codes: dict, data: torch.Tensor, store) -> tuple | None:
    """:meth:`BlockSource.aux_pointers` of a dense-and-sparse or pre-RoPE layout, else None."""
    if layout.outliers or layout.codebook:
        idx, val = codes["sparse_idx"], codes["sparse_val"]
        m = idx.shape[-1]
        assert idx.stride() == val.stride()
        levels = codes.get("levels", data)
        if not m:  # no outlier: valid pointers never read
            return data, data, levels, 0, 0, 0, 0.0
        return idx, val, levels, idx.stride(0), idx.stride(1), m, 0.0
    if layout.rope:
        pos = codes["pos"]
        cos, sin = codec.rope_tables(store.block_capacity() * store.block_size, store.device)
        return pos, cos, sin, pos.stride(0), pos.stride(1), cos.shape[1], \
            float(codec.rope.attention_scaling)
    return None


def program_groups(sources: list[BlockSource], n: int
                   ) -> list[tuple[BlockSource, BlockSource | None, int, int]]:
    """``(source, tail, entries, walked)`` per program group of a phase's launch over a layout
    of ``n`` block columns: the exact tail block rides along with the last precision's group as
    one more entry, and is a group of its own only when no block is completed. ``entries``
    (host): what the group walks, its blocks and, for the group with the tail, every column
    from the tail block's on: the columns after it are empty blocks (a layout padded to a fixed
    width, whose launches stay the same while blocks complete), which the kernels give a
    block's neutral values (no token: ``-inf`` logits, no mass, ``Delta_b = 0``). ``walked``
    (host): the blocks of the groups before it, so that the group with the tail counts its own
    blocks on the device as the store's completed blocks less those (the groups partition the
    completed blocks)."""
    if len(sources) > 1 and sources[-1].is_tail:
        pairs = [(src, None) for src in sources[:-2]] + [(sources[-2], sources[-1])]
    else:
        pairs = [(src, None) for src in sources]
    plan, walked = [], 0
    for src, tail in pairs:
        carries = carries_tail(src, tail)
        plan.append((src, tail, n - walked if carries else src.count, walked))
        walked += src.count
    return plan


def kernel_groups(plan: list, split: int) -> tuple[tuple, tuple, int]:
    """Both phases' per-group launch arguments from the ``plan`` of :func:`program_groups`:
    ``(groups, layouts, programs)``. Group ``k`` holds the programs ``[first, end)`` (``split``
    blocks each) that walk plan entry ``k`` and what they read: ``(first, end, codes, scale,
    offset, blocks, slots, codes' strides (kv head, slot, token), scale's strides (kv head,
    slot, token), entries, blocks walked before, the key bound's (a, b), then inner groups'
    mode flags and channel exponents with their strides (:meth:`BlockSource.inner_pointers`),
    then a rotation's basis (:meth:`BlockSource.basis_pointer`), then the outliers' or the
    rotary tables' bundle (:meth:`BlockSource.aux_pointers`) and the pre-RoPE inner codes'
    slack (a, b))``; its layout ``(FP16, BITS, BIAS, GROUP, TAIL, CARRIES, TOKEN, INNER, NORM,
    ROT, CODEBOOK, OUTLIERS, ROPE)`` is a compile-time constant of the group's branch of the
    kernel (:class:`CodeLayout`; ``ROT`` its ``subspaces``)."""
    groups, layouts, first = [], [], 0
    for src, tail, live, walked in plan:
        lay = src.layout
        data, scale, offset, blocks, slots = src.pointers()
        end = first + -(-live // split)
        groups.append((first, end, data, scale, offset, blocks, slots, *data.stride()[:3],
                       *scale.stride()[:3], live, walked, float(lay.bound[0]),
                       float(lay.bound[1]), *src.inner_pointers(), src.basis_pointer(),
                       *src.aux_pointers(), float(lay.slack[0]), float(lay.slack[1])))
        layouts.append((lay.fp16, lay.bits, lay.bias, lay.group, src.is_tail,
                        carries_tail(src, tail), lay.token_scale, lay.inner, lay.norm,
                        lay.subspaces, lay.codebook, lay.outliers, lay.rope))
        first = end
    return tuple(groups), tuple(layouts), first


GROUP_FIELDS = 33  # the fields of one group's arguments (kernel_groups)


def batch_groups(plans: list[list], split: int) -> tuple[list[tuple], tuple, int, list[int]]:
    """:func:`kernel_groups` over a batch's sequences (one ``plan`` each, from
    :func:`program_groups`): ``(fields, layouts, programs, each)``. The launch's groups are
    every layout any sequence walks (the union, in the order of first appearance: a batch of
    one keeps its own order); ``fields[s]``: sequence ``s``'s arguments for them, group after
    group (:data:`GROUP_FIELDS` each, for records: :mod:`~certkv.kernels.records`), a group the
    sequence does not walk given no programs (``first = end = 0``) and pointers never read;
    ``programs``: the most any sequence launches, ``each``: each sequence's."""
    per = [kernel_groups(plan, split) for plan in plans]
    union: list[tuple] = []  # a layout repeated within a sequence takes its own slot
    template: dict = {}
    for groups, layouts, _ in per:
        seen: dict = {}
        for group, layout in zip(groups, layouts, strict=True):
            slot = (layout, seen.get(layout, 0))
            seen[layout] = slot[1] + 1
            if slot not in template:
                union.append(slot)
                template[slot] = group
    fields = []
    for groups, layouts, _ in per:
        own, seen = {}, {}
        for group, layout in zip(groups, layouts, strict=True):
            own[(layout, seen.get(layout, 0))] = group
            seen[layout] = seen.get(layout, 0) + 1
        row: list = []
        for slot in union:
            row += own[slot] if slot in own else _no_programs(template[slot])
        fields.append(tuple(row))
    return fields, tuple(layout for layout, _ in union), max(p for *_, p in per), \
        [p for *_, p in per]


def _no_programs(group: tuple) -> tuple:
    """A group's fields with no program (``first = end = 0``), no pointer (never read) and
    zeros, of the kinds of ``group``'s."""
    return (0, 0, *(None if isinstance(x, torch.Tensor) else type(x)(0) for x in group[2:]))


def tail_data(plan: list) -> torch.Tensor:
    """The exact tail block's FP16 buffer ``[Hkv, 1, B, d]`` that a group of ``plan`` carries
    (or, where none does, a tensor the kernels never read there)."""
    return next((tail.data for _, tail, _, _ in plan if tail is not None), plan[-1][0].data)


def carries_tail(src: BlockSource, tail: BlockSource | None) -> bool:
    """Whether a group walks the tail block (and the empty blocks after it)."""
    return tail is not None or src.is_tail


def _ecc_decoded(codec, codes):
    """A protected precision's buffers with their words decoded to the inner codec's codes by
    the Triton ECC kernel (:mod:`certkv.kernels.triton_ecc`)."""
    from certkv.kernels.triton_ecc import decode_words

    _, padded = codec.nibble_count()
    return codec.assemble(codes, decode_words(codec.code, codes["ecc"], padded))


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0
