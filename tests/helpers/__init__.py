"""Shared test helpers: synthetic KV data and the FP64 reference attention."""

from __future__ import annotations

import dataclasses
import functools
import os
import weakref
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st

from certkv import TieredKVStore
from certkv.certify import audit
from certkv.kernels.reference import TorchBackend, dense_attention
from certkv.kernels.triton_backend import TritonBackend

# Where a contract test runs: both backends on the CPU (Triton in its interpreter, as in CI) and
# the Triton kernels compiled on CUDA (a `gpu` test, skipped without a device). On a GPU machine
# the suite runs as `pytest -m gpu` plus `TRITON_INTERPRET=1 pytest -m "not gpu"`.
BACKENDS = [pytest.param(TorchBackend, "cpu", id="torch"),
            pytest.param(TritonBackend, "cpu", id="triton"),
            pytest.param(TritonBackend, "cuda", id="triton-cuda", marks=pytest.mark.gpu)]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def script(relative: str):
    """The script at ``scripts/<relative>`` as a module (scripts are files, not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def examples(n: int) -> int:
    """A property test's example count: ``n`` in CI, ten times that in the ``deep`` profile
    (``CERTKV_HYPOTHESIS=deep``, conftest)."""
    return n * (10 if os.environ.get("CERTKV_HYPOTHESIS") == "deep" else 1)


def fetch_books(names=None, cache_dir=None) -> Path:
    """The folder holding the offline books ``names`` (default: all of
    :mod:`certkv.eval.corpora`) under ``cache_dir`` (default ``$CERTKV_DATA`` or
    ``~/.cache/certkv``). The first run fetches them with ``apt-get download``; where they are
    not cached and no package source is reachable, the calling test skips with the reason."""
    from certkv.errors import CertKVError
    from certkv.eval.corpora import available_books, book_text, default_cache_dir

    try:
        for name in names or available_books():
            book_text(name, cache_dir=cache_dir)
    except CertKVError as exc:
        if "apt-get" not in str(exc) and "dpkg-deb" not in str(exc):
            raise  # a broken package or cache is a failure, not a missing package source
        pytest.skip(f"the offline books are not cached and apt-get download failed: {exc}")
    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / "books"


class WordTokenizer:
    """One token per whitespace-separated word; ``encode``/``decode`` shaped like HF's (for
    prompt generators tested without a real tokenizer)."""

    def __init__(self):
        self.vocab: dict[str, int] = {"<s>": 0}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]
        return ([0] if add_special_tokens else []) + ids

    def decode(self, ids: list[int]) -> str:
        inverse = {i: w for w, i in self.vocab.items()}
        return " ".join(inverse[i] for i in ids)


def make_kv(hkv, n, d, *, seed=0, outlier_channels=0, heavy_tail=False, key_offset=0.0,
            value_offset=0.0, aligned_block=0, key_levels=0):
    """Keys ``[Hkv, n, d]`` with optional outlier channels, values optionally heavy-tailed.

    Adversarial options for the tight certificate: ``value_offset`` adds a large common offset
    to every value (centred radius vs V_max); ``aligned_block=B`` makes every token of each
    ``B``-token block carry its block's first value (identical value errors: the spectral
    value bound's worst case) and, with ``key_levels=L``, only ``L`` distinct keys per block
    (repeated key errors: the key spectral bound's worst case)."""
    k, v = _base_kv(hkv, n, d, seed, outlier_channels, heavy_tail, key_offset)
    if aligned_block:
        v = _repeat_in_blocks(v, aligned_block, 1)
        if key_levels:
            k = _repeat_in_blocks(k, aligned_block, key_levels)
    return k, v + value_offset


def _repeat_in_blocks(x, block, levels):
    """Each full ``block`` of tokens of ``x [Hkv, n, d]`` cycles through its first ``levels``."""
    full = x.shape[1] // block * block
    idx = torch.arange(full)
    idx = idx - idx % block + (idx % block) % levels
    out = x.clone()
    out[:, :full] = x[:, idx]
    return out


def _base_kv(hkv, n, d, seed, outlier_channels, heavy_tail, key_offset):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(hkv, n, d, generator=gen) + key_offset
    if outlier_channels:
        idx = torch.randperm(d, generator=gen)[:outlier_channels]
        k[..., idx] *= 10 + 90 * torch.rand(outlier_channels, generator=gen)
    if heavy_tail:  # Cauchy (Student-t, 1 dof) from the seeded generator: deterministic
        u = torch.rand(hkv, n, d, generator=gen).clamp(1e-6, 1 - 1e-6)
        v = torch.tan(torch.pi * (u - 0.5)).clamp(-3e4, 3e4)
    else:
        v = torch.randn(hkv, n, d, generator=gen)
    return k, v


def make_query(k, group, *, seed=0, scale=1.0, peaked=False):
    """Queries ``[Hq, d]``; ``peaked`` aligns each with one cached key (sharp attention)."""
    gen = torch.Generator().manual_seed(seed + 1)
    hkv, n, d = k.shape
    q = torch.randn(hkv * group, d, generator=gen)
    if peaked:
        pick = torch.randint(0, n, (hkv * group,), generator=gen)
        kv = torch.arange(hkv * group) // group
        q = k[kv, pick] + 0.1 * q
    return q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12) * scale * d**0.5


def cuda_layer(hkv, n, d, group, seed=1):
    """A CUDA store of ``n`` synthetic tokens (outlier channels) and a peaked query."""
    k, v = make_kv(hkv, n, d, seed=seed, outlier_channels=4)
    store = TieredKVStore(hkv, d, device="cuda")
    store.append(k.cuda(), v.cuda())
    return store, make_query(k, group, seed=seed + 1, scale=2.0, peaked=True).cuda()


# ---------------------------------------------------------------- the oracle's own data
# The contract's oracle is computed from the test's own copy of everything appended, never from
# the store under test: a store that kept wrong originals (decode appends, deferred commits, the
# lean mirror, re-quantized tiers, a clone) would otherwise move the oracle with it. conftest
# wraps TieredKVStore.append / append_in_place / clone (:func:`install_witness`): each append
# keeps an FP16 copy of the caller's tensors (the same rounding the store applies on entry) beside
# the store, a clone gets a copy of its source's list.
_WITNESS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BLIND: weakref.WeakSet = weakref.WeakSet()  # stores appended to inside a CUDA graph capture


def install_witness(monkeypatch) -> None:
    """Wrap the store's append paths and clone so :func:`originals` can answer from the test's
    own copy (``monkeypatch``: the session's, undone at its end)."""
    def witnessed(append):
        @functools.wraps(append)
        def wrapper(store, k, v):
            append(store, k, v)  # an append that raises records nothing
            if k.is_cuda and torch.cuda.is_current_stream_capturing():
                _BLIND.add(store)  # a graph's replays append without Python: no copy to keep
                return
            ks, vs = _WITNESS.setdefault(store, ([], []))
            ks.append(k.detach().to("cpu", torch.float16, copy=True))
            vs.append(v.detach().to("cpu", torch.float16, copy=True))
        return wrapper

    def cloned(clone):
        @functools.wraps(clone)
        def wrapper(store):
            new = clone(store)
            if store in _WITNESS:
                ks, vs = _WITNESS[store]
                _WITNESS[new] = (list(ks), list(vs))
            return new
        return wrapper

    for name in ("append", "append_in_place"):
        monkeypatch.setattr(TieredKVStore, name, witnessed(getattr(TieredKVStore, name)))
    monkeypatch.setattr(TieredKVStore, "clone", cloned(TieredKVStore.clone))


def originals(store: TieredKVStore):
    """FP16 originals ``[Hkv, N, d]`` (CPU) of every token appended to ``store``: the test's own
    copy (see :func:`install_witness`), checked to hold as many tokens as the store says."""
    assert store not in _BLIND, "the store was appended to in a captured CUDA graph: no oracle"
    assert store in _WITNESS, "the store was filled without TieredKVStore.append: no oracle"
    ks, vs = _WITNESS[store]
    k, v = torch.cat(ks, dim=1), torch.cat(vs, dim=1)
    assert k.shape[1] == store.num_tokens, (
        f"the store holds {store.num_tokens} tokens but {k.shape[1]} were appended")
    return k, v


def reference_fp64(q, store, scaling=None):
    """O_ref: softmax attention on the original K/V, computed in FP64 -> ``[Hq, d]``."""
    k, v = originals(store)
    scaling = store.head_dim**-0.5 if scaling is None else scaling
    return audit.reference_fp64(q.cpu(), k, v, scaling)


def dense_reference(q, store, scaling=None):
    """The PyTorch dense path on the FP16 originals (the reference backend's rungs 3-4 and
    mode=dense) -> ``[Hq, d]``."""
    k, v = (x.to(q.device) for x in originals(store))
    scaling = store.head_dim**-0.5 if scaling is None else scaling
    return dense_attention(q, k, v, scaling)


def reference_slack(q, store, scaling=None):
    """The FP64 reference's own rounding ``[Hq]`` (its only allowance in the contract tests;
    :func:`certkv.certify.audit.reference_slack`)."""
    k, v = originals(store)
    scaling = store.head_dim**-0.5 if scaling is None else scaling
    return audit.reference_slack(q.cpu(), k, v, scaling)


def check_heads(out, cert, q, store, scaling=None):
    """The contract for every head, with no allowance beyond the FP64 reference's own rounding:
    ``||out - O_ref|| <= cert.bound`` (FP64 ``O_ref`` on the originals); dense heads (rungs 3-4)
    report ``e_key = e_val = 0`` and are the dense path: within ``2 e_arith`` of
    :func:`dense_reference` (both within ``e_arith`` of ``O_ref``). A certificate that says it
    does not cover faults (``faults_covered`` False) is held to its dense heads only. Returns
    ``(err, bound)``."""
    err = (out.double().cpu() - reference_fp64(q, store, scaling)).norm(dim=-1)
    slack = reference_slack(q, store, scaling)
    bound = cert.bound.double().cpu()
    assert (cert.e_arith > 0).all()
    held = torch.ones_like(err, dtype=torch.bool) if cert.faults_covered else cert.rung.cpu() >= 3
    assert torch.isfinite(bound[held]).all() and torch.isfinite(out.cpu()[held]).all()
    violated = (err > bound + slack) & held
    assert not violated.any(), (
        f"contract violated on heads {violated.nonzero().flatten().tolist()}: "
        f"err={err[violated].tolist()} bound={bound[violated].tolist()} "
        f"e_key={cert.e_key[violated].tolist()} e_val={cert.e_val[violated].tolist()} "
        f"e_arith={cert.e_arith[violated].tolist()} rung={cert.rung[violated].tolist()}")
    dense = cert.rung.cpu() >= 3
    if dense.any():
        assert (cert.e_key.cpu()[dense] == 0).all() and (cert.e_val.cpu()[dense] == 0).all()
        gap = (out.double() - dense_reference(q, store, scaling).double()).norm(dim=-1).cpu()
        assert (gap[dense] <= 2 * (bound + slack)[dense]).all()
    return err, bound


# ---------------------------------------------------------------- codec data and bounds
KINDS = ("random", "outliers", "constant", "huge", "tiny", "subnormal", "mixed")


def adversarial(kind: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """FP16 blocks ``[..., B, d]``: Gaussian, outlier channels x300, constant tokens (0 and
    -0.75 but for channel 1) and a constant channel 1, norms near the FP16 maximum, tiny (1e-4)
    and subnormal (~1e-6) values, or channels spread over ten decades."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    if kind == "outliers":
        x[..., 0] *= 300
        x[..., -3] *= -300
    elif kind == "constant":
        x[..., 0, :] = 0.0
        if shape[-2] > 1:
            x[..., 1, :] = -0.75
        x[..., 1] = 1.5
    elif kind == "huge":
        x = x * 3e4
        x[..., 2] = 65504.0
    elif kind == "tiny":
        x = x * 1e-4
    elif kind == "subnormal":
        x = x * 2.0**-20
    elif kind == "mixed":
        x = x * 10 ** (torch.rand(shape[-1], generator=gen, dtype=torch.float64) * 10 - 6)
    return x.clamp(-65504, 65504).half()


def tier1_bytes(*encoded) -> int:
    return sum(t.numel() * t.element_size() for blocks in encoded for t in blocks.values())


def assert_keys_within_bound(codec, k):
    enc = codec.encode(k)
    err = (codec.decode(enc).double() - k.double()).abs().amax(dim=-2)  # [Hkv, n, d]
    bound = codec.channel_bound(enc)
    assert bound.dtype == torch.float32 and bound.shape == err.shape
    assert (err <= bound.double()).all()
    return enc


def assert_values_within_bound(codec, v):
    enc = codec.encode(v)
    err = (codec.decode(enc).double() - v.double()).norm(dim=-1)  # [Hkv, n, B]
    bound = codec.token_bound(enc)
    assert bound.dtype == torch.float32 and bound.shape == err.shape
    assert (err <= bound.double()).all()
    return enc


def check_steps(store, attn, k, v, sc, observe=False, on_step=None):
    """Append the prompt, then ``steps`` rounds of ``per_step`` tokens (blocks fill and change
    precision between steps), certifying a query after each (on the store's device); with
    ``observe`` the store sees each step's certificate (what adapts to attention: SmartKV,
    heavy-hitter eviction) and the prompt's queries (SnapKV: queries near the prompt's last
    keys). ``on_step(store, cert)`` sees each step's certificate after its check."""
    n, device = sc["tokens"], store.device
    store.append(k[:, :n].to(device), v[:, :n].to(device))
    if observe:
        group = sc["gqa"]
        window = k[:, max(0, n - 8):n].repeat_interleave(group, dim=0)
        store.observe_prompt((window + 0.5 * torch.randn_like(window)).to(device))
    for step in range(sc["steps"] + 1):
        if step:
            extra = make_kv(k.shape[0], sc["per_step"], k.shape[2], seed=sc["seed"] + step)
            store.append(*(x.to(device) for x in extra))
        q = make_query(k[:, :n], sc["gqa"], seed=sc["seed"] + step, scale=sc["q_scale"],
                       peaked=sc["peaked"]).to(device, getattr(torch, sc["q_dtype"]))
        out, cert = attn(q, store)
        check_heads(out, cert, q, store)
        if on_step is not None:
            on_step(store, cert)
        if observe:
            store.observe(cert)


def step_draws(draw, max_tokens: int, per_step: list[int]) -> dict:
    """The scenario fields :func:`check_steps` and its data read (adversarial as in
    ``test_contract``): kv heads, GQA group, prompt length, decode rounds, outlier channels,
    heavy tails, key offset, query scale, peaked queries, query dtype, seed."""
    return {
        "hkv": draw(st.integers(1, 2)),
        "gqa": draw(st.integers(1, 3)),
        "tokens": draw(st.integers(1, max_tokens)),
        "steps": draw(st.integers(1, 3)),
        "per_step": draw(st.sampled_from(per_step)),
        "outliers": draw(st.sampled_from([0, 2])),
        "heavy_tail": draw(st.booleans()),
        "key_offset": draw(st.sampled_from([0.0, 3.0])),
        "q_scale": draw(st.sampled_from([1e-3, 1.0, 30.0, 1e3])),
        "peaked": draw(st.booleans()),
        "q_dtype": draw(st.sampled_from(["float32", "float16", "bfloat16"])),
        "seed": draw(st.integers(0, 2**16)),
    }


def store_contents(store: TieredKVStore) -> list[torch.Tensor]:
    """Everything a one-precision store holds that a step or a later commit reads: Tier-1
    codes and metadata, the annotations, Tier-2, the tail's tokens and counts, the running
    maxima, the decoded mirror (where kept), the quantized mask and count, the non-finite
    flag."""
    from certkv.cache.store import ANNOTATIONS

    blocks = [t for side in (store.key_blocks(), store.value_blocks()) for t in side.values()]
    decoded = store.decoded_with_tail()
    mirror = [] if decoded is None else [t for t in (*decoded, store.slot_bias(),
                                                      store.original_keys()) if t is not None]
    return [*blocks, *(store.annotation(name) for name in ANNOTATIONS), *store.dense_kv(),
            *store.tail(), store.block_counts(), store.value_norm_max(),
            store.value_radius(), store.value_error_max(), store.key_abs_max(), *mirror,
            store.quantized_mask(), store.quantized_count(), store.nonfinite_appended()]


def same_values(a, b) -> bool:
    """Bitwise equality of certificates, their block statistics and tuples of them (tensors
    equal with NaN equal to NaN; other fields ``==``)."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.nan_to_num(),
                                                                           b.nan_to_num()))
    if dataclasses.is_dataclass(a):
        return all(same_values(getattr(a, f.name), getattr(b, f.name))
                   for f in dataclasses.fields(a))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b, strict=True))
    return a == b or (a != a and b != b)


# ---------------------------------------------------------------- Triton launches
@contextmanager
def kernel_launches():
    """``{"phase1": n, "phase2": n}``: how often the Triton backend launched its Phase 1 / Phase 2
    kernels while the block ran (a phase that falls back to the reference launches none)."""
    from certkv.kernels import triton_attend, triton_score

    launches = {"phase1": 0, "phase2": 0}
    with pytest.MonkeyPatch.context() as mp:
        for phase, module, name in (("phase1", triton_score, "score_blocks"),
                                    ("phase2", triton_attend, "attend_blocks")):
            mp.setattr(module, name, counting(getattr(module, name), launches, phase))
        yield launches


def counting(kernel, launches, phase):
    def counted(*args, **kwargs):
        if isinstance(launches, list):
            launches.append(phase)
        else:
            launches[phase] += 1
        return kernel(*args, **kwargs)

    return counted
