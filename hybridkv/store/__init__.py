"""The host store: the CPU tier's accounting (:mod:`.manager`) apart from its eviction policy
(:mod:`.lru`, :mod:`.arc`, protocol in :mod:`.policy`), sized in chunks or from a byte budget
(:mod:`.capacity`). Written from the store contract, which ``spec.store`` models on its own;
it never imports spec, and the differential tests hold the two to the same answers.
"""

from __future__ import annotations

from hybridkv.store import values
from hybridkv.store.arc import ARCPolicy
from hybridkv.store.capacity import HostCapacity
from hybridkv.store.lru import LRUPolicy
from hybridkv.store.manager import HostStore
from hybridkv.store.policies import POLICY_NAMES, make_policy
from hybridkv.store.policy import Evictable, EvictionPolicy
from hybridkv.store.values import *  # noqa: F403  (exactly values.__all__, appended below)

# The store's own machinery; the values it answers with are re-exported from :mod:`.values`,
# whose ``__all__`` is appended below so the two lists cannot drift apart.
__all__ = [
    "POLICY_NAMES",
    "ARCPolicy",
    "Evictable",
    "EvictionPolicy",
    "HostCapacity",
    "HostStore",
    "LRUPolicy",
    "make_policy",
]
__all__ += values.__all__
