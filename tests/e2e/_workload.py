"""Multi-turn chats over shared system prompts, as token ids, run turn by turn.

Every chat starts with one of a few system prompts (shared by several chats, so their prefix
is the same KV), then alternates a user message and the model's own greedy answer. Turn ``t``
of a chat sends the whole history so far plus a new user message, so each turn's prompt
extends the previous turn's prompt and answer: a prefix the GPU cache has often dropped by
then (the tests give vLLM a small block pool), which the host tier can serve back.

The answers feed the next turn's prompt, so a run with the connector reproduces the
baseline's prompts only while its answers equal the baseline's; a wrong load shows up in the
answer it corrupts and in every later turn of that chat.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Generate = Callable[[list[list[int]]], list[list[int]]]
"""One batch of prompts (token ids) in, one greedy answer (token ids) per prompt out."""

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
    """Every request of a run, in order (turn-major), with the answer it got."""

    prompts: tuple[tuple[int, ...], ...]
    answers: tuple[tuple[int, ...], ...]

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
    answers: list[tuple[int, ...]] = []
    for turn in range(shape.turns):
        batch = []
        for chat, history in enumerate(histories):
            history.extend(users[chat][turn])
            batch.append(list(history))
        replies = generate(batch)
        _check_replies(batch, replies, shape.answer_tokens)
        for history, prompt, reply in zip(histories, batch, replies, strict=True):
            history.extend(reply)
            prompts.append(tuple(prompt))
            answers.append(tuple(reply))
    return Transcript(tuple(prompts), tuple(answers))


def _check_replies(batch: Sequence[list[int]], replies: Sequence[list[int]], tokens: int) -> None:
    """Every prompt got an answer of exactly ``tokens`` tokens (EOS is ignored by the runs)."""
    if len(replies) != len(batch):
        raise AssertionError(f"{len(batch)} prompts got {len(replies)} answers")
    short = [i for i, reply in enumerate(replies) if len(reply) != tokens]
    if short:
        raise AssertionError(f"answers {short} are not {tokens} tokens long")
