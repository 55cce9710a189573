"""The workload trace: one request per line of JSON, validated with line-numbered errors.

A trace is what ``hybridkv simulate --trace FILE.jsonl`` replays. Each line is a JSON object:

- ``arrival_step`` (int >= 0, required): the earliest scheduler step at which it arrives;
- ``prompt`` (non-empty list of ints >= 0, required): the prompt's token ids, or, for a turn of
  a conversation after its first, the new message appended to the conversation so far;
- ``max_tokens`` (int >= 1, required): output tokens to generate;
- ``cache_salt`` (string, optional): the isolation domain (requests with different salts
  never share KV, vLLM's ``cache_salt``);
- ``conversation`` (string, optional): the conversation the request is a turn of. A turn
  arrives no earlier than ``arrival_step`` and no earlier than the end of the conversation's
  previous turn; its full prompt is the previous turn's prompt, that turn's generated tokens,
  then its own ``prompt``, as a chat server builds the next turn. All turns of a conversation
  share one ``cache_salt``.

Blank lines and lines starting with ``#`` are skipped. Any other deviation (bad JSON, a missing
or unknown key, a wrong type, a salt that changes within a conversation) is refused with a
:class:`~hybridkv.errors.HybridKVConfigError` whose field names the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.errors import HybridKVConfigError
from hybridkv.json_input import decode_utf8, parse_json

__all__ = ["TraceRequest", "dump_trace", "load_trace", "parse_trace", "validate_trace"]

_REQUIRED = ("arrival_step", "prompt", "max_tokens")
_OPTIONAL = ("cache_salt", "conversation")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a workload (module docstring for each field's meaning)."""

    arrival_step: int
    prompt: tuple[int, ...]
    max_tokens: int
    cache_salt: str | None = None
    conversation: str | None = None

    def __post_init__(self) -> None:
        _check_int("arrival_step", self.arrival_step, 0)
        _check_int("max_tokens", self.max_tokens, 1)
        if not isinstance(self.prompt, tuple) or not self.prompt:
            raise HybridKVConfigError(
                "prompt", self.prompt, "must be a non-empty tuple of token ids", _FIX_PROMPT
            )
        for token in self.prompt:
            _check_int("prompt", token, 0)
        for name in _OPTIONAL:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise HybridKVConfigError(name, value, "must be a string", f"quote the {name}")

    def to_json(self) -> dict[str, Any]:
        """The line's object (optional keys only when set)."""
        obj: dict[str, Any] = {
            "arrival_step": self.arrival_step,
            "prompt": list(self.prompt),
            "max_tokens": self.max_tokens,
        }
        for name in _OPTIONAL:
            if getattr(self, name) is not None:
                obj[name] = getattr(self, name)
        return obj


_FIX_PROMPT = "give the prompt as a non-empty list of token ids"


def _check_int(field: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise HybridKVConfigError(
            field, value, f"must be an int >= {low}", f"write {field} as a JSON integer >= {low}"
        )


def parse_trace(lines: Iterable[str], source: str = "<trace>") -> tuple[TraceRequest, ...]:
    """Parse JSON lines into requests.

    Pre: none. Post: the requests in line order, each validated, and the conversation rule of
    the module docstring checked across lines. Refusal: the first bad line raises
    :class:`HybridKVConfigError` with field ``"<source>:<line>"`` (and the key) and nothing
    is returned.
    """
    requests: list[TraceRequest] = []
    salts: dict[str, tuple[str | None, int]] = {}
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{source}:{number}"
        request = _parse_line(text, where)
        if request.conversation is not None:
            salt, first = salts.setdefault(request.conversation, (request.cache_salt, number))
            if salt != request.cache_salt:
                raise HybridKVConfigError(
                    f"{where}: cache_salt",
                    request.cache_salt,
                    f"conversation {request.conversation!r} used salt {salt!r} on line {first}",
                    "give every turn of a conversation the same cache_salt",
                )
        requests.append(request)
    if not requests:
        raise HybridKVConfigError(source, "", "holds no request", "write one JSON object a line")
    return tuple(requests)


def _parse_line(text: str, where: str) -> TraceRequest:
    obj = parse_json(text, where, text[:60], _FIX_LINE)
    if not isinstance(obj, Mapping):
        raise HybridKVConfigError(where, text[:60], "is not a JSON object", _FIX_LINE)
    for key in obj:
        if key not in _REQUIRED and key not in _OPTIONAL:
            raise HybridKVConfigError(
                f"{where}: {key}",
                obj[key],
                "is not a trace key",
                f"use only {', '.join(_REQUIRED + _OPTIONAL)}",
            )
    for key in _REQUIRED:
        if key not in obj:
            raise HybridKVConfigError(f"{where}: {key}", None, "is missing", f"add {key!r}")
    prompt = obj["prompt"]
    if not isinstance(prompt, list):
        raise HybridKVConfigError(f"{where}: prompt", prompt, "is not a list", _FIX_PROMPT)
    try:
        return TraceRequest(
            obj["arrival_step"],
            tuple(prompt),
            obj["max_tokens"],
            obj.get("cache_salt"),
            obj.get("conversation"),
        )
    except HybridKVConfigError as exc:
        raise HybridKVConfigError(
            f"{where}: {exc.field}", exc.value, exc.problem, exc.fix
        ) from None


_FIX_LINE = (
    'write one JSON object per line, e.g. {"arrival_step": 0, "prompt": [1, 2], "max_tokens": 4}'
)


def load_trace(path: str | Path) -> tuple[TraceRequest, ...]:
    """Read and parse a JSONL trace file (:func:`parse_trace`).

    Refusal: a missing or unreadable file, or bytes that are not UTF-8, raise
    :class:`HybridKVConfigError` (field ``--trace``).
    """
    file = Path(path)
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise HybridKVConfigError(
            "--trace", str(path), f"cannot be read ({exc.strerror})", "pass a JSONL trace file"
        ) from None
    text = decode_utf8(data, "--trace", str(path), "save the trace as UTF-8 JSON lines")
    # Lines end at "\n" only: str.splitlines would also cut at characters JSON strings may
    # hold raw (U+2028, form feed...), splitting one request in two.
    return parse_trace(text.split("\n"), str(path))


def dump_trace(requests: Sequence[TraceRequest]) -> str:
    """The JSONL text of ``requests`` (round-trips through :func:`parse_trace`)."""
    return "".join(json.dumps(r.to_json(), separators=(",", ":")) + "\n" for r in requests)


def validate_trace(requests: Sequence[TraceRequest]) -> tuple[TraceRequest, ...]:
    """Check an in-memory trace as :func:`parse_trace` checks a file. Pre: TraceRequests."""
    return parse_trace(dump_trace(requests).splitlines(), "<trace>")
