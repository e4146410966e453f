"""certkv: runtime-certified quantized KV-cache attention.

Every head of every decode step returns its output with a runtime bound
``||out - O_ref||_2 <= E_key + E_val + E_arith`` against attention in exact arithmetic on the
FP16 originals (quantized attention), or dense attention with ``E_key = E_val = 0``.
"""

import importlib

# the public names, imported on first use: `import certkv` (and so the CLI, which must answer a
# config typo at once) does not load torch, the kernels and transformers until something needs
# them
_EXPORTS = {
    "MODES": "certkv.attention",
    "CertifiedAttention": "certkv.attention",
    "TieredKVStore": "certkv.cache.store",
    "AdaptiveTopK": "certkv.certify",
    "Certificate": "certkv.certify",
    "GreedyBudget": "certkv.certify",
    "Ladder": "certkv.certify",
    "LocalThreshold": "certkv.certify",
    "NoValuePromotion": "certkv.certify",
    "CertKVError": "certkv.errors",
    "ChannelAffineKeyCodec": "certkv.quant",
    "FP16KeyCodec": "certkv.quant",
    "FP16ValueCodec": "certkv.quant",
    "GroupAffineValueCodec": "certkv.quant",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'certkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__version__ = "0.1.0"

__all__ = [
    "MODES",
    "AdaptiveTopK",
    "CertKVError",
    "Certificate",
    "CertifiedAttention",
    "ChannelAffineKeyCodec",
    "FP16KeyCodec",
    "FP16ValueCodec",
    "GreedyBudget",
    "GroupAffineValueCodec",
    "Ladder",
    "LocalThreshold",
    "NoValuePromotion",
    "TieredKVStore",
]


def _register_with_lm_eval() -> None:
    """``lm_eval.simple_evaluate(model="certkv", ...)`` after ``import certkv``: a lazy entry
    in lm-eval's registry (the model module loads when lm-eval asks for it), next to
    lm-eval's own models. Nothing happens without lm-eval installed."""
    try:
        import lm_eval.models  # noqa: F401 (lm-eval's own models, registered lazily)
        from lm_eval.api.registry import model_registry
    except ImportError:
        return
    if "certkv" not in model_registry:
        model_registry.register("certkv", target="certkv.integrations.lm_eval:CertKVLM")


_register_with_lm_eval()
