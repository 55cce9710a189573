"""An in-memory ChunkClient for the tests that need no server: a dict, scripted faults, a gate
(and :class:`SlowClient`, whose EXISTS and GET take as long as a test says).

It answers as a Redis server would (EXISTS, GET -> None when absent, SET overwrites) and lets a
test fail the next call of a kind (``fail_next["get"] = ClientFault.TIMEOUT``) or hold every SET
until ``gate`` is set, to see that the caller never waits on a write.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from hybridkv.remote import ClientFault


class FakeClient:
    """A dict behind the :class:`hybridkv.remote.ChunkClient` protocol."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.ttls: dict[bytes, int] = {}
        self.fail_next: dict[str, ClientFault] = {}
        self.calls: dict[str, int] = {"exists": 0, "get": 0, "set": 0}
        self.gate = threading.Event()
        self.gate.set()
        self.closed = False

    def _fault(self, op: str) -> ClientFault | None:
        self.calls[op] += 1
        return self.fail_next.pop(op, None)

    def exists(self, keys: Sequence[bytes]) -> tuple[bool, ...] | ClientFault:
        return self._fault("exists") or tuple(key in self.data for key in keys)

    def get(self, key: bytes) -> bytes | ClientFault | None:
        fault = self._fault("get")
        return fault if fault is not None else self.data.get(key)

    def set(self, key: bytes, value: bytes, ttl_s: int) -> ClientFault | None:
        self.gate.wait()
        fault = self._fault("set")
        if fault is None:
            self.data[key], self.ttls[key] = value, ttl_s
        return fault

    def close(self) -> None:
        self.closed = True


class SlowClient(FakeClient):
    """A :class:`FakeClient` whose server is slow on demand: EXISTS waits until ``release`` is
    set (set at first: a prompt server), GET sleeps ``get_delay_s`` first."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.release.set()
        self.get_delay_s = 0.0

    def exists(self, keys: Sequence[bytes]) -> tuple[bool, ...] | ClientFault:
        self.release.wait(10.0)
        return super().exists(keys)

    def get(self, key: bytes) -> bytes | ClientFault | None:
        time.sleep(self.get_delay_s)
        return super().get(key)
