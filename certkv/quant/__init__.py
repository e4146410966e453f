"""Codecs: FP16 blocks -> packed codes + metadata + a deterministic reconstruction bound."""

from certkv.quant.base import Blocks, KeyCodec, LayerContext, ValueCodec
from certkv.quant.fp16 import FP16KeyCodec, FP16ValueCodec
from certkv.quant.innerq import InnerQKeyCodec, InnerQValueCodec
from certkv.quant.int4_group import GroupAffineValueCodec
from certkv.quant.int8_channel import ChannelAffineKeyCodec
from certkv.quant.kivi import KiviKeyCodec
from certkv.quant.kv import KVQuantizer
from certkv.quant.outlier_value import OutlierValueCodec
from certkv.quant.precision import Precision
from certkv.quant.prerope import PreRoPEKeyCodec
from certkv.quant.rotation import RotatedKeyCodec, RotatedValueCodec
from certkv.quant.smartkv import SmartKVQuantizer
from certkv.quant.symmetric_token import TokenSymmetricKeyCodec, TokenSymmetricValueCodec
from certkv.quant.tiers import TieredQuantizer

__all__ = [
    "Blocks",
    "ChannelAffineKeyCodec",
    "FP16KeyCodec",
    "FP16ValueCodec",
    "GroupAffineValueCodec",
    "InnerQKeyCodec",
    "InnerQValueCodec",
    "KVQuantizer",
    "KeyCodec",
    "KiviKeyCodec",
    "LayerContext",
    "OutlierValueCodec",
    "PreRoPEKeyCodec",
    "Precision",
    "RotatedKeyCodec",
    "RotatedValueCodec",
    "SmartKVQuantizer",
    "TieredQuantizer",
    "TokenSymmetricKeyCodec",
    "TokenSymmetricValueCodec",
    "ValueCodec",
]
