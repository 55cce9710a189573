"""The core's :class:`~hybridkv.connector.RequestView` of a vLLM ``Request``, built once per
change of the request instead of once per hook call.

The scheduler side hands the core a view of a request in up to three hooks a step
(``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``), and
copying ``request.all_token_ids`` into a tuple is linear in the request's length: on the
benchmark's traces it was the largest single cost of the adapter
(docs/benchmarks/history/scheduler-cost-1.md). :class:`RequestViews` keeps the last view of
each request and

- returns it unchanged while the request object, its prompt length, its token count and its
  block-hash count are unchanged (nothing the view holds can have changed: see below);
- extends its token tuple by the new tail when only tokens (and hashes) were appended;
- builds a fresh view otherwise.

Why the tail is enough: vLLM 0.33's ``Request`` only appends to its token list
(``append_output_token_ids``), except a streaming session's update
(``Scheduler._update_request_as_session``), which drops the last sampled token, appends the
update's prompt and sets ``num_prompt_tokens`` to the new length. A view is reused or extended
only when ``num_prompt_tokens`` is the one it was built with and the request has no fewer
tokens; after such an update that happens only when the old view held no output and the update
brought no token, i.e. the tokens are the ones the view holds. The block hashes are read
afresh whenever anything changed (they are few: one per hash block).
"""

from __future__ import annotations

from itertools import chain
from typing import Any

from hybridkv.connector import RequestId, RequestView

__all__ = ["RequestViews", "block_table"]


class RequestViews:
    """The last view built per request id (module docstring)."""

    __slots__ = ("_views",)

    def __init__(self) -> None:
        self._views: dict[str, tuple[Any, RequestView]] = {}

    def view(self, request: Any) -> RequestView:
        """The view of ``request`` now: equal to one built from scratch."""
        # vLLM's id is a str: taken as the RequestId it is (the NewType's call is a Python
        # call per view, for nothing).
        rid: RequestId = request.request_id
        tokens = request.all_token_ids
        hashes = request.block_hashes
        prompt = int(request.num_prompt_tokens)
        count = len(tokens)  # a Python call on vLLM's ConstantList: asked once
        held = self._views.get(rid)
        if held is not None and held[0] is request:
            old = held[1]
            seen = len(old.token_ids)
            if old.num_prompt_tokens == prompt and count >= seen:
                if (
                    count == seen
                    and len(hashes) == len(old.block_hashes or ())
                    and old.cache_salt == request.cache_salt
                ):
                    return old
                new = RequestView(
                    rid,
                    old.token_ids + tuple(tokens[seen:]),
                    prompt,
                    request.cache_salt,
                    tuple(hashes),
                )
                self._views[rid] = (request, new)
                return new
        # tokens[:] is a list (vLLM's ConstantList slices its list), which tuple() copies in
        # one pass; tuple(tokens) would go through the ConstantList's iterator item by item.
        new = RequestView(rid, tuple(tokens[:]), prompt, request.cache_salt, tuple(hashes))
        self._views[rid] = (request, new)
        return new

    def forget(self, request_id: str) -> None:
        """The request finished: its view is not kept."""
        self._views.pop(request_id, None)

    def pop(self, request: Any) -> RequestView:
        """Forget ``request``'s view and return the last one built, or a new one if none was.

        For a finish: the core reads only the request's id there, so a view whose tokens lag
        the request's (decode steps that completed no unit build none) serves, and copying a
        long context into a fresh view at every finish is spared."""
        held = self._views.pop(request.request_id, None)
        if held is not None and held[0] is request:
            return held[1]
        view = self.view(request)
        del self._views[request.request_id]
        return view

    def __len__(self) -> int:
        return len(self._views)


def block_table(block_ids: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM's per-group block id lists as the core's ``BlockTable`` (tuples of ints).

    vLLM's ids are Python ints (``KVCacheBlock.block_id``), so the lists are copied as they
    are; any other integer type is converted, as before."""
    table = tuple(map(tuple, block_ids))
    if set(map(type, chain.from_iterable(table))) - {int}:
        return tuple(tuple(int(b) for b in group) for group in table)
    return table
