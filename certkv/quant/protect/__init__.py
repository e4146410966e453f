"""Error-correcting protection of quantized codes (seed 003): Hamming(7,4), Hamming(8,4) SECDED
and extended Golay(24,12) over 4-bit values."""

from certkv.quant.protect.base import CLEAN, CORRECTED, DETECTED, Code
from certkv.quant.protect.golay import Golay24
from certkv.quant.protect.hamming import Hamming74, Hamming84

__all__ = ["CLEAN", "CORRECTED", "DETECTED", "Code", "Golay24", "Hamming74", "Hamming84"]
