"""hybridkv's parts as plug-ins for vLLM 0.33's native ``OffloadingConnector``.

Loaded by native's own config keys, no fork, no registration:

- the shared tier as a ``SecondaryTierManager`` under ``TieringOffloadingSpec``
  (``"secondary_tiers": [{"type": "HybridKVRemoteTier", "module_path": "hybridkv.native",
  "remote_url": "redis://host:6379"}]``, or ``"HybridKVDiskTier"`` with ``disk_dir`` and
  ``disk_bytes``): :mod:`.tier`;
- ARC with the prompt-before-continuation admission as the CPU tier's ``CachePolicy``
  (``"eviction_policy": "HybridKVARCPolicy", "cache_policy_module_path": "hybridkv.native"``):
  :mod:`.policy`.

One idea per module: :mod:`.settings` (the tier's keys, checked), :mod:`.identity` (what chunk
keys are scoped by), :mod:`.tier`, :mod:`.policy`. docs/howto/native-offloading.md.
"""

from __future__ import annotations

from hybridkv.native.policy import HybridKVARCPolicy
from hybridkv.native.tier import NATIVE_TIER_COUNTERS, HybridKVDiskTier, HybridKVRemoteTier

__all__ = ["NATIVE_TIER_COUNTERS", "HybridKVARCPolicy", "HybridKVDiskTier", "HybridKVRemoteTier"]
