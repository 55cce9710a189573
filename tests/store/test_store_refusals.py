"""Every refusal of hybridkv.store.HostStore, whole: field, value, problem, fix and message.

tests/store/test_host_store_unit.py checks that each contract breach names its field and
changes nothing; the differential tests compare the field with the reference model. These pin
the rest of what a connector author reads: the value the error carries (the offending key, not
the whole list, where one key is at fault), the problem, the fix and the one-line message.
They were written for the mutants mutmut left alive in ``tools/mutants.py``'s runs over the
store's modules (docs/explanation/mutations.md, "Whole modules under mutmut").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from hybridkv.errors import HybridKVConfigError, readable
from hybridkv.store import ARCPolicy, HostStore, LRUPolicy, PrepareStoreOutput, StorePriority

A, B, C, D = (name.encode() for name in "abcd")
NOT_A_KEY = ("an offload key is non-empty bytes", "pass bytes")
NOT_KEYS = ("is not a sequence of keys", "pass a list of keys")
REPEATS = ("repeats a key", "pass each key once")


def loose(value: object) -> Any:
    """``value`` typed as Any: the refusals below pass what the signatures forbid on purpose."""
    return value


def refused(call: Callable[[], object], field: str, value: object, words: tuple[str, str]) -> None:
    """Run ``call``, which must refuse; check every part of the error and its message."""
    with pytest.raises(HybridKVConfigError) as info:
        call()
    err = info.value
    assert (err.field, err.problem, err.fix) == (field, *words)
    assert type(err.value) is type(value)
    assert err.value == value
    assert str(err) == f"{field}={readable(value)}: {words[0]}; {words[1]}"


def populated() -> HostStore:
    """a READY and pinned, b READY, c STORING, on a store of 4."""
    store = HostStore(4, "lru")
    out = store.prepare_store([A, B])
    assert isinstance(out, PrepareStoreOutput)
    store.complete_store(out.keys_to_store, success=True)
    store.prepare_load([A])
    store.prepare_store([C])
    return store


@pytest.mark.parametrize("capacity", [0, -2, True, 1.0, "3", None])
def test_a_bad_capacity_is_refused_whole(capacity: object) -> None:
    refused(
        lambda: HostStore(loose(capacity)),
        "num_chunks",
        capacity,
        ("must be an int >= 1", "give the tier at least one chunk"),
    )


def test_one_entry_is_the_smallest_store() -> None:
    store = HostStore(1)
    assert store.capacity == 1
    assert store.snapshot()["policy"]["name"] == "lru"


@pytest.mark.parametrize("name", ["fifo", "LRU", ""])
def test_an_unknown_policy_name_lists_the_known_ones(name: str) -> None:
    refused(
        lambda: HostStore(2, name),
        "cache_policy",
        name,
        ("unknown eviction policy", "use one of ('lru', 'arc')"),
    )


@pytest.mark.parametrize("policy", [LRUPolicy(3), ARCPolicy(1), object(), 2, None])
def test_a_policy_of_another_size_or_type_is_refused_whole(policy: object) -> None:
    refused(
        lambda: HostStore(2, loose(policy)),
        "cache_policy",
        policy,
        ("is not a policy for this capacity", "pass a policy name"),
    )


@pytest.mark.parametrize("used", ["resident", "ghost"])
def test_a_used_policy_is_refused_whole(used: str) -> None:
    policy = ARCPolicy(1)
    policy.on_insert(A)
    if used == "ghost":
        policy.on_evict([A])
        assert (policy.resident(), policy.ghosts()) == ((), (A,))
    refused(
        lambda: HostStore(1, policy),
        "cache_policy",
        policy,
        ("is not empty", "pass a fresh policy"),
    )


@pytest.mark.parametrize("policy_type", [LRUPolicy, ARCPolicy])
def test_a_fresh_policy_object_is_the_one_used(policy_type: type[LRUPolicy | ARCPolicy]) -> None:
    policy = policy_type(2)  # built here: a store fills it, so no two runs may share it
    store = HostStore(2, policy)
    store.prepare_store([A])
    assert policy.resident() == (A,)


@pytest.mark.parametrize("key", ["a", b"", bytearray(b"a"), 1, None, [A]])
def test_status_refuses_what_is_not_a_key(key: object) -> None:
    refused(lambda: populated().status(loose(key)), "key", key, NOT_A_KEY)


@pytest.mark.parametrize("keys", [b"ab", "ab", None, 3, 2.5])
@pytest.mark.parametrize(
    "call", ["lookup", "slots", "prepare_load", "complete_load", "touch", "prepare_store", "evict"]
)
def test_what_is_not_a_key_sequence_is_refused_whole(call: str, keys: object) -> None:
    refused(lambda: getattr(populated(), call)(keys), "keys", keys, NOT_KEYS)
    refused(lambda: populated().complete_store(loose(keys), success=True), "keys", keys, NOT_KEYS)


@pytest.mark.parametrize(("keys", "bad"), [([A, "b"], "b"), ((A, b""), b""), ([None], None)])
@pytest.mark.parametrize(
    "call", ["lookup", "slots", "prepare_load", "complete_load", "touch", "prepare_store", "evict"]
)
def test_a_bad_key_in_a_sequence_is_named_alone(call: str, keys: object, bad: object) -> None:
    refused(lambda: getattr(populated(), call)(keys), "keys", bad, NOT_A_KEY)


def test_keys_from_any_iterable_are_accepted() -> None:
    store = populated()
    assert store.lookup(loose(iter([A, B]))).hits == 2
    assert store.slots(loose(k for k in (B, A))) == (1, 0)
    assert store.lookup([]).hits == 0


@pytest.mark.parametrize(
    "call", ["prepare_load", "complete_load", "prepare_store", "evict", "complete_store"]
)
def test_a_repeated_key_names_the_whole_list(call: str) -> None:
    keys = [B, D, B]
    kwargs = {"success": True} if call == "complete_store" else {}
    refused(lambda: getattr(populated(), call)(keys, **kwargs), "keys", keys, REPEATS)


def test_lookup_and_touch_accept_repeated_keys() -> None:
    store = populated()
    assert store.lookup([A, A, B]).hits == 3
    store.touch([B, B, D])


def test_a_slot_of_an_absent_key_names_that_key() -> None:
    refused(
        lambda: populated().slots([A, D, C]), "keys", D, ("has no entry", "ask only resident keys")
    )


@pytest.mark.parametrize(("keys", "unpinned"), [([B], B), ([A, C], C), ([D, A], D)])
def test_completing_a_load_never_prepared_names_the_key(keys: list[bytes], unpinned: bytes) -> None:
    refused(
        lambda: populated().complete_load(keys),
        "keys",
        unpinned,
        ("is not pinned by a load", "complete once"),
    )


@pytest.mark.parametrize("priority", ["low", "normal", None, 1, True])
def test_a_priority_that_is_not_a_store_priority_is_refused(priority: object) -> None:
    refused(
        lambda: populated().prepare_store([D], loose(priority)),
        "priority",
        priority,
        ("is not a StorePriority", "pass StorePriority.NORMAL"),
    )


def test_the_priority_is_checked_before_the_keys() -> None:
    refused(
        lambda: populated().prepare_store(loose(b"ab"), loose("low")),
        "priority",
        "low",
        ("is not a StorePriority", "pass StorePriority.NORMAL"),
    )
    assert populated().prepare_store([D], StorePriority.LOW) == PrepareStoreOutput((D,), ())


@pytest.mark.parametrize("success", [1, 0, None, "yes"])
def test_success_must_be_a_bool(success: object) -> None:
    refused(
        lambda: populated().complete_store([C], loose(success)),
        "success",
        success,
        ("must be a bool", "pass True or False"),
    )


@pytest.mark.parametrize(("keys", "idle"), [([A], A), ([C, B], B), ([D], D)])
def test_completing_a_store_not_in_flight_names_the_key(keys: list[bytes], idle: bytes) -> None:
    refused(
        lambda: populated().complete_store(keys, success=True),
        "keys",
        idle,
        ("has no store in flight", "complete once"),
    )


class LookAlike:
    """Hashes and compares like the bytes key it wraps, and is not bytes: not an offload key."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return other == self.key

    def __repr__(self) -> str:
        return f"LookAlike({self.key!r})"


def test_status_refuses_a_look_alike_of_a_resident_key() -> None:
    # The dict lookup finds a's entry for the look-alike; the answer must still be a refusal.
    look_alike = LookAlike(A)
    refused(lambda: populated().status(loose(look_alike)), "key", look_alike, NOT_A_KEY)
    assert populated().status(A).value == "hit"


def test_slots_accept_repeated_keys() -> None:
    assert populated().slots([B, A, B]) == (1, 0, 1)


def test_a_store_sized_in_bytes_keeps_its_policy() -> None:
    store = HostStore.from_bytes(3 * 4096 + 1, 4096, "arc")
    assert store.capacity == 3
    assert store.snapshot()["policy"]["name"] == "arc"
    assert HostStore.from_bytes(4096, 4096).snapshot()["policy"]["name"] == "lru"
