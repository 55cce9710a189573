"""Multi-turn chats over shared system prompts, as token ids, run turn by turn.

Every chat starts with one of a few system prompts (shared by several chats, so their prefix
is the same KV), then alternates a user message and the model's own greedy answer. Turn ``t``
of a chat sends the whole history so far plus a new user message, so each turn's prompt
extends the previous turn's prompt and answer: a prefix the GPU cache has often dropped by
then (the tests give vLLM a small block pool), which the host tier can serve back.

The baseline run feeds its own answers into the next turn's prompt (:func:`run_chats`). The
runs compared with it answer the baseline's prompts instead (:func:`replay`): every request of
such a run has the baseline's prompt, so each answer is judged on its own, and one divergence
in bfloat16 (a near-tie vLLM's own prefix caching can flip, ``_drift``) does not change the
prompts of the later turns. Each answer comes with the chosen token's logprob at every position.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple


class Reply(NamedTuple):
    """One greedy answer: its token ids, and the logprob of each (the chosen token's)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]


Generate = Callable[[list[list[int]]], list[Reply]]
"""One batch of prompts (token ids) in, one greedy answer per prompt out."""

FIRST_WORD = 2  # token ids 0 and 1 are the tokenizer's unknown and end words


@dataclass(frozen=True, slots=True)
class Workload:
    """The chats' shape: how many, how long, how many turns."""

    chats: int = 12
    systems: int = 3
    turns: int = 3
    system_tokens: int = 256
    user_tokens: int = 32
    answer_tokens: int = 8
    vocab: int = 512
    seed: int = 0

    @property
    def requests(self) -> int:
        return self.chats * self.turns

    def longest_prompt(self) -> int:
        """Tokens of the last turn's prompt: what max_model_len must hold."""
        return (
            self.system_tokens
            + self.turns * self.user_tokens
            + (self.turns - 1) * self.answer_tokens
        )


@dataclass(frozen=True, slots=True)
class Transcript:
    """Every request of a run, in order (turn-major), with the answer it got and the chosen
    tokens' logprobs."""

    prompts: tuple[tuple[int, ...], ...]
    answers: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]

    def differing(self, other: Transcript) -> list[int]:
        """Indices of the requests whose answers differ from ``other``'s."""
        return [
            i for i, (a, b) in enumerate(zip(self.answers, other.answers, strict=True)) if a != b
        ]


def _words(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_WORD, vocab) for _ in range(n)]


def run_chats(shape: Workload, generate: Generate) -> Transcript:
    """All turns of all chats: one ``generate`` batch per turn, each answer kept verbatim."""
    rng = random.Random(shape.seed)
    systems = [_words(rng, shape.system_tokens, shape.vocab) for _ in range(shape.systems)]
    users = [
        [_words(rng, shape.user_tokens, shape.vocab) for _ in range(shape.turns)]
        for _ in range(shape.chats)
    ]
    histories = [list(systems[c % shape.systems]) for c in range(shape.chats)]
    prompts: list[tuple[int, ...]] = []
    replies: list[Reply] = []
    for turn in range(shape.turns):
        batch = []
        for chat, history in enumerate(histories):
            history.extend(users[chat][turn])
            batch.append(list(history))
        answered = _checked(batch, generate(batch), shape.answer_tokens)
        for history, prompt, reply in zip(histories, batch, answered, strict=True):
            history.extend(reply.tokens)
            prompts.append(tuple(prompt))
        replies.extend(answered)
    return _transcript(prompts, replies)


def replay(shape: Workload, base: Transcript, generate: Generate) -> Transcript:
    """The baseline's prompts again, one ``generate`` batch per turn as :func:`run_chats` sent
    them: each answer of this run answers exactly the prompt the baseline's answered."""
    prompts = [list(p) for p in base.prompts]
    replies: list[Reply] = []
    for turn in range(shape.turns):
        batch = prompts[turn * shape.chats : (turn + 1) * shape.chats]
        replies.extend(_checked(batch, generate(batch), shape.answer_tokens))
    return _transcript(base.prompts, replies)


def _transcript(prompts: Sequence[Sequence[int]], replies: Sequence[Reply]) -> Transcript:
    return Transcript(
        tuple(tuple(p) for p in prompts),
        tuple(r.tokens for r in replies),
        tuple(r.logprobs for r in replies),
    )


def _checked(batch: Sequence[list[int]], replies: Sequence[Reply], tokens: int) -> list[Reply]:
    """The replies, once every prompt got an answer of exactly ``tokens`` tokens, each with a
    logprob per token (EOS is ignored by the runs)."""
    if len(replies) != len(batch):
        raise AssertionError(f"{len(batch)} prompts got {len(replies)} answers")
    short = [i for i, r in enumerate(replies) if len(r.tokens) != tokens]
    if short:
        raise AssertionError(f"answers {short} are not {tokens} tokens long")
    unscored = [i for i, r in enumerate(replies) if len(r.logprobs) != tokens]
    if unscored:
        raise AssertionError(f"answers {unscored} lack a logprob per token")
    return list(replies)
