"""A claim refreshes the keys its load would read (``ConnectorCore._refresh_claim``).

vLLM asks a waiting request's claim each time its waiting loop reaches it, and the request can
then wait many steps before its load pins those keys, while the running requests' stores evict
by recency. Refreshed at each answer, the keys a request is about to read are as recent as the
announcement: the stores in between take older keys first (docs/explanation/host-store.md,
"A claim's chunks, refreshed when it is announced").
"""

from __future__ import annotations

from small_core import mamba_full_core

from hybridkv.connector import ClaimKind, ConnectorCore, RequestId, RequestView, StepView


def _view(rid: str, first: int) -> RequestView:
    tokens = tuple(range(first, first + 33))  # 33 tokens: 32 claimable, 8 units of 4
    return RequestView(RequestId(rid), tokens, len(tokens))


def _seeded(core: ConnectorCore, first: int, tokens: int) -> None:
    """Another request's first ``tokens`` tokens put READY on the host, most recent: every
    unit of both groups (8 tokens: 2 attention units and the states at 4 and 8)."""
    view = _view(f"seed-{first}", first)
    assert core.seed(view, tokens) == 2 * tokens // 4


def _ask(core: ConnectorCore, view: RequestView) -> tuple[ClaimKind, int]:
    """One ``schedule()`` that asks ``view``'s claim and admits nothing."""
    claim = core.get_num_new_matched_tokens(view, 0)
    core.build_connector_meta(StepView(1, ()))
    return claim.kind, claim.num_tokens


def test_a_waiting_claim_survives_the_stores_made_while_it_waits() -> None:
    core = mamba_full_core(8)
    waiting = _view("A", 1)
    _seeded(core, 1, 8)  # A's prefix: 4 entries; its claim of 8 reads 3 of them
    _seeded(core, 500, 8)  # another prefix, more recent: the host is full
    assert len(core.store.snapshot()["entries"]) == 8
    assert _ask(core, waiting) == (ClaimKind.ASYNC, 8)
    # A third prefix needs 4 slots: the victims are the least recent entries. Before the
    # refresh those were A's, asked for one step earlier; now they are A's state at 4, which
    # its claim does not read, and 3 of the other prefix's.
    _seeded(core, 900, 8)
    assert _ask(core, waiting) == (ClaimKind.ASYNC, 8)
    assert _ask(core, _view("B", 500)) == (ClaimKind.NONE, 0)


def test_a_claim_asked_again_is_refreshed_again() -> None:
    """The second answer comes from the claim's memo and refreshes its keys all the same."""
    core = mamba_full_core(8)
    waiting = _view("A", 1)
    _seeded(core, 1, 8)
    assert _ask(core, waiting) == (ClaimKind.ASYNC, 8)
    _seeded(core, 500, 8)  # now the more recent
    assert _ask(core, waiting) == (ClaimKind.ASYNC, 8)  # answered from the memo
    _seeded(core, 900, 8)
    assert _ask(core, waiting) == (ClaimKind.ASYNC, 8)
    assert _ask(core, _view("B", 500)) == (ClaimKind.NONE, 0)


def test_no_claim_refreshes_nothing() -> None:
    core = mamba_full_core(8)
    _seeded(core, 1, 8)
    _seeded(core, 500, 8)
    before = core.store.snapshot()
    assert _ask(core, _view("C", 900)) == (ClaimKind.NONE, 0)
    assert core.store.snapshot() == before
