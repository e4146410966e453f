"""Certified decode steps captured once and replayed (issue 24: static shapes, CUDA graphs).

A layer's certified step on the device path reads no host value (``tests/test_host_reads``), so its
launches can be captured once and replayed while nothing it takes from the host changes.
:class:`GraphedAttention` pads its steps' layouts to the store's block capacity
(:attr:`CertifiedAttention.pad_layout`: the tail block's column, then empty blocks), so that a
step's launches and shapes stay the same while the tail fills and blocks complete, until one of
the store's buffers grows: a bucket (:meth:`~certkv.cache.store.TieredKVStore.graph_signature`).
Inside a bucket every kernel reads the completed-block count and the tail block's fill from
device memory (:meth:`~certkv.cache.store.TieredKVStore.block_counts`), selection reads the
quantized-block count there, the store (its mask, block lists, maxima), the scratch cache's
tables and the non-finite flags are updated in place, and the arithmetic bound's coefficients
are those of the layout's ``n B`` token slots (valid for any fill:
:func:`certkv.certify.arith.step_coefficients` grows with both counts). A replayed certificate
gets the one host field that changes inside a bucket, the quantized block count, from the store.
Each layer's first step of a bucket runs eagerly, the second is captured and the rest replay.
The eager step does what a bucket does once and keeps (kernel compiles, memoised coefficients
copied to the device, the scratch cache's device tables resized): inside a capture that work
would be recorded and every replay would redo it, restoring the tables as they were (a test
shows it).

:class:`GraphedDecode` captures a model's whole decode step the same way: every layer's
projections and MLP around the step, and the token's append, which writes at positions read from
device memory (:meth:`~certkv.cache.store.TieredKVStore.append_in_place`). A token that fills the
tail block leaves it full (the stores' ``defer_commit``), and the block is quantized between
steps, before the next one (:meth:`~certkv.cache.store.TieredKVStore.flush_tail`, on the host),
so that every step of a bucket after its first two replays.

Two graphs with one protocol (``capture(fn) -> outputs``, ``replay()``):

* :class:`CudaGraph`: ``torch.cuda.CUDAGraph`` (one memory pool shared by every layer's graph).
* :class:`RecordedGraph`: the same semantics on any device, for tests and the Triton
  interpreter: capture runs ``fn`` once and records its aten operators and Triton launches;
  replay re-runs them on the tensors captured (results copied into the captured outputs),
  with every Python value baked in as captured. A step that passed a per-step Python value
  (a fill count, a token count) to a kernel replays stale, and comparing a replay with an
  eager step shows it on a CPU. Host reads during capture raise, as on CUDA.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from certkv.errors import ConfigError, require
from certkv.kernels.launch_hooks import wrap_triton_launches

# aten operators that wait for the device (a value or a data-dependent shape read on the host)
_HOST_READS = frozenset({torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
                         torch.ops.aten.nonzero.default})


class GraphCaptureError(RuntimeError):
    """The step cannot be replayed as captured: it read the host, or a replayed operator's
    output changed shape (a data-dependent shape)."""


class _Recorder(TorchDispatchMode):
    """Appends every top-level aten operator (outside Triton launches) to ``tape`` as
    ``("aten", func, args, kwargs, outputs)`` (:func:`_record_triton` adds the launches as
    ``("triton", launch, args, kwargs, None)``)."""

    def __init__(self, tape: list) -> None:
        super().__init__()
        self.tape = tape
        self.inside_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.inside_kernel:
            return func(*args, **kwargs)
        if func in _HOST_READS:
            raise GraphCaptureError(f"a captured step made a host read ({func}); a CUDA "
                                    f"graph cannot hold one.")
        out = func(*args, **kwargs)
        self.tape.append(("aten", func, args, kwargs, out))
        return out


class RecordedGraph:
    """CUDA-graph semantics on any device (see the module): :meth:`capture` runs ``fn`` once,
    recording it; :meth:`replay` repeats what it recorded on the same tensors."""

    def __init__(self) -> None:
        self.tape: list = []

    def capture(self, fn: Callable):
        import certkv.step as module

        recorder = _Recorder(self.tape)
        restore, read = _record_triton(recorder), module.to_host

        def refused(x):  # on a CPU a host read is no aten operator: the step's one gateway
            raise GraphCaptureError("a captured step made a host read (certkv.attention."
                                    "to_host); a CUDA graph cannot hold one.")

        module.to_host = refused
        try:
            with recorder:
                return fn()
        finally:
            restore()
            module.to_host = read

    def replay(self) -> None:
        for kind, fn, args, kwargs, out in self.tape:
            if kind == "triton":
                fn(*args, **kwargs)
                continue
            fresh = fn(*args, **kwargs)
            _copy_into(out, fresh, args, fn)


def _copy_into(captured, fresh, args, fn) -> None:
    """Write a replayed operator's ``fresh`` outputs into the ``captured`` ones (their storage
    is what later operators read), except outputs that share storage with an input: views and
    in-place results, which replaying already updated."""
    inputs = {t.untyped_storage().data_ptr() for t in tree_leaves(args)
              if isinstance(t, torch.Tensor)}
    for old, new in zip(tree_leaves(captured), tree_leaves(fresh), strict=True):
        if not isinstance(old, torch.Tensor) or old.untyped_storage().data_ptr() in inputs:
            continue
        if old.numel() != new.numel():  # (a later in-place view op may reshape ``old``)
            raise GraphCaptureError(f"{fn} returned shape {tuple(new.shape)} on replay, "
                                    f"{tuple(old.shape)} when captured (a data-dependent shape).")
        old.copy_(new.reshape(old.shape))


def _record_triton(recorder: _Recorder):
    """Record each Triton launch (and not the interpreter's own aten operators inside it);
    returns the function that restores Triton's launch methods."""
    def recorded(kernel, launch, args, kwargs):
        def run(*a, **k):
            recorder.inside_kernel += 1
            try:
                return launch(*a, **k)
            finally:
                recorder.inside_kernel -= 1
        recorder.tape.append(("triton", run, args, kwargs, None))
        return run(*args, **kwargs)
    return wrap_triton_launches(recorded)


class CudaGraph:
    """``torch.cuda.CUDAGraph`` in the protocol above; graphs made with one ``pool`` share
    their memory (one layer's step runs at a time)."""

    def __init__(self, pool, generators=()) -> None:
        self.graph, self.pool = torch.cuda.CUDAGraph(), pool
        for generator in generators:  # draws advance on every replay
            self.graph.register_generator_state(generator)

    def capture(self, fn: Callable):
        kept = self.kept = []  # every launch's arguments, as long as the graph replays them:
        # a kernel's records (:mod:`certkv.kernels.records`) are kept only by a cache

        def keep(kernel, launch, args, kwargs):
            kept.append((args, kwargs))
            return launch(*args, **kwargs)

        restore = wrap_triton_launches(keep)
        try:
            with torch.cuda.graph(self.graph, pool=self.pool):
                out = fn()
        finally:
            restore()
        self.graph.replay()  # capture only records: this step's results come from a replay
        return out

    def replay(self) -> None:
        self.graph.replay()


@dataclasses.dataclass
class _Captured:
    signature: tuple
    graph: object | None = None
    inputs: tuple = ()  # the tensors a replay's inputs are copied into
    outputs: _Packed | None = None
    layers: tuple = ()  # GraphedDecode: (layer, a batch's) of each captured record


def _new_graph(graph: Callable | None, attention, pool_owner) -> object:
    """A graph to capture into: ``graph()`` where a graph class is given, else a
    :class:`CudaGraph` in ``pool_owner``'s memory pool (made at the first capture) that also
    advances ``attention``'s CUDA draws (the ladder's exploration) at every replay."""
    if graph is not None:
        return graph()
    if pool_owner._pool is None:
        pool_owner._pool = _memory_pool()
    generators = [g for g in getattr(attention.ladder, "_generators", {}).values()
                  if g.device.type == "cuda"]
    return CudaGraph(getattr(pool_owner._pool, "id", pool_owner._pool), generators)


def _memory_pool():
    """The graphs' shared memory pool, alive as long as its owner.

    A bare ``graph_pool_handle()`` lives only while a graph captured into it lives: when a
    new bucket replaces the last one's graph, the pool's count of graphs falls to zero while
    it still holds blocks, and the next capture into it fails inside PyTorch's allocator
    (``use_count > 0 INTERNAL ASSERT``, seen on an H200 with torch 2.11). A ``MemPool``
    counts as a user of its pool for as long as the object lives."""
    make = getattr(torch.cuda, "MemPool", None)
    return make() if make is not None else torch.cuda.graph_pool_handle()


def _needs_cuda(graph, device: torch.device) -> None:
    require(graph is not None or device.type == "cuda", ConfigError,
            "graphs capture CUDA graphs and need a CUDA device; set graphs=false "
            "(certkv bench decode: --graphs off).")


class GraphedAttention:
    """A :class:`~certkv.CertifiedAttention` whose steps are captured per store and bucket
    and replayed (see the module); it turns the attention's :attr:`pad_layout` on. Call it
    as the attention itself; everything else (``mode``,
    ``synchronize``, ...) is the wrapped attention's.

    Args:
        attention: the wrapped attention; a step it cannot capture (off the device path,
            :meth:`CertifiedAttention.graph_ready`; a store whose layout can change at any
            step, :meth:`CertifiedAttention.graph_layout`) runs eagerly.
        graph: the graph class: :class:`CudaGraph` on CUDA (default), :class:`RecordedGraph`
            elsewhere (tests).
    """

    def __init__(self, attention, graph: Callable | None = None) -> None:
        self.attention = attention
        attention.pad_layout = True  # one capture per bucket of block counts, not per block
        self.graph = graph
        # per store (a store freed with its cache takes its graph along; a new store never
        # meets another's graph)
        self._steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._pool = None
        self._failed = False
        self.captures = self.replays = 0

    def __getattr__(self, name):
        return getattr(self.attention, name)

    @property
    def timer(self):
        """The wrapped attention's phase timer; while one is set, steps run eagerly (a timed
        phase synchronises, which a graph cannot hold, and a replay has no phases)."""
        return self.attention.timer

    @timer.setter
    def timer(self, timer) -> None:
        self.attention.timer = timer

    def __call__(self, q, store, scaling=None, scratch=None):
        attention = self.attention
        _needs_cuda(self.graph, q.device)
        if self._failed or attention.timer is not None or not attention.graph_ready(q, store):
            return attention(q, store, scaling, scratch)
        key = attention.graph_layout(store)
        if key is None:
            return attention(q, store, scaling, scratch)
        key = (*key, id(scratch))
        step = self._steps.get(store)
        if step is None or step.signature != key:  # a new bucket: one eager step first
            self._steps[store] = _Captured(key)
            return attention(q, store, scaling, scratch)
        if step.graph is None:
            return self._capture(step, q, store, scaling, scratch)
        step.inputs[0].copy_(q)
        step.graph.replay()
        self.replays += 1
        out, (cert,) = step.outputs.copied()
        cert.num_blocks = store.num_quantized()  # its one host field that changes in a bucket
        return out, cert

    def _capture(self, step: _Captured, q, store, scaling, scratch):
        graph = _new_graph(self.graph, self.attention, self)
        static_q = q.detach().clone()
        try:
            step.outputs = graph.capture(
                lambda: _Packed(*self.attention(static_q, store, scaling, scratch)))
        except (GraphCaptureError, RuntimeError) as err:  # run eagerly from now on
            self._failed = True
            warnings.warn(f"capturing a certified step failed ({err}); graphs are off for "
                          f"this run, steps run eagerly.", RuntimeWarning, stacklevel=3)
            return self.attention(q, store, scaling, scratch)
        step.graph, step.inputs = graph, (static_q,)
        self.captures += 1
        out, (cert,) = step.outputs.copied()
        return out, cert


class _Packed:
    """A step's output and certificates packed, inside the captured step, into one flat
    buffer per dtype: a replay's results are then copied out of the graph (whose next replay
    overwrites them) in one copy per dtype (three or four) instead of one per tensor (about
    25 launches per layer step on a GPU), and unpacked as views of the copies."""

    def __init__(self, out: torch.Tensor, *certs) -> None:
        self.out, self.certs = out, certs  # the certificates' other fields: bucket constants
        self.tensors = [out, *(t for cert in certs for t in cert.tensors())]
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in self.tensors:
            groups.setdefault(t.dtype, []).append(t.reshape(-1))
        self.buffers = {dtype: torch.cat(parts) for dtype, parts in groups.items()}

    def copied(self) -> tuple:
        """``(out, [Certificate, ...])`` of a replayed step as new tensors: views of one copy
        of each buffer."""
        buffers = {dtype: buffer.clone() for dtype, buffer in self.buffers.items()}
        offsets = dict.fromkeys(buffers, 0)
        views: dict[int, torch.Tensor] = {}  # id of a captured tensor -> its copy
        for t in self.tensors:
            start = offsets[t.dtype]
            offsets[t.dtype] = start + t.numel()
            views[id(t)] = buffers[t.dtype][start:offsets[t.dtype]].view(t.shape)
        return views[id(self.out)], [cert.mapped(lambda t: views[id(t)], blocks=True)
                                     for cert in self.certs]


class GraphedDecode:
    """A transformers model's decode step over a :class:`~certkv.models.hf_cache.TieredCache`
    (one sequence or a batch) captured whole, once per bucket, and replayed: every layer's
    projections, the token's append, the certified attention and the MLP, then the logits
    (issue 24: a whole-model decode step in one graph; see the module for the buckets).

    A step is captured when every layer's store is graphable and its attention step reads
    no host value (:meth:`CertifiedAttention.graph_layout`, :meth:`~CertifiedAttention.
    graph_ready`): each layer then writes the token's keys and values at positions read from
    device memory (:meth:`~certkv.cache.store.TieredKVStore.append_in_place`), the position
    comes from a device buffer and the attention mask is left out (a certified decode step
    attends to every cached token; certkv's attention never reads a decode step's mask). The
    cache's stores keep a tail block that fills until the next step (``defer_commit``), which
    quantizes it before its forward (:meth:`~certkv.cache.store.TieredKVStore.flush_tail`,
    eager host work once in ``B`` steps per layer), so the step whose token fills a block
    replays too. The other steps run eagerly: a bucket's first step, and every step while the
    attention has a phase timer. A replay then logs each layer's certificate, as the eager
    step does. A batch (a cache of several sequences, :meth:`~certkv.models.hf_cache.
    TieredCache.batch_of`) is captured the same way: each sequence's token appended in place
    to its own stores, its position from a device buffer (the batch's ``position_ids``), one
    certified step per sequence and layer (:meth:`CertifiedAttention.batch`), a certificate
    per sequence; the bucket covers every sequence's stores (one leaving starts a new one).

    Args:
        model: the model, with the certkv attention (:func:`certkv.models.enable`).
        cache: its cache; its attention (a :class:`GraphedAttention`'s wrapped one, which
            becomes the cache's: one layer's step is not captured inside another capture) pads
            its layouts (:attr:`CertifiedAttention.pad_layout`), and its stores defer their
            commits (:attr:`~certkv.models.hf_cache.TieredCache.defer_commit`).
        graph: the graph class: :class:`CudaGraph` on CUDA (default), :class:`RecordedGraph`
            elsewhere (tests).
    """

    def __init__(self, model, cache, graph: Callable | None = None) -> None:
        self.model, self.cache, self.graph = model, cache, graph
        attention = cache.attention
        self.attention = attention.attention if isinstance(attention, GraphedAttention) \
            else attention
        self.attention.pad_layout = True
        cache.attention = self.attention
        cache.defer_commit = True  # an in-place append never quantizes a block
        self._step: _Captured | None = None
        self._pool = None
        self.captures = self.replays = self.steps = 0

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, 1, vocab]`` of decoding ``ids [B, 1]`` (int64 token ids on the model's
        device, one per sequence of the cache) with the cache, which takes the tokens;
        ``positions [B]``: each sequence's position (a batch's shorter sequences count from
        their own first token, as the batch's ``position_ids``; default: the cache's length)."""
        _needs_cuda(self.graph, ids.device)
        self.steps += 1
        for store in self.cache.stores():  # the block the last token filled, quantized now
            store.flush_tail()
        if positions is None:
            positions = torch.full((ids.shape[0],), self.cache.get_seq_length(),
                                   dtype=torch.long, device=ids.device)
        key = self._signature(ids)
        step = self._step
        if key is None:
            return self._forward(ids, position_ids=positions[:, None])
        if step is None or step.signature != key:  # a new bucket: one eager step first
            self._step = _Captured(key)
            return self._forward(ids, position_ids=positions[:, None])
        if step.graph is None:
            return self._capture(step, ids, positions)
        static_ids, static_positions, cache_position = step.inputs
        static_ids.copy_(ids)
        static_positions.copy_(positions[:, None])
        cache_position.fill_(self.cache.get_seq_length())
        step.graph.replay()
        self.replays += 1
        self.cache.advance_replayed()
        return self._logged(step)

    def _signature(self, ids: torch.Tensor) -> tuple | None:
        """What the step's capture depends on (every sequence's and layer's
        :meth:`CertifiedAttention.graph_layout`), or None for a step that runs eagerly."""
        attention, stores = self.attention, self.cache.stores()
        sequences = len(self.cache.layers[0].stores) if self.cache.layers else 0
        if attention.timer is not None or ids.shape != (sequences, 1) \
                or any(store is None for store in stores):
            return None
        probe = torch.empty(0, dtype=self.model.dtype, device=ids.device)  # the queries' dtype
        if not all(attention.graph_ready(probe, store) for store in stores):
            return None
        layouts = tuple(attention.graph_layout(store) for store in stores)
        return None if None in layouts else (layouts, ids.device)

    def _forward(self, ids: torch.Tensor, **kwargs):
        from certkv.models import cache_kwargs

        return self.model(input_ids=ids, use_cache=True, **cache_kwargs(self.model, self.cache),
                          **kwargs).logits

    def _capture(self, step: _Captured, ids: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        static_ids, static_positions = ids.clone(), positions[:, None].clone()
        position = torch.full((1,), cache.get_seq_length(), dtype=torch.long, device=ids.device)
        graph = _new_graph(self.graph, self.attention, self)
        collected: list = []

        def decode() -> _Packed:
            cache.captured = collected
            try:
                logits = self._forward(static_ids, position_ids=static_positions,
                                       cache_position=position)
            finally:
                cache.captured = None
            return _Packed(logits, *(cert for _, certs in collected
                                     for cert in _certificates(certs)))

        try:
            step.outputs = graph.capture(decode)
        except (GraphCaptureError, RuntimeError) as err:
            raise GraphCaptureError(
                f"capturing a decode step failed ({err}); the cache now holds the token in "
                f"part: decode this sequence again with graphs=false.") from err
        step.graph, step.inputs = graph, (static_ids, static_positions, position)
        step.layers = tuple((layer, isinstance(certs, list)) for layer, certs in collected)
        self.captures += 1
        return self._logged(step)

    def _logged(self, step: _Captured) -> torch.Tensor:
        """The captured step's logits and certificates as new tensors, the certificates
        logged as the eager step logs them (a batch's layer: one per sequence)."""
        logits, certs = step.outputs.copied()
        certs = iter(certs)
        for index, batched in step.layers:
            layer = self.cache.layers[index]
            mine = [next(certs) for _ in layer.stores] if batched else [next(certs)]
            for cert, store in zip(mine, layer.stores, strict=True):
                cert.num_blocks = store.num_quantized()  # the one host field a bucket changes
            if batched:
                layer.record_batch(mine)
            else:
                layer.record(mine[0])
        return logits


def _certificates(logged) -> list:
    """A captured layer's certificates: one, or a batch's (one per sequence)."""
    return logged if isinstance(logged, list) else [logged]
