"""Bookkeeping of async loads: the load in flight, the abandoned one, and delayed frees.

A request has at most one OUTSTANDING load: either active (the request waits in
WAITING_FOR_REMOTE_KVS) or parked (abandoned at its deadline, its blocks still held because the
transfer may still write them, ``TR-1``). Reports carry only the request id
(``KVConnectorOutput.finished_recving``), so this rule is what matches a late report to the
abandoned load rather than to a new one: while a load is parked the request never starts
another (divergence D7).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from spec.block_pool import BlockId

__all__ = ["Hold", "LoadRecord", "ParkedLoad"]


@dataclass(frozen=True, slots=True)
class LoadRecord:
    """An async load in flight.

    Attributes:
        started_step: the step that allocated its blocks.
        num_local_tokens: the local prefix hit under the claim.
        num_external_tokens: the tokens the connector loads.
    """

    started_step: int
    num_local_tokens: int
    num_external_tokens: int

    @property
    def claim_end(self) -> int:
        """The position the load brings the request to."""
        return self.num_local_tokens + self.num_external_tokens


@dataclass(frozen=True, slots=True)
class ParkedLoad:
    """An abandoned load whose transfer has not reported yet.

    Attributes:
        load: the abandoned load.
        blocks: the blocks it may still write, each holding one extra reference until the
            report (the scheduler's "held outside a table" references).
    """

    load: LoadRecord
    blocks: tuple[BlockId, ...]


class Hold(Enum):
    """Why a finished request's blocks are not freed yet.

    - ``LOAD``: its async load has not reported (abort during a load).
    - ``STORE``: the connector's ``request_finished_all_groups`` returned True; the blocks are
      read by stores until ``finished_sending``.
    """

    LOAD = "load"
    STORE = "store"
