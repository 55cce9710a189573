"""Eviction policies of the host store, one class per module, chosen by name.

``make_policy("lru" | "arc", capacity)`` builds one; :data:`POLICY_NAMES` lists the names
(vLLM 0.33's ``cache_policy`` values for its CPU tier).
"""

from __future__ import annotations

from spec.errors import ConfigError
from spec.policies.arc import ARCPolicy
from spec.policies.base import Evictable, EvictionPolicy
from spec.policies.lru import LRUPolicy

__all__ = ["POLICY_NAMES", "ARCPolicy", "Evictable", "EvictionPolicy", "LRUPolicy", "make_policy"]

_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """A fresh, empty policy ``name`` for a store of ``capacity`` entries.

    Pre: ``name`` in :data:`POLICY_NAMES`, else :class:`ConfigError` (field ``cache_policy``).
    """
    if name not in _POLICIES:
        raise ConfigError(
            "cache_policy", name, "unknown eviction policy", f"use one of {POLICY_NAMES}"
        )
    return _POLICIES[name](capacity)
