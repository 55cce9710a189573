"""Reading a user's JSON (a config.json, a trace line) so that any bytes end in one clear error.

``json.loads`` and ``bytes.decode`` fail in several ways besides a syntax error: bytes that are
not UTF-8 (``UnicodeDecodeError``), nesting deeper than the parser's recursion
(``RecursionError``) and integers longer than Python converts (``ValueError``). Each becomes a
:class:`~hybridkv.errors.HybridKVConfigError` naming where the input came from and its fix.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from hybridkv.errors import HybridKVConfigError

__all__ = ["decode_utf8", "parse_json"]


def decode_utf8(data: bytes, field: str, value: object, fix: str) -> str:
    """``data`` as text.

    Refusal: bytes that are not UTF-8 raise naming ``field`` and ``value`` (what the user gave,
    e.g. the path), the line, the byte offset and the bytes there.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        bad = data[err.start : err.start + 4]
        raise HybridKVConfigError(
            field,
            value,
            f"is not UTF-8 text (line {line}, byte {err.start}: {err.reason} {bad!r})",
            fix,
        ) from None


def parse_json(text: str, field: str, value: object, fix: str) -> Any:
    """The JSON value of ``text``.

    Refusal: text that is not JSON Python can hold raises naming ``field``, ``value`` and why.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        problem = f"is not JSON ({err.msg} at line {err.lineno}, column {err.colno})"
    except RecursionError:
        problem = "nests arrays or objects deeper than a JSON reader can follow"
    except ValueError:  # an integer longer than Python converts from text
        limit = sys.get_int_max_str_digits()
        problem = f"holds an integer of more than {limit} digits"
    raise HybridKVConfigError(field, value, problem, fix)
