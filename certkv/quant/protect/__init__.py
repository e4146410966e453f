"""Error-correcting protection of quantized codes (seed 003): Hamming(7,4), Hamming(8,4) SECDED
and extended Golay(24,12) over 4-bit values, the integrity check, and injected bit flips."""

from certkv.quant.protect.base import CLEAN, CORRECTED, DETECTED, Code
from certkv.quant.protect.codec import ProtectedKeyCodec, ProtectedValueCodec
from certkv.quant.protect.golay import Golay24
from certkv.quant.protect.hamming import Hamming74, Hamming84
from certkv.quant.protect.protection import FaultModel, Protection

__all__ = ["CLEAN", "CORRECTED", "DETECTED", "Code", "FaultModel", "Golay24", "Hamming74",
           "Hamming84", "ProtectedKeyCodec", "ProtectedValueCodec", "Protection"]
