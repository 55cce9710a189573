"""The core's costs, observed from outside: hashes computed once, claims linear, no leftovers.

The reference connector re-hashes a request at every call and tries every claim end with all
its keys; these tests pin the optimized core's promises (hybridkv.connector.core docstring) to
numbers a regression would break: a request's block hashes are computed once over its life,
a claim looks each unit's key up a bounded number of times, and finished requests leave no
per-request state behind (no per-step work grows with the requests ever seen).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

from hybridkv.connector import (
    ClaimKind,
    ConnectorCore,
    ConnectorMeta,
    JobId,
    JobResult,
    KVConnectorOutput,
    RequestId,
    RequestView,
    ScheduledRequest,
    StepView,
)
from hybridkv.kinds import GroupKind
from hybridkv.planner import HybridOffloadPlanner
from hybridkv.store import EntryState, HostStore, LookupResult

FULL, SLIDING, MAMBA = GroupKind.FULL, GroupKind.SLIDING, GroupKind.MAMBA


class CountingStore(HostStore):
    """The optimized store, counting the per-key lookups the core makes."""

    lookups = 0
    compared = 0  # keys whose states entry_states read (the claim memo's check)

    def status(self, key: bytes) -> LookupResult:
        self.lookups += 1
        return super().status(key)

    def entry_states(self, keys: Sequence[bytes]) -> tuple[EntryState | None, ...]:
        self.compared += len(keys)
        return super().entry_states(keys)


def _core(capacity: int = 4096) -> ConnectorCore:
    planner = HybridOffloadPlanner(((FULL, 4), (SLIDING, 4), (MAMBA, 4)), 2, 4, 1 << 14)
    return ConnectorCore(
        planner,
        CountingStore(capacity),
        (FULL, SLIDING, MAMBA),
        2,
        4,
        sliding_windows=(0, 7, 0),
    )


def _view(rid: str, tokens: tuple[int, ...]) -> RequestView:
    return RequestView(RequestId(rid), tokens, len(tokens))


def _table(n: int, base: int) -> tuple[tuple[int, ...], ...]:
    blocks = -(-n // 4)
    return tuple(tuple(base + g * 10_000 + i for i in range(blocks)) for g in range(3))


def _complete_all(core: ConnectorCore, meta: ConnectorMeta) -> None:
    jobs = (*meta.load_jobs, *meta.store_jobs)
    results = tuple(JobResult(JobId(j.job_id), True) for j in jobs)
    core.update_connector_output(KVConnectorOutput(completed_jobs=results))


def test_a_request_is_hashed_once_however_often_it_is_asked_and_stored() -> None:
    core = _core()
    tokens = tuple(range(1, 401))  # a 400-token prompt, then 200 decode tokens
    prompt, step = 400, 0
    for end in range(0, prompt, 64):  # prefill in 64-token chunks, asked before each
        view = _view("A", tokens[:prompt])
        core.get_num_new_matched_tokens(view, 0) if end == 0 else None
        step += 1
        n = min(64, prompt - end)
        row = ScheduledRequest(view, _table(end + n, 1), end, n)
        _complete_all(core, core.build_connector_meta(StepView(step, (row,))))
    full = tokens
    for i in range(200):  # decode: one token per step, the view grows by one each time
        full = (*full, 1000 + i)
        step += 1
        row = ScheduledRequest(_view("A", full), _table(len(full), 1), len(full) - 1, 1)
        _complete_all(core, core.build_connector_meta(StepView(step, (row,))))
    assert core.stats().hashes_computed == len(full) // 2  # hash block 2: each block once
    assert core.stats().store_items > 0


def test_a_claim_looks_each_key_up_a_bounded_number_of_times() -> None:
    core = _core()
    tokens = tuple(range(1, 2002))  # 2000 claimable tokens: 500 units per group
    stored = core.seed(_view("S", tokens), 2000)
    assert stored == 3 * 500
    store = core.store
    assert isinstance(store, CountingStore)
    before = store.lookups
    claim = core.get_num_new_matched_tokens(_view("B", tokens), 0)
    assert claim.kind is ClaimKind.ASYNC
    assert claim.num_tokens == 2000
    # full: 500 units; sliding: its 2-unit window; mamba: 1 state. The reference tries each
    # of the 500 candidate ends with all their keys (about 125,000 lookups).
    assert store.lookups - before <= 500 + 2 + 1
    # A second ask of an unchanged request is answered from memory.
    again = store.lookups
    assert core.get_num_new_matched_tokens(_view("B", tokens), 0) == claim
    assert store.lookups == again


def test_a_re_ask_is_searched_again_only_when_a_key_it_read_moved() -> None:
    core = _core()
    tokens = tuple(range(1, 402))  # 400 claimable tokens: 100 units per group
    core.seed(_view("S", tokens), 200)  # the host holds the first half
    store = core.store
    assert isinstance(store, CountingStore)
    first = core.get_num_new_matched_tokens(_view("B", tokens), 0)
    assert (first.kind, first.num_tokens) == (ClaimKind.ASYNC, 200)
    # Another request's keys change status (stored): nothing B's search read moved, so the
    # re-ask is answered from memory, with no per-key lookup.
    core.seed(_view("C", tuple(range(5001, 5402))), 400)
    before = store.lookups
    assert core.get_num_new_matched_tokens(_view("B", tokens), 0) == first
    assert store.lookups == before
    # A key B's search read (the first absent unit past the claim) becomes READY: the re-ask
    # searches again and claims further.
    core.seed(_view("S", tokens), 400)
    again = core.get_num_new_matched_tokens(_view("B", tokens), 0)
    assert store.lookups > before
    assert (again.kind, again.num_tokens) == (ClaimKind.ASYNC, 400)


def test_a_re_ask_while_no_key_of_the_host_moved_reads_no_key_at_all() -> None:
    # The memo's check is the store's status counters first: unchanged, no key can have
    # moved, so not even the keys the search read are compared; moved, they are.
    core = _core()
    tokens = tuple(range(1, 402))
    core.seed(_view("S", tokens), 200)
    store = core.store
    assert isinstance(store, CountingStore)
    first = core.get_num_new_matched_tokens(_view("B", tokens), 0)
    lookups, compared = store.lookups, store.compared
    for _ in range(3):
        assert core.get_num_new_matched_tokens(_view("B", tokens), 0) is first
    assert (store.lookups, store.compared) == (lookups, compared)
    core.seed(_view("C", tuple(range(5001, 5402))), 400)  # other keys move: compared once
    assert core.get_num_new_matched_tokens(_view("B", tokens), 0) is first
    assert core.get_num_new_matched_tokens(_view("B", tokens), 0) is first
    assert store.lookups == lookups
    # The first ask compared the keys it read (kept with the answer); the first re-ask after
    # the move compares them again, the second finds the counters as the first left them.
    assert compared > 0
    assert store.compared == 2 * compared
    core.seed(_view("S", tokens), 400)  # a key B's search read moves: searched again
    again = core.get_num_new_matched_tokens(_view("B", tokens), 0)
    assert store.lookups > lookups
    assert (again.kind, again.num_tokens) == (ClaimKind.ASYNC, 400)


def test_claims_of_one_size_are_one_value_for_every_request() -> None:
    # A claim is a frozen value: the core builds one per size and load mode and hands it to
    # every request that claims that many tokens (no value built per lookup).
    core = _core()
    tokens = tuple(range(1, 402))
    core.seed(_view("S", tokens), 400)
    b = core.get_num_new_matched_tokens(_view("B", tokens), 0)
    c = core.get_num_new_matched_tokens(_view("C", tokens), 0)
    assert (b.kind, b.num_tokens) == (ClaimKind.ASYNC, 400)
    assert c is b
    shorter = core.get_num_new_matched_tokens(_view("D", tokens[:250]), 0)
    assert shorter.num_tokens == 248  # another size, another value
    assert shorter is not b


def test_a_claim_past_a_hole_jumps_instead_of_walking_every_end() -> None:
    core = _core()
    tokens = tuple(range(1, 2002))
    core.seed(_view("S", tokens), 1000)  # the host holds the first half only
    store = core.store
    assert isinstance(store, CountingStore)
    before = store.lookups
    claim = core.get_num_new_matched_tokens(_view("B", tokens), 0)
    assert claim.num_tokens == 1000
    assert store.lookups - before <= 2 * 500 + 3 * 250  # each unit a bounded number of times


def test_finished_requests_leave_no_state_behind() -> None:
    core = _core()
    for r in range(300):
        tokens = tuple(range(r, r + 40))
        view = _view(f"r{r}", tokens)
        core.get_num_new_matched_tokens(view, 0)
        meta = core.build_connector_meta(
            StepView(r, (ScheduledRequest(view, _table(40, 1), 0, 39),))
        )
        assert core.request_finished_all_groups(view, _table(40, 1)) is bool(meta.store_jobs)
        _complete_all(core, meta)
    stats = core.stats()
    assert (stats.requests, stats.jobs_in_flight, stats.held_blocks) == (0, 0, 0)
    assert core.snapshot()["loads"] == ()
    assert core.snapshot()["delayed"] == ()


def test_the_core_imports_and_runs_without_torch() -> None:
    """The scheduler side is pure Python: a scheduler process never loads torch for it."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from hybridkv.connector import ConnectorCore, JobTracker, RequestId, RequestView\n"
        "from hybridkv.kinds import GroupKind\n"
        "from hybridkv.planner import HybridOffloadPlanner\n"
        "from hybridkv.store import HostStore\n"
        "p = HybridOffloadPlanner(((GroupKind.FULL, 2),), 2, 2, 64)\n"
        "core = ConnectorCore(p, HostStore(4), (GroupKind.FULL,), 2, 2)\n"
        "view = RequestView(RequestId('a'), (1, 2, 3, 4, 5), 5)\n"
        "core.seed(view, 4)\n"
        "print(core.get_num_new_matched_tokens(view, 0))\n"
        "JobTracker()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "ASYNC" in result.stdout
