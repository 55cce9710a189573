"""Eviction policies by name: ``make_policy("lru" | "arc", capacity)`` (vLLM's ``cache_policy``)."""

from __future__ import annotations

from hybridkv.errors import HybridKVConfigError
from hybridkv.store.arc import ARCPolicy
from hybridkv.store.lru import LRUPolicy
from hybridkv.store.policy import EvictionPolicy

__all__ = ["POLICY_NAMES", "make_policy"]

_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """A fresh, empty policy ``name`` for a store of ``capacity`` entries.

    Pre: ``name`` in :data:`POLICY_NAMES`, else :class:`HybridKVConfigError` (field
    ``cache_policy``).
    """
    if name not in _POLICIES:
        raise HybridKVConfigError(
            "cache_policy", name, "unknown eviction policy", f"use one of {POLICY_NAMES}"
        )
    return _POLICIES[name](capacity)
