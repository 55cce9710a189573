"""A request as the scheduler model sees it: an immutable value with a lifecycle status.

vLLM 0.33 keeps a mutable ``Request`` (``v1/request.py``); here every change builds a new value
(:meth:`Request.evolve`), so copying a scheduler state is a dict copy. ``RequestStatus`` names
the statuses the model reaches (``v1/request.py`` ``RequestStatus``, cut down).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

from spec.connector_api import RequestId, RequestView
from spec.errors import ConfigError
from spec.scheduler.block_hashes import block_hashes

__all__ = ["Request", "RequestStatus", "block_hashes"]


class RequestStatus(Enum):
    """Where a request is in its life.

    - ``WAITING``: queued, never run or resumed after a load.
    - ``WAITING_FOR_REMOTE_KVS``: an async load is filling its blocks; not running.
    - ``RUNNING``: in the running queue.
    - ``PREEMPTED``: pushed back to waiting, blocks freed, computed tokens reset.
    - ``FINISHED_*``: done (stop token, length, abort, error); final.
    """

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        """True for the four final statuses."""
        return self.value.startswith("finished")


@dataclass(frozen=True, slots=True)
class Request:
    """One request: what the caller gave (first six fields) and how far it got (the rest).

    Attributes:
        request_id: the scheduler's id.
        prompt_token_ids: the prompt (at least one token).
        max_tokens: output tokens after which it finishes with FINISHED_LENGTH (>= 1).
        cache_salt: the isolation domain (enters the first block hash).
        arrival_step: the scheduler step at which it arrived (ages count from it).
        stop_token_ids: sampled tokens that finish it with FINISHED_STOPPED.
        status: the lifecycle status.
        output_token_ids: the tokens sampled so far.
        num_computed_tokens: tokens whose KV the request's blocks hold (or will, once a pending
            async load lands).
        num_preemptions: how often it was preempted.
        shared_prefix_boundary: the junction its last prefix look-up pinned (vLLM's
            ``request.shared_prefix_boundary``; 0: none), see
            :attr:`spec.managers.CacheHit.shared_prefix_boundary`.
    """

    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    cache_salt: str | None = None
    arrival_step: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: tuple[int, ...] = ()
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    shared_prefix_boundary: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_token_ids, tuple) or not self.prompt_token_ids:
            raise ConfigError(
                "prompt_token_ids", self.prompt_token_ids, "need a non-empty tuple", _FIX_TUPLE
            )
        for field in (
            "max_tokens",
            "arrival_step",
            "num_computed_tokens",
            "num_preemptions",
            "shared_prefix_boundary",
        ):
            value = getattr(self, field)
            low = 1 if field == "max_tokens" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(field, value, f"must be an int >= {low}", "pass a valid count")
        if self.num_computed_tokens > self.num_tokens:
            raise ConfigError(
                "num_computed_tokens",
                self.num_computed_tokens,
                f"exceeds the {self.num_tokens} tokens of the request",
                "compute at most every token",
            )

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Prompt followed by the outputs."""
        return self.prompt_token_ids + self.output_token_ids

    def view(self) -> RequestView:
        """What a connector may read (:class:`spec.connector_api.RequestView`).

        Pure."""
        return RequestView(self.request_id, self.token_ids, self.num_prompt_tokens, self.cache_salt)

    def evolve(self, **changes: Any) -> Request:
        """A copy with ``changes`` applied (validated like a new request).

        Pure: ``self`` is unchanged. Refusal: changes that make an invalid request raise
        :class:`ConfigError` naming the field."""
        return dataclasses.replace(self, **changes)


_FIX_TUPLE = "pass the prompt as a tuple of ints"
