"""Where each prompt token of ``hybridkv simulate`` came from: the token ledger.

Every token position of every request is *served* when its KV is in place for the request:
read from the GPU prefix cache when the request is admitted (``HIT``), written by a load job
that landed (``LOADED``, counted when the job reports success, not when it is claimed), or
computed by a forward (``COMPUTED``). A served position can be *lost*: a preemption or an
abandoned or failed load takes the request back to a shorter prefix. Serving a lost position
again is counted apart, by the cause that lost it.

The report's identity reads the ledger: every prompt token is served a first time exactly once,
so ``prompt tokens = computed + loaded + GPU hit`` (first time each), plus the prompt tokens
of requests that were aborted or failed before their prompt was served. It can fail: a
request that finishes normally with a prompt token never served leaves it short. A forward
that reads a position no counted event served is an *unaccounted read* (the scheduler claims
KV that no hit, load or forward put there).

Positions past the prompt (output tokens, read again after a preemption) are tracked so reads
can be checked, but counted in no figure: the figures are about prompt tokens.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

from spec.connector_api import RequestId

__all__ = ["Cause", "Source", "TokenLedger"]


class Source(Enum):
    """How a position was served."""

    COMPUTED = "computed"
    LOADED = "loaded"
    HIT = "hit"


class Cause(Enum):
    """Why a position is served again.

    - ``FAILURE``: a failed load's recovery or a load abandoned at its deadline took it back;
    - ``PREEMPTION``: the request was preempted (its blocks freed);
    - ``REPLAY``: it was still in place and served anyway (the last prompt token after a load
      of the whole prompt, recomputed to sample the next token).
    """

    FAILURE = "failure"
    PREEMPTION = "preemption"
    REPLAY = "replay"


# One byte per position: never served, in place, or lost (by which cause).
_NEVER, _HELD, _LOST_FAILURE, _LOST_PREEMPTION = 0, 1, 2, 3
_LOST = {Cause.FAILURE: _LOST_FAILURE, Cause.PREEMPTION: _LOST_PREEMPTION}
_CAUSE_OF = {_LOST_FAILURE: Cause.FAILURE, _LOST_PREEMPTION: Cause.PREEMPTION, _HELD: Cause.REPLAY}
_FIRST = {Source.COMPUTED: 1, Source.LOADED: 2, Source.HIT: 3}


@dataclass
class _Track:
    prompt_len: int
    state: bytearray = field(default_factory=bytearray)
    first: bytearray = field(default_factory=bytearray)  # the first source, 0 while never served
    epoch: int = 0  # bumped at every loss: a job issued before it serves nothing after it

    def grow(self, hi: int) -> None:
        if hi > len(self.state):
            extra = hi - len(self.state)
            self.state.extend(bytes(extra))
            self.first.extend(bytes(extra))


class TokenLedger:
    """Per request and token position: how it was first served and how it was served again.

    Counts (prompt positions only): ``first[source]``, ``again[(cause, source)]``,
    ``unaccounted_reads``; ``unserved_ended`` is the prompt tokens of requests that ended
    aborted or failed before their prompt was served (:meth:`ended`).
    """

    def __init__(self) -> None:
        self._tracks: dict[RequestId, _Track] = {}
        self.first: Counter[Source] = Counter()
        self.again: Counter[tuple[Cause, Source]] = Counter()
        self.unaccounted_reads = 0
        self.unserved_ended = 0

    def add(self, rid: RequestId, prompt_len: int) -> None:
        """A new request with ``prompt_len`` prompt tokens, none served."""
        self._tracks[rid] = _Track(prompt_len)

    def epoch(self, rid: RequestId) -> int:
        """The request's loss count: a load job carries the epoch it was issued in."""
        return self._tracks[rid].epoch

    def serve(self, rid: RequestId, source: Source, lo: int, hi: int) -> None:
        """Positions ``[lo, hi)`` are in place, brought by ``source``."""
        track = self._tracks[rid]
        track.grow(hi)
        state, prompt = track.state, track.prompt_len
        top = min(hi, prompt)
        if lo < top:
            never = state.count(_NEVER, lo, top)
            self.first[source] += never
            if never:
                _mark_first(track.first, lo, top, _FIRST[source])
            for code, cause in _CAUSE_OF.items():
                n = state.count(code, lo, top)
                if n:
                    self.again[(cause, source)] += n
        if lo < hi:
            state[lo:hi] = bytes([_HELD]) * (hi - lo)

    def lose(self, rid: RequestId, keep: int, cause: Cause) -> None:
        """The request keeps only ``[0, keep)``; the positions it held past that are lost."""
        track = self._tracks[rid]
        track.epoch += 1
        state = track.state
        if keep < len(state):
            state[keep:] = state[keep:].translate(_LOSE_TABLES[cause])

    def read(self, rid: RequestId, hi: int) -> int:
        """A forward reads ``[0, hi)``: how many of those positions are not in place (counted
        as unaccounted reads)."""
        track = self._tracks[rid]
        track.grow(hi)
        missing = hi - track.state.count(_HELD, 0, hi)
        self.unaccounted_reads += missing
        return missing

    def missing(self, rid: RequestId, lo: int, hi: int) -> bytes:
        """One byte per position of ``[lo, hi)``: 1 where it is not in place now."""
        track = self._tracks[rid]
        track.grow(hi)
        return bytes(int(code != _HELD) for code in track.state[lo:hi])

    def ended(self, rid: RequestId) -> None:
        """The request was aborted or failed: its never-served prompt tokens leave the identity."""
        track = self._tracks[rid]
        track.grow(track.prompt_len)
        self.unserved_ended += track.first.count(0, 0, track.prompt_len)

    def first_served_by_cache(self, rid: RequestId, lo: int, hi: int) -> int:
        """Positions of ``[lo, hi)`` first served by a GPU hit or a host load."""
        track = self._tracks[rid]
        track.grow(hi)
        first = track.first
        return first.count(_FIRST[Source.LOADED], lo, hi) + first.count(_FIRST[Source.HIT], lo, hi)

    def first_total(self) -> int:
        """Prompt tokens served a first time, over every source."""
        return sum(self.first.values())


def _mark_first(first: bytearray, lo: int, hi: int, code: int) -> None:
    first[lo:hi] = first[lo:hi].translate(_FIRST_TABLES[code])


def _table(old: int, new: int) -> bytes:
    return bytes(new if i == old else i for i in range(256))


_LOSE_TABLES = {cause: _table(_HELD, code) for cause, code in _LOST.items()}
_FIRST_TABLES = {code: _table(0, code) for code in _FIRST.values()}
