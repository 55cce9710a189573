"""Built-in workloads of ``hybridkv simulate``, as traces (:mod:`hybridkv.testbed.trace`).

- ``multi-turn``: chat. Conversations share a few long system prompts (tenants); each turn
  appends a user message to the conversation so far, so a turn's prompt extends the previous
  turn's prompt AND its generated answer. A cache that keeps only prompt chunks, or drops the
  recurrent state at decode time, misses the answer every turn (field note #56972); hybridkv
  stores decode-phase chunks too, so those are continuation hits. Tenants use distinct
  ``cache_salt`` values when ``isolate_tenants`` is set.
- ``shared-prefix``: many independent requests behind one long shared prefix (a few-shot
  template or a RAG document), each with its own suffix.

Token ids are drawn from a seeded generator, so a workload is a pure function of its
arguments. Sizes are in tokens; the defaults make prompts several times the claim unit of the
default preset (832 tokens for Qwen3.5-27B on an H100-class GPU).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hybridkv.errors import HybridKVConfigError
from hybridkv.testbed.trace import TraceRequest

__all__ = ["WORKLOADS", "MultiTurn", "SharedPrefix", "builtin_workload"]

_VOCAB = 100_000


def _positive(field: str, value: object, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise HybridKVConfigError(
            field, value, f"must be an int >= {low}", f"pass {field} >= {low}"
        )


@dataclass(frozen=True, slots=True)
class MultiTurn:
    """Multi-turn chat (module docstring).

    Attributes:
        num_requests: turns in total (>= 1), spread over conversations of ``turns`` turns.
        turns: turns per conversation.
        system_prompts: distinct system prompts (tenants); conversations take them in turn.
        system_tokens: tokens of each system prompt.
        message_tokens: (low, high) tokens of a user message, drawn uniformly.
        max_tokens: output tokens per turn.
        stagger_steps: steps between the first turns of consecutive conversations.
        think_steps: steps between consecutive turns of one conversation (the user reading
            and typing); other conversations run meanwhile and push its KV out of the GPU.
        isolate_tenants: give each tenant its own ``cache_salt``.
        seed: the generator's seed.
    """

    num_requests: int = 32
    turns: int = 4
    system_prompts: int = 2
    system_tokens: int = 2048
    message_tokens: tuple[int, int] = (256, 768)
    max_tokens: int = 128
    stagger_steps: int = 3
    think_steps: int = 50
    isolate_tenants: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "turns", "system_prompts", "system_tokens", "max_tokens"):
            _positive(name, getattr(self, name))
        _positive("stagger_steps", self.stagger_steps, 0)
        _positive("think_steps", self.think_steps, 0)
        low, high = self.message_tokens
        _positive("message_tokens", low)
        if high < low:
            raise HybridKVConfigError(
                "message_tokens", self.message_tokens, "high < low", "pass (low, high)"
            )

    def requests(self) -> tuple[TraceRequest, ...]:
        """The trace: conversation by conversation, turn by turn."""
        rng = random.Random(self.seed)
        systems = [_tokens(rng, self.system_tokens) for _ in range(self.system_prompts)]
        out: list[TraceRequest] = []
        conversation = 0
        while len(out) < self.num_requests:
            tenant = conversation % self.system_prompts
            salt = f"tenant-{tenant}" if self.isolate_tenants else None
            name = f"c{conversation}"
            for turn in range(self.turns):
                if len(out) == self.num_requests:
                    break
                message = _tokens(rng, rng.randint(*self.message_tokens))
                prompt = systems[tenant] + message if turn == 0 else message
                step = conversation * self.stagger_steps + turn * self.think_steps
                out.append(TraceRequest(step, prompt, self.max_tokens, salt, name))
            conversation += 1
        return tuple(out)


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Independent requests behind one shared prefix (module docstring).

    Attributes:
        num_requests: requests (>= 1).
        prefix_tokens: tokens of the shared prefix.
        suffix_tokens: (low, high) tokens of each request's own suffix.
        max_tokens: output tokens per request.
        arrival_every: steps between arrivals.
        seed: the generator's seed.
    """

    num_requests: int = 32
    prefix_tokens: int = 4096
    suffix_tokens: tuple[int, int] = (64, 512)
    max_tokens: int = 16
    arrival_every: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "prefix_tokens", "max_tokens"):
            _positive(name, getattr(self, name))
        _positive("arrival_every", self.arrival_every, 0)
        low, high = self.suffix_tokens
        _positive("suffix_tokens", low)
        if high < low:
            raise HybridKVConfigError(
                "suffix_tokens", self.suffix_tokens, "high < low", "pass (low, high)"
            )

    def requests(self) -> tuple[TraceRequest, ...]:
        """The trace, in arrival order."""
        rng = random.Random(self.seed)
        prefix = _tokens(rng, self.prefix_tokens)
        return tuple(
            TraceRequest(
                i * self.arrival_every,
                prefix + _tokens(rng, rng.randint(*self.suffix_tokens)),
                self.max_tokens,
            )
            for i in range(self.num_requests)
        )


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(_VOCAB) for _ in range(n))


WORKLOADS = ("multi-turn", "shared-prefix")
"""The names ``--trace`` accepts besides a file."""


def builtin_workload(name: str, num_requests: int) -> tuple[TraceRequest, ...]:
    """The built-in workload ``name`` with ``num_requests`` requests.

    Refusal: an unknown name raises :class:`HybridKVConfigError` (field ``--trace``).
    """
    _positive("--requests", num_requests)
    if name == "multi-turn":
        return MultiTurn(num_requests=num_requests).requests()
    if name == "shared-prefix":
        return SharedPrefix(num_requests=num_requests).requests()
    raise HybridKVConfigError(
        "--trace", name, "is neither a built-in workload nor a .jsonl file", _FIX_TRACE
    )


_FIX_TRACE = f"pass one of {', '.join(WORKLOADS)} or a path ending in .jsonl"
