"""The evaluation protocol (paper 8) as a small public API, free of Hydra (``certkv bench`` runs
where only torch, transformers, typer and rich are installed).

One dense prefill of a prompt with the model's own cache is shared by every method; each method
then decodes from the last prompt token on its own copy, so the first predicted token already
comes from the method under test. The dense method keeps the model's own cache and SDPA in the
model's dtype (what a user would run instead); quantized methods get a
:class:`~certkv.models.hf_cache.TieredCache` built from the same prefill states::

    lm = load_model(SMOLLM2)
    ids = lm.tokenizer.encode(prompt, add_special_tokens=False)
    shared = Prefill(lm, ids[:-1])
    for method in (Method.build("dense", "dense"), Method.build("certified")):
        session = shared.session(method)
        answer = session.decoder().generate(ids[-1], max_new_tokens=32)  # stops at EOS
        print(method.name, lm.tokenizer.decode(answer), session.certificate_record()["steps"])

``model.generate(ids, past_key_values=TieredCache(...))`` also works, but there the dense prefill
produces the first answer token; the protocol above makes every answer token a method step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from certkv.attention import MODES, CertifiedAttention
from certkv.certify.ladder import Ladder
from certkv.certify.select import AdaptiveTopK
from certkv.certify.values import LocalThreshold
from certkv.errors import CertKVError, ConfigError, require
from certkv.eval.hf_quantized import MODE as HF_MODE
from certkv.eval.hf_quantized import HFQuantized
from certkv.eval.press import MODE as PRESS_MODE
from certkv.eval.press import KVPress
from certkv.evict.base import EvictionPolicy
from certkv.graphs import GraphedAttention, GraphedDecode
from certkv.models.hf_cache import CacheSpec, CacheTelemetry, TieredCache
from certkv.models.hook import cache_kwargs, recording_prompt_queries
from certkv.models.loading import LoadedModel
from certkv.quant import KVQuantizer
from certkv.quant.protect.protection import Protection
from certkv.quant.rope import rope_spec


@dataclass
class Method:
    """One method compared on the same prompts: a name, a mode, the attention and the Tier-1
    quantizer. :meth:`build` makes one from plain Python; the runner builds them from Hydra."""

    name: str
    mode: str
    attention: CertifiedAttention
    quantizer: KVQuantizer = field(default_factory=KVQuantizer)
    protect: Protection | None = None  # codes, integrity check and faults of Tier-1
    evict: EvictionPolicy | None = None  # which blocks keep only a summary in Tier-1
    hf_cache: HFQuantized | None = None  # mode=hf_quantized: transformers' QuantizedCache
    press: KVPress | None = None  # mode=kvpress: a kvpress press, run in kvpress's own venv

    def __post_init__(self) -> None:
        require(self.mode in EVAL_MODES, ConfigError,
                f"method {self.name!r} has mode={self.mode!r}; use one of {list(EVAL_MODES)}.")
        if self.mode == HF_MODE:  # the model's own attention over transformers' cache
            self.hf_cache = self.hf_cache or HFQuantized()
            self.hf_cache.check_installed()
        if self.mode == PRESS_MODE:
            self.press = self.press or KVPress()
        self.quantizer = self.quantizer.for_mode(attention_mode(self.mode))
        if self.mode in MODES and self.mode != "dense":
            self.quantizer = self.quantizer.with_protection(self.protect)
            self.quantizer = self.quantizer.with_eviction(self.evict)

    @classmethod
    def build(cls, name: str = "certified", mode: str = "certified", *,
              quantizer: KVQuantizer | None = None, selector: AdaptiveTopK | None = None,
              value_policy: object | None = None, ladder: Ladder | None = None,
              backend: object = "auto", compile: bool | str | None = None,
              protect: Protection | None = None, evict: EvictionPolicy | None = None,
              graphs: bool = False, hf_cache: HFQuantized | None = None,
              press: KVPress | None = None) -> Method:
        """A method with the paper's defaults (Table 2) for anything not given; ``graphs``:
        each layer's step captured in a CUDA graph (:class:`~certkv.graphs.GraphedAttention`),
        and a :class:`Decoder`'s whole decode steps (:class:`~certkv.graphs.GraphedDecode`)."""
        attention = CertifiedAttention(selector or AdaptiveTopK(),
                                       value_policy or LocalThreshold(), ladder or Ladder(),
                                       backend, attention_mode(mode), compile=compile)
        if graphs and mode not in FOREIGN_MODES:  # another tool's cache: its own code
            attention = GraphedAttention(attention)
        return cls(name, mode, attention, quantizer or KVQuantizer(), protect, evict, hf_cache,
                   press)


FOREIGN_MODES = (HF_MODE, PRESS_MODE)  # another tool's cache under the model's own attention
EVAL_MODES = (*MODES, *FOREIGN_MODES)  # what a compared method may be


def attention_mode(mode: str) -> str:
    """The :class:`CertifiedAttention` mode of a method's ``mode`` (``hf_quantized`` and
    ``kvpress`` decode with the model's own attention, as dense does)."""
    return "dense" if mode in FOREIGN_MODES else mode


class Decoder:
    """Feeds tokens through the model with one cache; times each decode step.

    :meth:`close` (or leaving a ``with`` block) frees the cache and keeps its telemetry (step
    times, certificate log, bytes, scratch counters): a task that asks many questions of one
    document holds one cache at a time instead of one per question."""

    def __init__(self, lm: LoadedModel, cache, on_step=None) -> None:
        self.lm, self.cache, self.tokenizer = lm, cache, lm.tokenizer
        self.on_step = on_step  # called after every decode step (a run's progress)
        attention = getattr(cache, "attention", None)
        # a method with graphs: its whole decode steps captured and replayed
        self.graph = GraphedDecode(lm.model, cache, attention.graph) \
            if isinstance(attention, GraphedAttention) else None
        self.step_ms: list[float] = []
        self.telemetry: CacheTelemetry | None = None

    def __enter__(self) -> Decoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Free the cache, keeping its telemetry (idempotent)."""
        if isinstance(self.cache, TieredCache):
            self.telemetry = self.cache.telemetry()
        self.cache = None

    def cache_telemetry(self) -> CacheTelemetry | None:
        """The telemetry of a certkv cache, open or closed (None for the model's own cache)."""
        if isinstance(self.cache, TieredCache):
            return self.cache.telemetry()
        return self.telemetry

    def _ids(self, ids: list[list[int]]) -> torch.Tensor:
        require(self.cache is not None, CertKVError,
                "this decoder is closed; ask the session for a fresh one with "
                "session.decoder().")
        return torch.tensor(ids, device=self.lm.device)

    def _forward(self, ids: torch.Tensor, **kwargs):
        cache = cache_kwargs(self.lm.model, self.cache)
        return self.lm.model(input_ids=ids, use_cache=True, **cache, **kwargs)

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        """Decode ``token`` (one step of the method); returns FP32 logits ``[vocab]``."""
        ids = self._ids([[token]])
        _sync(self.lm.device)
        start = time.perf_counter()
        logits = self._forward(ids).logits if self.graph is None else self.graph(ids)
        _sync(self.lm.device)
        self.step_ms.append(1e3 * (time.perf_counter() - start))
        if self.on_step is not None:
            self.on_step()
        return logits[0, -1].float()

    @torch.inference_mode()
    def feed(self, ids: list[int]) -> None:
        """Prefill more prompt tokens densely (e.g. a question after a shared document); not
        decode steps, not timed."""
        if ids:
            self._forward(self._ids([ids]), logits_to_keep=1)

    def generate(self, first: int, max_new_tokens: int) -> list[int]:
        """Greedy decoding from the prompt's last token ``first``: at most ``max_new_tokens``
        tokens, stopping after an end-of-sequence token (which is not returned)."""
        stop = end_of_sequence_ids(self.lm)
        token, out = first, []
        for _ in range(max_new_tokens):
            token = int(self.step(token).argmax())
            if token in stop:
                break
            out.append(token)
        return out


def end_of_sequence_ids(lm: LoadedModel) -> set[int]:
    """The model's end-of-sequence ids (generation config and tokenizer)."""
    ids: set[int] = set()
    for source in (getattr(lm.model, "generation_config", None), lm.tokenizer):
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    return ids


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Prefill:
    """The dense prefill of ``prefix`` (token ids) with the model's own cache, in its dtype;
    :meth:`session` gives each method its own copy."""

    @torch.inference_mode()
    def __init__(self, lm: LoadedModel, prefix: list[int], queries: int = 0) -> None:
        """``queries``: record each layer's last ``queries`` prompt queries (for SnapKV)."""
        self.lm, self.length = lm, len(prefix)
        cache = DynamicCache()
        with recording_prompt_queries(queries) as self.queries:
            if prefix:
                lm.model(input_ids=torch.tensor([prefix], device=lm.device),
                         use_cache=True, logits_to_keep=1, **cache_kwargs(lm.model, cache))
        layers = getattr(cache, "layers", [])
        self.states = [(layer.keys, layer.values) if getattr(layer, "keys", None) is not None
                       else None for layer in layers]
        self.states += [None] * (lm.num_layers - len(self.states))
        self.rope = rope_spec(lm.model)  # for position-dependent (pre-RoPE) key codecs
        self._templates: dict[str, TieredCache] = {}  # the last quantized prefill, by quantizer

    def cache_for(self, method: Method, spec: CacheSpec | None = None):
        """A fresh cache holding the prefill for ``method``: the model's own cache for the dense
        method, a :class:`TieredCache` of the FP16 originals for the others (quantized once for a
        run of methods with the same quantizer, keyed by its ``repr``, and copied for each
        method: :meth:`TieredCache.copy_for`; only the last quantizer's is kept; by decoded
        mirror too, :meth:`CertifiedAttention.decoded_mirror`). The quantizer
        gets the model's rotary embedding (:meth:`KVQuantizer.with_rope`)."""
        if method.mode == HF_MODE:
            return method.hf_cache.cache(self.lm.model.config, self.states)
        require(method.mode != PRESS_MODE, ConfigError,
                f"method {method.name!r} (mode={PRESS_MODE}) runs in kvpress's own venv, not "
                "in this process; run it through `certkv run` (see certkv.eval.press).")
        if method.mode == "dense":
            cache = DynamicCache()
            with torch.inference_mode():
                for i, state in enumerate(self.states):
                    if state is not None:
                        cache.update(state[0].clone(), state[1].clone(), i)
            return cache
        quantizer = method.quantizer.with_rope(self.rope)
        # the stores' decoded mirror is the attention backend's choice (a lean one for the
        # numba loops): a template serves the methods that keep the same one
        key = f"{quantizer!r} {method.attention.decoded_mirror(self.lm.device)!r}"
        if key not in self._templates:
            # one template at a time: a run's variants of one quantizer come together, and
            # every template of a long prompt held at once would not fit in memory
            self._templates.clear()
            self._templates[key] = TieredCache.from_states(self.states, method.attention,
                                                           quantizer, spec or CacheSpec(),
                                                           self.queries)
        return self._templates[key].copy_for(method.attention, spec or CacheSpec())

    def session(self, method: Method, spec: CacheSpec | None = None) -> Session:
        return Session(self, method, spec or CacheSpec())


class Session:
    """One method on one prefilled prompt: :meth:`decoder` gives a fresh decoder on a fresh
    copy of the prefill each time (a task may ask several questions of one document); the
    session gathers their step times and certificates."""

    def __init__(self, prefill: Prefill, method: Method, spec: CacheSpec) -> None:
        self.prefill, self.method, self.spec = prefill, method, spec
        self.decoders: list[Decoder] = []
        self.on_step = None  # given to every decoder (a run's progress)

    def decoder(self) -> Decoder:
        decoder = Decoder(self.prefill.lm, self.prefill.cache_for(self.method, self.spec),
                          self.on_step)
        self.decoders.append(decoder)
        return decoder

    @property
    def step_ms(self) -> list[float]:
        return [ms for d in self.decoders for ms in d.step_ms]

    def telemetry(self) -> list[CacheTelemetry]:
        """The certkv caches' telemetry of every decoder, open or closed (none for dense)."""
        found = (d.cache_telemetry() for d in self.decoders)
        return [t for t in found if t is not None]

    def certificate_record(self) -> dict:
        """Per-step certificate telemetry of every decoder (paper Tables 11, 12, 15): empty for
        the dense method, which runs the model's own attention."""
        return certificate_record(self.telemetry())


_STEP_FIELDS = ("e_key", "e_val", "e_arith", "bound", "candidate_e_key", "candidate_e_val",
                "paper_e_key", "paper_e_val")


def certificate_record(caches: list[CacheTelemetry]) -> dict:
    """Per-step certificate telemetry of some caches, as one record (steps pooled)."""
    steps = [s for cache in caches for s in cache.log.steps]
    record = {"steps": len(steps), "head_steps": sum(s["heads"] for s in steps) or 1}
    sizes = [cache.bytes for cache in caches] or [{}]
    largest = max(sizes, key=lambda b: b.get("dense", 0))
    record.update({"tier1_over_dense": largest.get("tier1", 0) / max(largest.get("dense", 1), 1),
                   "device_bytes": largest.get("device", 0),
                   "tier2_bytes": largest.get("tier2", 0),
                   "dense_bytes": largest.get("dense", 0),
                   "scratch_bytes": largest.get("scratch", 0)})  # FP16 blocks it holds
    stats = [cache.scratch for cache in caches]
    hits, misses = sum(s.hits for s in stats), sum(s.misses for s in stats)
    record["scratch_hit_rate"] = hits / (hits + misses) if hits + misses else 0.0
    record["h2d_bytes"] = sum(s.h2d_bytes for s in stats)
    for name in ("evicted", "evictions", "restores"):  # eviction policies (blocks, all layers)
        record[f"{name}_blocks"] = sum(cache.eviction.get(name, 0) for cache in caches)
    for name in _STEP_FIELDS:
        record[f"{name}_step_mean"] = [s[f"{name}_mean"] for s in steps]
        record[f"{name}_step_max"] = [s[f"{name}_max"] for s in steps]
    if steps and all("error_mean" in s for s in steps):  # audit=true: the measured error
        record["error_step_mean"] = [s["error_mean"] for s in steps]
        record["error_step_max"] = [s["error_max"] for s in steps]
    for rung in range(5):
        record[f"rung{rung}"] = sum(s[f"rung{rung}"] for s in steps)
    for name in ("ranking_fail", "boundary_fail", "canary_fail", "value_promotions",
                 "tol_escalated", "tol_dense"):
        record[name] = sum(s.get(name, 0) for s in steps)
    record["paged_evicted_blocks"] = sum(s.get("paged_evicted", 0) for s in steps)
    record["page_in_steps"] = sum(1 for s in steps if s.get("paged_evicted", 0) > 0)
    record["targeted_blocks"] = sum(s.get("targeted", 0) for s in steps)  # page_in_budget
    record["mended_heads"] = sum(s.get("mended", 0) for s in steps)
    record["violations"] = sum(s.get("violations", 0) for s in steps)  # audit=true only
    record["audited"] = any(s.get("audited", False) for s in steps)
    record["uncovered_steps"] = sum(1 for s in steps if not s.get("faults_covered", True))
    for name in ("corrected_words", "erased_words", "corrupted_blocks"):  # read per step
        record[f"{name}_per_step"] = (statistics.fmean(s.get(name, 0) for s in steps)
                                      if steps else 0.0)
    record["k_star_mean"] = statistics.fmean(s["k_star_mean"] for s in steps) if steps else 0.0
    record["fp16_read_share"] = (statistics.fmean(s.get("fp16_read_share", 0.0) for s in steps)
                                 if steps else 0.0)
    return record
