"""The component registry (:mod:`certkv.registry`) and ``conf/`` agree, names are found or
answered with the closest ones, and components state their capabilities instead of being asked
their type."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import get_object
from omegaconf import OmegaConf

from certkv.config import CONF_DIR, config_groups
from certkv.errors import ConfigError
from certkv.kernels import get_backend
from certkv.kernels.base import Backend
from certkv.quant import (
    ChannelAffineKeyCodec,
    GroupAffineValueCodec,
    InnerQKeyCodec,
    InnerQValueCodec,
    KiviKeyCodec,
    RotatedKeyCodec,
)
from certkv.registry import (
    BACKENDS,
    KEY_CODECS,
    PROTECTION_CODES,
    REGISTRIES,
    TASKS,
    VALUE_CODECS,
    Registry,
)

GROUPS = {r.group: r for r in REGISTRIES if r.group}


def yaml_nodes(group: str) -> dict[str, dict]:
    return {name: OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{name}.yaml"))
            for name in config_groups()[group]}


def selected(group: str, node: dict) -> list:
    """What a ``conf/<group>`` YAML selects: its target classes, or the names it passes to a
    factory (backends by name, ``auto`` choosing among them; protection by code; a task YAML
    holds one or more tasks, one level down)."""
    if group == "backend":
        return [] if node["backend"] == "auto" else [BACKENDS.get(node["backend"])]
    if group == "protect":
        return [PROTECTION_CODES.get(node["code"])]
    nodes = node.values() if group == "task" else [node]
    return [get_object(n["_target_"]) for n in nodes]


def targets(node) -> list[str]:
    """Every ``_target_`` inside ``node``."""
    if isinstance(node, dict):
        return ([node["_target_"]] if "_target_" in node else []) + [
            t for v in node.values() for t in targets(v)]
    return [t for v in node for t in targets(v)] if isinstance(node, list) else []


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_option_of_a_group_is_a_registered_component(group):
    registry = GROUPS[group]
    for name, node in yaml_nodes(group).items():
        for component in selected(group, node):
            assert registry.name_of(component) is not None, (
                f"conf/{group}/{name}.yaml selects {component!r}, which is not in the "
                f"{registry.kind} registry: register it where it is defined")


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_registered_component_has_an_option_in_its_group(group):
    registry = GROUPS[group]
    chosen = {registry.name_of(c) for node in yaml_nodes(group).values()
              for c in selected(group, node)}
    assert set(registry.names()) <= chosen, (
        f"registered {registry.kind}s without a conf/{group} YAML: "
        f"{sorted(set(registry.names()) - chosen)}")


def test_every_codec_a_quantizer_yaml_names_is_registered():
    codecs = {*(c for _, c in KEY_CODECS), *(c for _, c in VALUE_CODECS)}
    for name, node in yaml_nodes("quantizer").items():
        for target in targets(node):
            if target.endswith("Codec"):
                assert get_object(target) in codecs, (name, target)


def test_tasks_register_by_the_names_of_their_options():
    assert set(TASKS.names()) == {"niah", "perplexity", "ruler"}


def test_an_unknown_name_is_one_sentence_with_the_closest_names():
    with pytest.raises(ConfigError, match=r"unknown backend 'nunba'; did you mean 'numba'\? "
                                          r"use one of numba, torch, triton\."):
        get_backend("nunba")
    with pytest.raises(ConfigError, match=r"protect.code='hamming48' is unknown; did you mean "
                                          r"'hamming84'"):
        PROTECTION_CODES.get("hamming48", label="protect.code")


def test_two_components_under_one_name_fail_at_registration():
    registry = Registry("gadget", "certkv.quant")
    registry.register("a")(int)
    registry.register("a")(int)  # the same one again: nothing to resolve
    with pytest.raises(ValueError, match="gadget 'a' is registered twice"):
        registry.register("a")(float)


def test_a_codec_subclass_that_changes_decoding_loses_the_kernel_layout():
    class Rescaled(KiviKeyCodec):
        def decode(self, blocks):
            return 2 * super().decode(blocks)

    class Renamed(KiviKeyCodec):
        name: str = "renamed"

    assert KiviKeyCodec(bits=4).kernel_layout() is not None
    assert Renamed(bits=4).kernel_layout() == KiviKeyCodec(bits=4).kernel_layout()
    assert Rescaled(bits=4).kernel_layout() is None
    assert ChannelAffineKeyCodec(bits=3).kernel_layout().bits == 3  # 8 codes to 3 bytes
    assert RotatedKeyCodec(bits=4, subspaces=4).kernel_layout().subspaces == 4  # rotated back
    assert RotatedKeyCodec(bits=4, subspaces=16).kernel_layout() is None  # beyond FP32 headroom

    class Flipped(RotatedKeyCodec):
        def _decode(self, blocks):
            return -super()._decode(blocks)

    assert Flipped(bits=4, subspaces=4).kernel_layout() is None
    assert GroupAffineValueCodec(bits=4, group=32).kernel_layout(64).group == 32
    assert GroupAffineValueCodec(bits=4, group=32).kernel_layout(48) is None
    assert InnerQKeyCodec(bits=3).kernel_layout().inner  # InnerQ's groups, 3-bit codes too

    class Signed(InnerQValueCodec):
        def decode(self, blocks):
            return -super().decode(blocks)

    assert InnerQValueCodec(bits=2).kernel_layout(64).inner
    assert Signed(bits=2).kernel_layout(64) is None


def test_kvquants_codecs_claim_their_layouts_only_where_the_kernels_can_read_them():
    """Pre-RoPE keys over plain per-channel codes with a RoPE to rotate by (post-RoPE: the
    inner codec's own layout); dense-and-sparse values by their levels; a subclass that
    decodes its own way loses the claim."""
    from certkv.quant import OutlierValueCodec, PreRoPEKeyCodec
    from certkv.quant.rope import RopeSpec

    rope = RopeSpec.from_theta(1e4, 64)
    kivi3 = KiviKeyCodec(bits=3)
    layout = PreRoPEKeyCodec(inner=kivi3, rope=rope).kernel_layout()
    assert layout.rope and layout.bits == 3 and layout.bound == kivi3.bound_coefficients()
    assert layout.slack == kivi3.slack_coefficients()
    assert PreRoPEKeyCodec(inner=kivi3).kernel_layout() is None  # no RoPE to rotate by
    assert PreRoPEKeyCodec(inner=InnerQKeyCodec(bits=3), rope=rope).kernel_layout() is None
    post = PreRoPEKeyCodec(inner=kivi3, key_mode="post_rope", rope=rope)
    assert post.kernel_layout() == kivi3.kernel_layout()
    assert OutlierValueCodec(bits=3, group=32).kernel_layout(64).codebook
    uniform = OutlierValueCodec(bits=2, group=32, levels="uniform").kernel_layout(64)
    assert uniform.outliers and not uniform.codebook
    assert OutlierValueCodec(bits=3, group=32).kernel_layout(48) is None  # 32 does not divide

    class Shifted(OutlierValueCodec):
        def decode(self, blocks):
            return super().decode(blocks) + 0.0

    assert Shifted(bits=3, group=32).kernel_layout(64) is None


def test_a_backend_states_capabilities_and_defaults_the_rest():
    class Minimal(Backend):
        def phase1(self, q, lay, scaling): ...
        def phase2(self, q, scored, lay, gate, keys, values, scaling, eps_guard, checks=None): ...
        def checks(self, l_int8, l_fp16, delta_b, promoted, quantized, r): ...
        def dense(self, q, k, v, scaling): ...
        def rounding(self, lay): ...

    backend = get_backend(Minimal())
    assert not backend.falls_back_on_device and not backend.fuses_step(torch.device("cpu"))
    assert backend.decoded_mirror(torch.device("cpu")) and backend.in_place(None) == "k"
    with pytest.raises(ConfigError, match="is not a backend"):
        get_backend(object())
