"""certkv.kernels.triton_tune: Phase 1 and Phase 2 tuned over launch configurations on a GPU,
the default configuration everywhere else (issue 55)."""

from __future__ import annotations

import pytest
import torch
from helpers import check_heads, cuda_layer, make_kv, make_query

from certkv import CertifiedAttention, TieredKVStore
from certkv.bench import tuning_notes
from certkv.kernels import triton_tune
from certkv.kernels.cuda_compile import compile_for_cuda, recording_launches
from certkv.kernels.launch_hooks import wrap_triton_launches
from certkv.kernels.triton_attend import _attend_kernel
from certkv.kernels.triton_score import _score_kernel


def _step():
    k, v = make_kv(2, 16 * 6 + 5, 32, seed=2)
    store = TieredKVStore(2, 32)
    store.append(k, v)
    return CertifiedAttention(backend="triton")(make_query(k, 2, seed=2), store)


def test_both_split_kernels_are_tuned_over_every_config():
    assert triton_tune.TUNED[:2] == [_score_kernel, _attend_kernel]
    for kernel in (_score_kernel, _attend_kernel):
        assert kernel.configs == triton_tune.CONFIGS and kernel.keys == triton_tune.KEY
    assert triton_tune.CONFIGS[0] is triton_tune.DEFAULT
    warps = {(c.num_warps, c.num_stages) for c in triton_tune.CONFIGS}
    assert len(warps) == len(triton_tune.CONFIGS) == 9  # distinct, the default among them


@pytest.mark.parametrize(("device", "env", "capturing", "tuned"), [
    ("cuda", None, False, True), ("cuda", "0", False, False), ("cuda", "1", True, False),
    ("cpu", None, False, False), ("meta", None, False, False)])
def test_only_a_cuda_launch_outside_a_capture_is_tuned(monkeypatch, device, env, capturing,
                                                       tuned):
    if env is None:
        monkeypatch.delenv(triton_tune.ENV, raising=False)
    else:
        monkeypatch.setenv(triton_tune.ENV, env)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    assert triton_tune.tuning_on(torch.device(device)) is tuned
    x = torch.empty(1, device="meta")
    monkeypatch.setattr(triton_tune, "_first_device", lambda args: torch.device(device))
    pruned = triton_tune.prune(triton_tune.CONFIGS, {"q": x})
    assert pruned == (triton_tune.CONFIGS if tuned else [triton_tune.DEFAULT])


def test_the_first_tensor_of_a_launch_names_its_device():
    x = torch.zeros(1)
    assert triton_tune._first_device([3, (1.0, x)]).type == "cpu"
    assert triton_tune._first_device([3, "a"]).type == "meta"


def test_an_interpreted_step_launches_each_kernel_once_at_the_default_config():
    launches = []

    def count(kernel, launch, args, kwargs):
        launches.append((kernel.fn.__name__, kwargs.get("num_warps"), kwargs.get("num_stages")))
        return launch(*args, **kwargs)

    restore = wrap_triton_launches(count)
    try:
        out, _ = _step()
    finally:
        restore()
    tuned = [x for x in launches if x[0] in ("_score_kernel", "_attend_kernel")]
    assert sorted(tuned) == [("_attend_kernel", 4, 3), ("_score_kernel", 4, 3)]
    assert torch.isfinite(out).all()
    rows = {(name, config) for name, _, config in triton_tune.chosen()}
    assert ("_score_kernel", "num_warps=4, num_stages=3") in rows
    assert any(shape == "G=2 B=16 D=32 SPLIT=4" for _, shape, _ in triton_tune.chosen())
    note = tuning_notes(torch.device("cuda"))  # what a CUDA bench's report says
    assert note and "_attend_kernel at G=2 B=16 D=32 SPLIT=4: num_warps=4" in note[0]
    assert tuning_notes(torch.device("cpu")) == []


@pytest.mark.slow
def test_every_tuned_config_compiles_for_cuda():
    with recording_launches() as launches:
        _step()
    tuned = {x for x in launches if x.name in ("_score_kernel", "_attend_kernel")}
    assert {x.name for x in tuned} == {"_score_kernel", "_attend_kernel"}
    assert all(k not in dict(x.kwargs) for x in tuned for k in ("num_warps", "num_stages"))
    failures = compile_for_cuda(tuned, every_config=True)
    assert failures == {}, "\n\n".join(f"{name}:\n{msg}" for name, msg in failures.items())


@pytest.mark.gpu
def test_on_cuda_each_shape_tunes_once_before_its_capture_and_replays_equal_eager(monkeypatch):
    """Tuning on: the first eager step of a shape times the configs and keeps one; the graphed
    attention's capture of the same shape reuses it (no timing inside a capture), so replays
    equal the eager steps bit for bit and every head keeps its bound."""
    from certkv.graphs import GraphedAttention

    monkeypatch.setenv(triton_tune.ENV, "1")
    stores, qs = zip(*(cuda_layer(4, 3000, 128, group=4) for _ in range(2)), strict=True)
    eager = CertifiedAttention()
    eager.pad_layout = True
    graphed = GraphedAttention(CertifiedAttention())
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(20):
        k, v = (torch.randn(4, 1, 128, device="cuda", generator=gen).half() for _ in range(2))
        for store in stores:
            store.append(k, v)
        out_e, cert_e = eager(qs[0], stores[0])
        out_g, cert_g = graphed(qs[0], stores[1])
        assert torch.equal(out_e, out_g) and torch.equal(cert_e.bound, cert_g.bound), step
        check_heads(out_g, cert_g, qs[0], stores[1])
    shapes = [shape for name, shape, _ in triton_tune.chosen() if name == "_score_kernel"]
    assert any(shape.startswith("G=4 B=16 D=128") for shape in shapes)
    assert graphed.captures >= 1 and graphed.replays >= 1
