"""One request's hashes, grown as its tokens arrive, and the offload keys read off them.

The reference connector re-derives every block hash of a request from its token ids at each
call (``spec.connector.scheduler_side.ReferenceConnector._hashes``): quadratic work over a
request's life. Here each request keeps a :class:`~hybridkv.hashing.RequestHashList`, fed only
the tokens it has not seen, so each block is hashed once (the hashes are byte-identical to the
reference's, ``tests/differential/test_hashing_agreement.py``).

A request whose view carries the engine's own block hashes (``RequestView.block_hashes``,
vLLM's ``request.block_hashes``) is not hashed here at all: its keys are read off those hashes,
which already fold in what the engine hashes beside the tokens (multimodal inputs, LoRA, salt).

A request's tokens only ever grow (prompt, then sampled tokens; preemption keeps them). If a
view arrives with fewer tokens or another salt than the state has seen, the state is rebuilt
from that view rather than trusted.
"""

from __future__ import annotations

from hybridkv.connector.api import RequestView
from hybridkv.connector.geometry import ConnectorGeometry
from hybridkv.hashing import RequestHashList

__all__ = ["RequestKeys"]


class RequestKeys:
    """The incremental hash chain of one request and its offload keys per (group, unit)."""

    __slots__ = ("_engine", "_geometry", "_given", "_hashes", "_keys", "_salt", "_seen")

    def __init__(
        self, geometry: ConnectorGeometry, cache_salt: str | None, *, engine_hashes: bool
    ) -> None:
        """An empty chain for ``cache_salt`` (None or a non-empty str, else field
        ``cache_salt``); ``engine_hashes``: the views carry the engine's block hashes."""
        self._geometry = geometry
        self._salt = cache_salt
        # Hashed here only without the engine's hashes (built once per request otherwise).
        self._hashes = (
            None
            if engine_hashes
            else RequestHashList(geometry.planner.hash_block_size, cache_salt=cache_salt)
        )
        self._engine = engine_hashes
        self._given: tuple[bytes, ...] = ()
        self._seen = 0
        # Keys built so far, per group, unit by unit from 0: a claim search, a load and the
        # stores of a request ask for the same keys again and again (each ask built a new
        # bytes object). Valid while the hashes they came from are unchanged (``sync``).
        self._keys: list[list[bytes]] = [[] for _ in geometry.suffixes]

    @classmethod
    def for_view(cls, geometry: ConnectorGeometry, view: RequestView) -> RequestKeys:
        """An empty chain of the kind ``view`` needs (its salt; engine hashes or not)."""
        return cls(geometry, view.cache_salt, engine_hashes=view.block_hashes is not None)

    def matches(self, view: RequestView) -> bool:
        """Whether ``view`` extends what this chain has seen (same salt, same hash source, no
        fewer tokens)."""
        return (
            view.cache_salt == self._salt
            and (view.block_hashes is not None) == self._engine
            and len(view.token_ids) >= self._seen
        )

    def sync(self, view: RequestView) -> int:
        """Hash the tokens of ``view`` this chain has not seen yet; returns the new hashes.

        Pre: :meth:`matches` (the caller rebuilds otherwise). Post: every full hash block of
        ``view.token_ids`` is hashed, each exactly once over the chain's life. A refused token
        (field ``tokens``) changes nothing.
        """
        tokens = view.token_ids
        if view.block_hashes is not None:
            given, old = view.block_hashes, self._given
            if given is not old and old and given[: len(old)] != old:
                self._keys = [[] for _ in self._keys]  # hashes changed under built keys
            self._given = given  # the engine hashed them: nothing computed here
            self._seen = len(tokens)
            return 0
        if len(tokens) <= self._seen or self._hashes is None:  # None: an engine chain (Pre)
            return 0
        new = self._hashes.append_tokens(tokens[self._seen :])
        self._seen = len(tokens)
        return new

    @property
    def hashed_tokens(self) -> int:
        """Tokens the chain's hashes cover (whole hash blocks): :meth:`key` reaches any unit
        ending there or before."""
        hashes = self._given if self._hashes is None else self._hashes
        return len(hashes) * self._geometry.planner.hash_block_size

    @property
    def hashes_computed(self) -> int:
        """Block hashes this chain has computed in its life (each once)."""
        return 0 if self._hashes is None else self._hashes.hashes_computed

    def key(self, group_idx: int, unit: int) -> bytes:
        """The offload key of unit ``unit`` of group ``group_idx``.

        Pre: the chain has hashed past the unit's end (IndexError otherwise).
        """
        built = self._keys[group_idx]
        if 0 <= unit < len(built):
            return built[unit]
        geometry = self._geometry
        stride, suffix = geometry.strides[group_idx], geometry.suffixes[group_idx]
        hashes = self._given if self._hashes is None else self._hashes
        if unit < 0:
            return hashes[(unit + 1) * stride - 1] + suffix  # as asked; not kept
        for j in range(len(built), unit + 1):  # IndexError past the hashed tokens, as before
            built.append(hashes[(j + 1) * stride - 1] + suffix)
        return built[unit]
