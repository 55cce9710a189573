"""Per-group KV cache managers over one shared block pool (vLLM 0.33 semantics).

- :mod:`spec.managers.group_spec`: what a group is (:class:`GroupSpec`).
- :mod:`spec.managers.base`: block tables, reservation, external and new allocation, caching,
  freeing (:class:`SingleTypeManager`).
- :mod:`spec.managers.full`, :mod:`spec.managers.sliding`, :mod:`spec.managers.mamba`: what each
  kind skips and what it accepts as a hit.
- :mod:`spec.managers.longest_hit`: the hybrid fixed-point hit.
- :mod:`spec.managers.coordinator`: all groups over one pool (:class:`KVCacheCoordinator`).
"""

from __future__ import annotations

from spec.managers.base import GroupHit, SingleTypeManager, coarse_hashes
from spec.managers.coordinator import KVCacheCoordinator
from spec.managers.full import FullAttentionManager
from spec.managers.group_spec import GroupSpec, cdiv
from spec.managers.longest_hit import NO_HIT, CacheHit
from spec.managers.mamba import MambaManager
from spec.managers.sliding import SlidingWindowManager

__all__ = [
    "NO_HIT",
    "CacheHit",
    "FullAttentionManager",
    "GroupHit",
    "GroupSpec",
    "KVCacheCoordinator",
    "MambaManager",
    "SingleTypeManager",
    "SlidingWindowManager",
    "cdiv",
    "coarse_hashes",
]
