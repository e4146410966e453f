"""certkv: runtime-certified quantized KV-cache attention.

Every head of every decode step returns its output with a runtime bound
``||out - O_ref||_2 <= E_key + E_val + E_arith`` against attention in exact arithmetic on the
FP16 originals (quantized attention), or dense attention with ``E_key = E_val = 0``.
"""

from certkv.attention import MODES, CertifiedAttention
from certkv.cache.store import TieredKVStore
from certkv.certify import (
    AdaptiveTopK,
    Certificate,
    GreedyBudget,
    Ladder,
    LocalThreshold,
    NoValuePromotion,
)
from certkv.errors import CertKVError
from certkv.quant import (
    ChannelAffineKeyCodec,
    FP16KeyCodec,
    FP16ValueCodec,
    GroupAffineValueCodec,
)

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
