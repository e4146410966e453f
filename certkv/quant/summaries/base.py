"""The base of evicted blocks' summaries (:mod:`certkv.quant.summaries`)."""

from __future__ import annotations

from certkv.quant.precision import Precision


class Summary:
    """How an evicted block is held in Tier-1: :meth:`precision` gives its codecs, whose
    ``channel_bound`` (keys) and ``token_bound`` (values) are the logit and value bounds the
    certificate reads for it (its name is the one it is registered under)."""

    def precision(self) -> Precision:
        """The precision evicted blocks are re-encoded at (from their Tier-2 originals)."""
        raise NotImplementedError
