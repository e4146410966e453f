"""Tiered KV storage."""

from certkv.cache.store import TieredKVStore

__all__ = ["TieredKVStore"]
