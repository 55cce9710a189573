"""The small mamba + full core the connector-core tests share: two groups (full attention and
mamba align), 4-token units and blocks, a 16 KiB block budget, ``tp=2``. One builder, so every
test reads the same geometry and a change to the core's constructor is made once."""

from __future__ import annotations

from hybridkv.connector import ConnectorCore
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner
from hybridkv.store import HostStore

FULL, MAMBA = GroupKind.FULL, GroupKind.MAMBA


def mamba_full_core(capacity: int) -> ConnectorCore:
    """A core over a host store of ``capacity`` entries."""
    planner = HybridOffloadPlanner(((FULL, 4), (MAMBA, 4)), 2, 4, 1 << 14)
    return ConnectorCore(planner, HostStore(capacity), (FULL, MAMBA), 2, 4)
