"""A request's block hashes, memoized so that each full block is hashed once in its life.

vLLM 0.33 keeps ``request.block_hashes`` on the request and extends it as tokens are appended
(``v1/request.py`` ``append_output_token_ids`` -> ``get_hash_new_full_blocks``). Here a request
is an immutable value, rebuilt at every change, so the chain lives in a memo beside it:
:func:`block_hashes` is a pure function of the request's tokens and salt, equal to
:func:`spec.hashing.request_block_hashes` over ``request.token_ids`` (a test holds the two
equal), and costs, per decode step, the blocks that became full, not the whole context.

Why a memo keyed by the prompt's identity: a key built from the tokens would hash the whole
token tuple at every call (about 100 us at 30k tokens), which is the cost being removed. Every
copy of a request (``Request.evolve``) shares its prompt tuple, so the prompt object names the
request's chain; the memo holds the tuple, so its ``id`` cannot be reused while the entry lives.
The outputs are compared, not trusted: an explorer branch that sampled other tokens extends
from the prompt's chain, never from another branch's.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spec.block_pool import BlockHash
from spec.hashing import next_block_hashes

if TYPE_CHECKING:
    from spec.scheduler.request import Request

__all__ = ["block_hashes"]

_MAX_CHAINS = 4096  # requests remembered; the least recently asked is forgotten first


@dataclass(frozen=True, slots=True)
class _Chain:
    """The hashes of the full blocks of ``prompt + outputs`` (salt and block size: the key).

    Attributes:
        prompt: the prompt tuple hashed (the very object: the memo's key is its ``id``).
        outputs: the output tokens covered.
        hashes: one per full block, in order.
        last: the raw digest of the last full block (the parent of the next); None: no block.
    """

    prompt: tuple[int, ...]
    outputs: tuple[int, ...]
    hashes: tuple[BlockHash, ...]
    last: bytes | None

    def extended(self, outputs: tuple[int, ...], salt: str | None, size: int) -> _Chain:
        """This chain over ``outputs`` (which start with ``self.outputs``): new full blocks only.

        The tokens past the last full block are checked again (at most a block, plus the new
        ones), so a bad token is refused, as :func:`spec.hashing.request_block_hashes` would
        refuse it (ConfigError, field ``tokens``), even before it fills a block.
        """
        start = len(self.hashes) * size
        raw = next_block_hashes(
            self.last, start, _tokens_from(self.prompt, outputs, start), size, cache_salt=salt
        )
        fresh = tuple(BlockHash(h.hex()) for h in raw)
        return _Chain(self.prompt, outputs, self.hashes + fresh, raw[-1] if raw else self.last)


def _tokens_from(prompt: tuple[int, ...], outputs: tuple[int, ...], start: int) -> tuple[int, ...]:
    """``(prompt + outputs)[start:]`` without building ``prompt + outputs``."""
    if start >= len(prompt):
        return outputs[start - len(prompt) :]
    return prompt[start:] + outputs


# (id of the prompt, salt, block size) -> (the prompt's own chain, the chain last extended).
# An entry holds its prompt, so no other live tuple has that id while the entry lives.
_Key = tuple[int, str | None, int]
_chains: OrderedDict[_Key, tuple[_Chain, _Chain]] = OrderedDict()


def block_hashes(request: Request, hash_block_size: int) -> tuple[BlockHash, ...]:
    """The request's block hashes every ``hash_block_size`` tokens (vLLM's sha256 chain).

    Pure (the memo shows in speed only): equal to ``request_block_hashes(request.token_ids,
    hash_block_size, cache_salt=request.cache_salt)`` as BlockHash hex strings.
    Refusal: a bad token, salt or size raises the spec's ConfigError naming it.
    """
    prompt, outputs, salt = request.prompt_token_ids, request.output_token_ids, request.cache_salt
    key = (id(prompt), salt, hash_block_size)
    found = _chains.get(key)
    if found is None:
        base = _Chain(prompt, (), (), None).extended((), salt, hash_block_size)
        found = (base, base)
    base, latest = found
    if latest.outputs != outputs[: len(latest.outputs)]:
        latest = base  # another branch's outputs: go on from the prompt, not from them
    if latest.outputs != outputs:
        latest = latest.extended(outputs, salt, hash_block_size)
    _chains[key] = (base, latest)
    _chains.move_to_end(key)
    if len(_chains) > _MAX_CHAINS:
        _chains.popitem(last=False)
    return latest.hashes
