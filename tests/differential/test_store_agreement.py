"""The optimized host store agrees with the reference model on every trace hypothesis draws.

Each trace builds both stores (same capacity, same policy), then applies the same operations
to both: lookups, stores with successful and failed completions, loads and their completions,
touches, event drains, stats, and bad input (non-bytes keys, repeats, completing keys with
nothing in flight, a non-bool ``success``). A small key alphabet against a capacity of 1-5
keeps eviction pressure, ghost hits (ARC) and NO_SPACE refusals frequent. After every
operation the two sides must return the same value (compared as plain values: enums by class
name and ``.value``), raise corresponding errors with the same ``field``, and export equal
snapshots; at the end the ST-* invariants hold on the optimized snapshot.

The one legitimate difference is the error type, written down in ``ERROR_TYPES``.
Run count: 200 traces per policy and mix in the ci profile (800 in all): the ``mixed`` mix
(every operation and bad input, 1-60 steps) and the ``pressure`` mix (stores, touches and
loads only, 20-120 steps, to reach ARC's adaptation and its T1/T2 boundary cases).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import subprocess
import sys
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import hybridkv.errors
import hybridkv.store
import hybridkv.store.manager
import spec.errors
import spec.policies
import spec.store
from spec.invariants import check_all

SpecStore = spec.store.HostStore
FastStore = hybridkv.store.HostStore
ERROR_TYPES = {spec.errors.ConfigError: hybridkv.errors.HybridKVConfigError}

KEYS = tuple(f"k{i}".encode() for i in range(8))
JUNK_KEYS: tuple[Any, ...] = (b"", "k0", 7, None, bytearray(b"k0"), True)
# Weighted by repetition: stores and their completions dominate, so entries turn over and
# evictions (and ARC ghost hits) happen in most traces rather than NO_SPACE everywhere.
OPERATIONS = (
    *("prepare_store",) * 4,
    *("complete_store",) * 4,
    *("complete_load",) * 2,
    *("touch",) * 2,
    "lookup",
    "status",
    "prepare_load",
    "evict",
    "take_events",
    "stats",
    "junk",
)
# Pressure mix: stores land, READY keys are touched (T1 -> T2) and evicted keys come back
# (ghost hits), in long traces; this is what reaches ARC's target adaptation and its T1/T2
# choice at |T1| == floor(p).
PRESSURE = (
    *("prepare_store",) * 3,
    *("complete_store",) * 3,
    *("touch",) * 3,
    "prepare_load",
    "complete_load",
    "evict",
    "lookup",
)
MIXES = {"mixed": (OPERATIONS, (1, 60)), "pressure": (PRESSURE, (20, 120))}
AIMED = (True, True, True, False)  # mostly complete what is in flight; sometimes junk keys


def plain(value: Any) -> Any:
    """A value both sides can be compared by: enums and records become named plain tuples."""
    if isinstance(value, Enum):
        return (type(value).__name__, value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return (type(value).__name__, tuple(plain(getattr(value, f.name)) for f in fields))
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return (type(value).__name__, tuple(plain(item) for item in value))
    if isinstance(value, (tuple, list)):
        return tuple(plain(item) for item in value)
    return value


def _call(
    store: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], before: dict[str, Any]
) -> Any:
    """The plain result of one call, or ("error", mapped type, field) for a config error.

    ``before`` is the store's snapshot before the call (taken by the caller's last check).
    """
    if "priority" in kwargs:  # drawn as its value: each side gets its own enum member
        priorities = (
            spec.store.StorePriority
            if isinstance(store, SpecStore)
            else hybridkv.store.StorePriority
        )
        kwargs = {**kwargs, "priority": priorities(kwargs["priority"])}
    try:
        return plain(getattr(store, name)(*args, **kwargs))
    except (spec.errors.ConfigError, hybridkv.errors.HybridKVConfigError) as error:
        # A refused call changes nothing, on either side.
        assert store.snapshot() == before
        return ("error", ERROR_TYPES.get(type(error), type(error)), error.field)


def _label(result: Any) -> str:
    """A coarse outcome for hypothesis' statistics: error, refusal or accepted."""
    if isinstance(result, tuple) and result[:1] in (("error",), ("Refusal",)):
        return f"{result[0]} {result[-1]}"
    return "accepted"


def _note_pressure(snapshot: dict[str, Any], policy: str) -> None:
    """Statistics that show the traces reach evictions and (ARC) ghost hits."""
    if snapshot["counters"]["evicted"]:
        event("some entry was evicted")
    if policy == "arc" and snapshot["policy"]["extra"]["target"] != (0, 1):
        event("ARC target p moved")


@functools.cache
def _sampled(choices: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    # Strategies are built once per choice set: building them per draw dominated the run time.
    return st.sampled_from(choices)


@functools.cache
def _key_lists(
    pool: tuple[bytes, ...], distinct: bool, size: tuple[int, int]
) -> st.SearchStrategy[list[bytes]]:
    low, high = size
    return st.lists(_sampled(pool), min_size=min(low, len(pool)), max_size=high, unique=distinct)


def _draw_keys(
    data: st.DataObject, pool: list[bytes], *, distinct: bool, size: tuple[int, int] = (0, 5)
) -> list[bytes]:
    if not pool:
        return []
    return data.draw(_key_lists(tuple(pool), distinct, size))


def _in_state(store: SpecStore, state: str, *, pinned: bool = False) -> list[bytes]:
    return [
        bytes.fromhex(key)
        for key, entry_state, pins in store.snapshot()["entries"]
        if entry_state == state and (pins > 0 or not pinned)
    ]


# Operations whose keys are aimed (mostly) at entries in a given state: (state, pinned only).
AIM = {
    "prepare_load": ("ready", False),
    "complete_store": ("storing", False),
    "complete_load": ("ready", True),
    "evict": ("ready", False),  # pinned ones among them are left alone
}
# Prepare_store mostly names 1-3 keys, so that eviction (not NO_SPACE) usually answers pressure.
SIZES = {"prepare_store": ((1, 3), (1, 3), (0, 6)), "complete_store": ((1, 5),)}
SIZES["complete_load"] = SIZES["complete_store"]


def _draw_operation(
    data: st.DataObject, ref: SpecStore, mix: tuple[str, ...]
) -> tuple[str, tuple[Any, ...], dict]:
    """One operation, aimed at the reference's current state so completions mostly make sense."""
    name = data.draw(_sampled(mix))
    if name == "junk":
        return _draw_junk(data)
    if name in ("take_events", "stats"):
        return name, (), {}
    if name == "status":
        return name, (data.draw(_sampled(KEYS)),), {}
    pool = list(KEYS)
    if name in AIM and data.draw(_sampled(AIMED)):
        state, pinned = AIM[name]
        pool = _in_state(ref, state, pinned=pinned)
    size = data.draw(_sampled(SIZES.get(name, ((0, 5),))))
    keys = _draw_keys(data, pool, distinct=name not in ("lookup", "touch"), size=size)
    kwargs: dict[str, Any] = {}
    if name == "complete_store":
        kwargs["success"] = data.draw(_sampled((True, True, True, False)))
    if name == "prepare_store" and data.draw(_sampled((False, True))):
        # Admission classes: a LOW store takes free slots only.
        kwargs["priority"] = data.draw(_sampled(("normal", "low")))
    if name == "prepare_store" and isinstance(keys, list) and data.draw(_sampled((False, True))):
        # Unit binding: dead-weight victims (a bound key whose call lost a key) go first.
        kwargs["bound"] = [key for key in keys if data.draw(_sampled((False, True)))]
    return name, (keys,), kwargs


def _draw_junk(data: st.DataObject) -> tuple[str, tuple[Any, ...], dict]:
    """A call that breaks a pre-condition: both sides must refuse it the same way."""
    target = data.draw(
        st.sampled_from(
            ("lookup", "prepare_store", "prepare_load", "complete_load", "touch", "evict")
        )
    )
    shape = data.draw(_sampled(("bad_key", "repeat", "not_a_list", "bad_success")))
    if shape == "bad_key":
        bad = data.draw(st.sampled_from(JUNK_KEYS))
        return target, ([KEYS[0], bad],), {}
    if shape == "repeat":
        return target, ([KEYS[1], KEYS[1]],), {}
    if shape == "not_a_list":
        return target, (data.draw(_sampled((b"k0", "k0", 3, None))),), {}
    return "complete_store", ([],), {"success": data.draw(_sampled((1, None, "yes")))}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("policy", ["lru", "arc"])
@given(capacity=st.integers(1, 5), data=st.data())
def test_both_stores_agree_operation_by_operation(
    policy: str, mix: str, capacity: int, data: st.DataObject
) -> None:
    ref, fast = SpecStore(capacity, policy), FastStore(capacity, policy)
    operations, (shortest, longest) = MIXES[mix]
    steps = data.draw(st.integers(shortest, longest), label="steps")
    snapshot = fast.snapshot()
    assert snapshot == ref.snapshot()
    for _ in range(steps):
        name, args, kwargs = _draw_operation(data, ref, operations)
        expected = _call(ref, name, args, kwargs, snapshot)
        actual = _call(fast, name, args, kwargs, snapshot)
        assert actual == expected, (name, args, kwargs)
        snapshot = fast.snapshot()
        assert snapshot == ref.snapshot(), (name, args, kwargs)
        event(f"{name} -> {_label(expected)}")
        _note_pressure(snapshot, policy)
    assert plain(fast.stats()) == plain(ref.stats())
    assert check_all("store", fast.snapshot()) == {}


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_refusals_agree_under_pins_and_storing_entries(policy: str) -> None:
    """A hand-made corner: every entry pinned or STORING, so any store must be refused."""
    stores = [SpecStore(2, policy), FastStore(2, policy)]
    for store in stores:
        store.prepare_store([KEYS[0]])
        store.complete_store([KEYS[0]], success=True)
        store.prepare_load([KEYS[0]])  # k0 READY, pinned
        store.prepare_store([KEYS[1]])  # k1 STORING
    results = [plain(store.prepare_store([KEYS[2]])) for store in stores]
    assert results == [("Refusal", "no_space")] * 2
    assert stores[1].snapshot() == stores[0].snapshot()


# ----------------------------------------------------------------- guard: different code


def test_the_two_stores_are_different_code() -> None:
    assert SpecStore is not FastStore
    assert SpecStore.__module__ == "spec.store"
    assert FastStore.__module__ == "hybridkv.store.manager"
    for method in ("lookup", "prepare_load", "complete_load", "touch", "prepare_store", "evict"):
        slow_code = getattr(SpecStore, method).__code__
        fast_code = getattr(FastStore, method).__code__
        assert slow_code.co_filename != fast_code.co_filename
        assert slow_code.co_code != fast_code.co_code
    for slow_policy, fast_policy in (
        (spec.policies.LRUPolicy, hybridkv.store.LRUPolicy),
        (spec.policies.ARCPolicy, hybridkv.store.ARCPolicy),
    ):
        assert slow_policy is not fast_policy
        assert slow_policy.victims.__code__.co_code != fast_policy.victims.__code__.co_code
    # Each side keeps its own policy type: the optimized store refuses the spec's policy.
    with pytest.raises(hybridkv.errors.HybridKVConfigError) as caught:
        FastStore(3, spec.policies.LRUPolicy(3))  # type: ignore[arg-type]
    assert caught.value.field == "cache_policy"


def test_the_optimized_store_never_imports_spec() -> None:
    package = Path(hybridkv.store.__file__).parent
    imported: set[str] = set()
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
    assert "spec" not in imported
    assert "hybridkv" in imported  # the scan sees imports at all
    # And at run time: with spec unimportable the optimized store still loads and works.
    code = (
        "import sys\n"
        "sys.modules['spec'] = None\n"
        "from hybridkv.store import HostStore\n"
        "s = HostStore(1, 'arc')\n"
        "s.prepare_store([b'a'])\n"
        "s.complete_store([b'a'], success=True)\n"
        "print(s.prepare_store([b'b']).evicted_keys)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(b'a',)"


# Unit-shaped stores: 4 units of a full-attention key and two mamba states each, the mamba
# states bound to the unit (as the connector binds them). Stores name a whole unit (or what
# is missing of it plus the rest), evictions for room and for bad data split units, so
# several dead keys wait at once and their order (first dead, first out) decides victims.
UNITS = tuple(tuple(f"u{u}{part}".encode() for part in "fmn") for u in range(4))


def _draw_unit_operation(data: st.DataObject, ref: SpecStore) -> tuple[str, tuple, dict]:
    name = data.draw(_sampled(("prepare_store",) * 3 + ("complete_store",) * 3 + UNIT_OTHERS))
    if name == "prepare_store":
        unit = data.draw(_sampled(UNITS))
        # Bound in either order: one departure kills its unit's states in binding order.
        return name, (list(unit),), {"bound": data.draw(st.permutations(unit[1:]))}
    if name == "complete_store":
        storing = _in_state(ref, "storing")
        keys = _draw_keys(data, storing, distinct=True, size=(1, 6))
        return name, (keys,), {"success": data.draw(_sampled((True, True, True, False)))}
    pool = _in_state(ref, "ready") or list(KEYS)
    return name, (_draw_keys(data, pool, distinct=name != "touch", size=(1, 2)),), {}


UNIT_OTHERS = ("touch", "evict", "prepare_load")


@pytest.mark.parametrize("policy", ["lru", "arc"])
@given(capacity=st.integers(3, 9), data=st.data())
def test_both_stores_agree_on_unit_shaped_traces(
    policy: str, capacity: int, data: st.DataObject
) -> None:
    ref, fast = SpecStore(capacity, policy), FastStore(capacity, policy)
    snapshot = fast.snapshot()
    for _ in range(data.draw(st.integers(10, 80), label="steps")):
        name, args, kwargs = _draw_unit_operation(data, ref)
        expected = _call(ref, name, args, kwargs, snapshot)
        assert _call(fast, name, args, kwargs, snapshot) == expected, (name, args, kwargs)
        snapshot = fast.snapshot()
        assert snapshot == ref.snapshot(), (name, args, kwargs)
        if name == "prepare_store" and expected[0] == "PrepareStoreOutput":
            event(f"victims {len(expected[1][1])}")
    assert check_all("store", fast.snapshot()) == {}


@pytest.mark.parametrize("store_type", [SpecStore, FastStore])
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_key_that_died_first_leaves_first(store_type: type, policy: str) -> None:
    """Two units' mamba states die in the order opposite to the policy's (LRU: oldest first):
    the first to die is the victim, not the policy's first."""
    store = store_type(4, policy)
    (f1, m1, _), (f2, m2, _) = UNITS[0], UNITS[1]
    for full, state in ((f1, m1), (f2, m2)):
        store.prepare_store([full, state], bound=[state])
        store.complete_store([full, state], success=True)
    assert store.evict([f2]) == (f2,)  # m2 dies first
    assert store.evict([f1]) == (f1,)  # then m1, older in the policy's order
    out = store.prepare_store(list(UNITS[2]))  # three keys, two slots free: one victim
    assert out.evicted_keys == (m2,)
