"""A near store over a far one (:class:`hybridkv.remote.StackedClient`, issue 31: the disk tier
over the server), on two in-memory clients: which store each call asks, the fill on a far hit,
and what a fault of either store answers."""

from __future__ import annotations

from _fake_chunk_client import FakeClient

from hybridkv.remote import STACK_COUNTER_NAMES, ClientFault, StackedClient

K1, K2, K3 = b"k1", b"k2", b"k3"


def _stack() -> tuple[StackedClient, FakeClient, FakeClient]:
    near, far = FakeClient(), FakeClient()
    return StackedClient(near, far), near, far


def test_exists_asks_the_far_store_only_for_what_the_near_one_lacks() -> None:
    stack, near, far = _stack()
    near.data[K1] = b"a"
    far.data[K2] = b"b"
    assert stack.exists([K1, K2, K3]) == (True, True, False)
    assert far.calls["exists"] == 1
    near.data[K2] = near.data[K3] = b"c"
    assert stack.exists([K1, K2, K3]) == (True, True, True)
    assert far.calls["exists"] == 1  # the near store held them all: no far round trip


def test_a_fault_of_one_store_answers_for_its_own_keys_only() -> None:
    stack, near, far = _stack()
    near.data[K1] = b"a"
    far.data[K2] = b"b"
    far.fail_next["exists"] = ClientFault.TIMEOUT
    assert stack.exists([K1, K2]) == (True, False)  # the far store's keys: absent
    near.fail_next["exists"] = ClientFault.FAULT
    assert stack.exists([K1, K2]) == (False, True)  # the near store's keys: asked far
    near.fail_next["exists"] = ClientFault.FAULT
    far.fail_next["exists"] = ClientFault.TIMEOUT
    assert stack.exists([K1, K2]) is ClientFault.TIMEOUT  # both: the fault is the answer
    assert stack.counts()["near_faults"] == 2
    assert stack.counts()["far_faults"] == 2


def test_a_far_hit_fills_the_near_store_and_the_next_read_is_near() -> None:
    stack, near, far = _stack()
    far.data[K1] = b"value"
    assert stack.get(K1) == b"value"
    assert near.data[K1] == b"value"
    assert near.ttls[K1] == 0  # the near store evicts by its own limit
    assert stack.get(K1) == b"value"
    assert far.calls["get"] == 1
    assert stack.counts() == {**dict.fromkeys(STACK_COUNTER_NAMES, 0), "near_hits": 1,
                              "far_hits": 1, "fills": 1}  # fmt: skip


def test_a_failed_fill_still_returns_the_value() -> None:
    stack, near, far = _stack()
    far.data[K1] = b"value"
    near.fail_next["set"] = ClientFault.FAULT  # a full disk
    assert stack.get(K1) == b"value"
    assert K1 not in near.data
    assert stack.counts()["fills_failed"] == 1


def test_a_read_misses_only_where_both_miss_and_a_far_fault_is_returned() -> None:
    stack, near, far = _stack()
    assert stack.get(K1) is None
    near.fail_next["get"] = ClientFault.FAULT
    far.data[K2] = b"b"
    assert stack.get(K2) == b"b"  # a near fault falls through to the far store
    far.fail_next["get"] = ClientFault.SKIPPED  # the far store's breaker is open
    assert stack.get(K3) is ClientFault.SKIPPED


def test_a_write_goes_to_both_and_returns_the_first_fault() -> None:
    stack, near, far = _stack()
    assert stack.set(K1, b"a", 60) is None
    assert (near.data[K1], far.data[K1], near.ttls[K1], far.ttls[K1]) == (b"a", b"a", 0, 60)
    far.fail_next["set"] = ClientFault.TIMEOUT
    assert stack.set(K2, b"b", 0) is ClientFault.TIMEOUT
    assert near.data[K2] == b"b"  # the near store kept it
    near.fail_next["set"] = ClientFault.FAULT
    assert stack.set(K3, b"c", 0) is ClientFault.FAULT
    assert far.data[K3] == b"c"  # the far store kept it


def test_close_closes_both() -> None:
    stack, near, far = _stack()
    stack.close()
    assert near.closed
    assert far.closed
