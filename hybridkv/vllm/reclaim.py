"""The restart guard: a request restarted by a failed load never wedges vLLM 0.33.

When an async load fails under ``kv_load_failure_policy="recompute"``, vLLM restarts the
request and asks the connector again. Failure salvage (``ConnectorCore``) answers that re-ask
with the longest still-valid prefix. On a tight GPU pool, vLLM 0.33 can then wedge: nothing
runs and nothing frees a block. This module is the facade's rule that keeps it from doing so.
Lines below are in ``vllm/v1/core/sched/scheduler.py`` unless named otherwise.

The restarted request's state in vLLM:

- An async admission adds the request to ``_inflight_prefills`` (1542). Only preemption
  (1820), the end of its prefill (1871) and its finish (3038) take it out again.
- A failed async load (``failed_recving``) resets the request to 0 computed tokens
  (``_handle_failed_recving``, 3699), and ``_update_waiting_for_remote_kv`` frees its blocks
  (3495). The request stays in ``kv_holding_waiting``, which is drained before ``waiting``
  (1065), and its ``_inflight_prefills`` entry stays too.
- In that same pass of the waiting loop, vLLM asks the connector again (1139). A refused
  allocation ``break``s the loop (1454). Every request behind the restarted one in
  ``kv_holding_waiting`` then waits too, including those whose loads finished and that hold
  the blocks. If nothing runs, nothing frees a block, and every later step is refused the
  same way: the wedge.

Two refusals lead there, and both are exact conditions in vLLM 0.33's admission:

- A re-claim (async) must fit in the free blocks less ``reserved_blocks`` (1420-1430;
  ``kv_cache_manager.py:584-586``). ``reserved_blocks`` sums ``_request_remaining_blocks``
  over every in-flight prefill (3432), and that sum includes the request's own stale entry:
  its whole remaining sequence (3404), on top of the blocks being allocated for the claim.
  Salvage reaches this one.
- Any admission under ``scheduler_reserve_full_isl`` (default True, ``config/scheduler.py:190``;
  passed at 1449) needs the request's whole sequence to fit in the free blocks
  (``kv_cache_manager.py:531-548``). A claim of nothing reaches this one too: vLLM's own
  whole-request recompute wedges on it when the requests behind hold too many blocks.

The rule, per restarted request (:class:`Restart`):

1. A request is FAILED from the ``failed_recving`` that reports its failed load until vLLM
   admits it (``update_state_after_alloc``, which vLLM calls on every admission from the
   waiting loop, 1482) or it finishes. In FAILED the facade answers as the core does
   (salvage).
2. If vLLM asked about the request in a ``schedule()`` and ``build_connector_meta`` (called at
   the end of every ``schedule()``, 1756) came before an admission, vLLM did not admit it.
   That is the refused allocation above, or another stop of the waiting loop between the ask
   and the admission (a mamba-aligned chunk of 0 tokens, encoder inputs, HiSparse's deferred
   loads, which a later admission clears anyway). The guard does not need to tell which.
3. If that ``schedule()`` scheduled some tokens, nothing changes, and the request is asked
   again at the next step. Requests are running, and they finish or get preempted, freeing
   blocks as they do.
4. If it scheduled nothing and no step is in flight, no forward frees a block (only a
   transfer still in flight could), so the same answer can be refused at every later step.
   Under async scheduling a step scheduled earlier may still be in vLLM's batch queue (its
   requests count ``num_in_flight_tokens``): its forward may finish a request and free its
   blocks, so such a ``schedule()`` counts as one that ran. The next answer is DEFER
   (``None``): vLLM skips the request (1054-1060). A request with 0 computed tokens, no longer
   WAITING_FOR_REMOTE_KVS, holds no blocks (``_holds_kv_blocks``, 2697-2706), so the skip moves
   it to ``waiting``. The requests behind it in ``kv_holding_waiting`` are admitted now, and
   the restarted one is asked again only once those are drained.
5. After a DEFER, if that ``schedule()`` ran something, the request is FAILED again, with
   salvage back on. If it ran nothing, deferring did not help, and the request is WHOLE: it is
   answered NONE, vLLM's whole-request recompute, which reserves nothing (1420: only async
   loads reserve). A WHOLE request refused again by a ``schedule()`` that ran nothing is
   deferred again, so it lets the requests behind it in ``waiting`` run.

The refusal is observed, not predicted: the facade cannot read the other in-flight prefills'
reservations, which live only in the scheduler. So salvage stays wherever vLLM admits the
re-claim, or admits it once the requests blocked behind it have run. Each averted wedge costs
one or two ``schedule()`` calls that ran nothing. The guard loops only when neither a claim of
nothing nor a skip lets anything run. No connector answer can fix that case: the pool is too
small for what is queued.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

__all__ = ["Answer", "ReclaimGuard", "Restart"]


class Restart(Enum):
    """Where a request restarted by a failed async load stands (module docstring)."""

    FAILED = "failed"  # answer as the core does (salvage)
    DEFER = "defer"  # refused while nothing ran: answer DEFER, so vLLM moves it to waiting
    WHOLE = "whole"  # deferring ran nothing either: answer NONE (whole-request recompute)


class Answer(Enum):
    """What the facade answers vLLM's ask for a request."""

    CORE = "core"  # the core's claim
    DEFER = "defer"  # (None, False)
    NONE = "none"  # (0, False)


_ANSWER = {Restart.FAILED: Answer.CORE, Restart.DEFER: Answer.DEFER, Restart.WHOLE: Answer.NONE}


class ReclaimGuard:
    """The facade's record of restarted requests and the refusals vLLM showed it.

    Counters (observed events): ``retried``, refusals in a step that ran something (asked
    again unchanged); ``deferred``, DEFER answers given; ``whole``, requests moved to
    whole-request recompute; ``overridden``, answers given instead of the core's (DEFER and
    claims of 0), which the core's lookup count never sees. ``enabled=False`` keeps the record
    and the counts but always answers as the core does. That is an in-package control for the
    test that pins vLLM's wedge, never a user setting.
    """

    __slots__ = ("_asked", "_state", "deferred", "enabled", "overridden", "retried", "whole")

    def __init__(self, *, enabled: bool = True) -> None:
        self._state: dict[str, Restart] = {}
        self._asked: set[str] = set()  # restarted requests asked in this schedule()
        self.enabled = enabled
        self.retried = 0
        self.deferred = 0
        self.whole = 0
        self.overridden = 0

    def state(self, request_id: str) -> Restart | None:
        """The request's state; None if it is not restarting after a failed load."""
        return self._state.get(request_id)

    def load_failed(self, request_ids: Iterable[str]) -> None:
        """vLLM reported these requests' async loads failed. Post: each is FAILED."""
        for rid in request_ids:
            self._state[rid] = Restart.FAILED

    def answer(self, request_id: str) -> Answer:
        """The answer to vLLM's ask for ``request_id``. Post: a restarted request is recorded
        as asked in this ``schedule()``; a DEFER answer is counted."""
        state = self._state.get(request_id)
        if state is None:
            return Answer.CORE
        self._asked.add(request_id)
        answer = _ANSWER[state] if self.enabled else Answer.CORE
        self.deferred += answer is Answer.DEFER
        self.overridden += answer is not Answer.CORE
        return answer

    def admitted(self, request_id: str) -> None:
        """vLLM allocated for the request. Post: it is forgotten. An async admission re-adds it
        to ``_inflight_prefills`` legitimately, and a scheduled request is running."""
        self._state.pop(request_id, None)
        self._asked.discard(request_id)

    def asked(self) -> bool:
        """Whether a restarted request was asked in this ``schedule()`` (almost never)."""
        return bool(self._asked)

    def schedule_ended(self, *, ran: bool) -> None:
        """``build_connector_meta``; ``ran``: this ``schedule()`` scheduled some tokens.

        Post, for each restarted request asked in this ``schedule()`` and not admitted: after a
        DEFER answer, FAILED if ``ran`` else WHOLE; after any other answer, unchanged if
        ``ran`` (one retry counted) else DEFER. The asked record is cleared.
        """
        if not self._asked:
            return  # no restarted request was asked (almost every step): nothing to move
        for rid in self._asked:
            state = self._state[rid]
            if state is Restart.DEFER:
                self._state[rid] = Restart.FAILED if ran else Restart.WHOLE
                self.whole += not ran
            elif ran:
                self.retried += 1
            else:
                self._state[rid] = Restart.DEFER
        self._asked = set()

    def finished(self, request_id: str) -> None:
        """The request finished (or was aborted). Post: it is forgotten."""
        self._state.pop(request_id, None)
        self._asked.discard(request_id)

    def __len__(self) -> int:
        return len(self._state)
