"""Pure math and policy of the certificate: bounds, selector, value policies, checks, ladder."""

from certkv.certify.certificate import Certificate
from certkv.certify.ladder import Ladder
from certkv.certify.select import AdaptiveTopK
from certkv.certify.values import GreedyBudget, LocalThreshold, NoValuePromotion

__all__ = [
    "AdaptiveTopK",
    "Certificate",
    "GreedyBudget",
    "Ladder",
    "LocalThreshold",
    "NoValuePromotion",
]
