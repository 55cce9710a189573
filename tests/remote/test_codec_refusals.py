"""Every refusal of hybridkv.remote.codec, whole: field, value, problem and fix, and the
decoder's verdict at each boundary of a value's length.

A refusal is what a user reads when a connector author passes the wrong keys: these tests pin
the words as well as the field, so a message that loses its value or its fix fails here.
They were written for the mutants mutmut left alive in ``tools/mutants.py``'s run over the
module (docs/explanation/mutations.md, "Whole modules under mutmut").
"""

from __future__ import annotations

import struct

import pytest

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote import MAGIC, Corruption, chunk_key, decode_chunk, encode_chunk

MEMBERS = (b"k-attn-0", b"k-mamba-1")


def _refusal(call: object, *args: object) -> HybridKVConfigError:
    with pytest.raises(HybridKVConfigError) as caught:
        call(*args)  # type: ignore[operator]
    return caught.value


_NO_MEMBER = ("a chunk has >= 1 member", "pass keys")
_NOT_BYTES = ("must be non-empty bytes", "pass bytes")
_REPEATED = ("repeats a key", "pass each key once")


@pytest.mark.parametrize("call", [chunk_key, lambda ns, m: encode_chunk(m, [b""] * 2)])
@pytest.mark.parametrize(
    ("members", "value", "words", "message"),
    [
        ([], [], _NO_MEMBER, "members=[]: a chunk has >= 1 member; pass keys"),
        (b"ab", b"ab", _NO_MEMBER, "members=b'ab': a chunk has >= 1 member; pass keys"),
        ({b"a"}, {b"a"}, _NO_MEMBER, "members={b'a'}: a chunk has >= 1 member; pass keys"),
        ([b"a", ""], "", _NOT_BYTES, "members='': must be non-empty bytes; pass bytes"),
        ([b"a", b""], b"", _NOT_BYTES, "members=b'': must be non-empty bytes; pass bytes"),
        (
            [b"a", b"a"],
            [b"a", b"a"],
            _REPEATED,
            "members=[b'a', b'a']: repeats a key; pass each key once",
        ),
    ],
)
def test_bad_members_are_refused_with_value_problem_and_fix(
    call: object, members: object, value: object, words: tuple[str, str], message: str
) -> None:
    refused = _refusal(call, b"ns", members)
    assert (refused.field, refused.value) == ("members", value)
    assert (refused.problem, refused.fix) == words
    assert str(refused) == message


def test_a_namespace_that_is_not_bytes_is_refused_whole() -> None:
    refused = _refusal(chunk_key, "ns", MEMBERS)
    assert (refused.field, refused.value, refused.problem, refused.fix) == (
        "namespace",
        "ns",
        "must be bytes",
        "encode it",
    )
    assert str(refused) == "namespace='ns': must be bytes; encode it"


def test_a_payload_count_unlike_the_members_is_refused_whole() -> None:
    refused = _refusal(encode_chunk, MEMBERS, [b"x"])
    assert (refused.field, refused.value, refused.problem, refused.fix) == (
        "payloads",
        1,
        "must be one per member (2)",
        "pass each",
    )
    assert str(refused) == "payloads=1: must be one per member (2); pass each"


def test_a_value_exactly_one_header_long_is_judged_on_its_magic_first() -> None:
    # 10 bytes: the header and nothing after it. Its magic is read before its length is
    # judged, so a foreign value of exactly that size is MAGIC (not TRUNCATED), and one of ours
    # with the right magic is TRUNCATED at its first member key.
    head = struct.pack(">4sHI", b"XXXX", 2, len(MEMBERS))
    assert decode_chunk(head, MEMBERS).corruption is Corruption.MAGIC
    ours = struct.pack(">4sHI", MAGIC, 2, len(MEMBERS))
    assert decode_chunk(ours, MEMBERS).corruption is Corruption.TRUNCATED
    assert decode_chunk(ours[:-1], MEMBERS).corruption is Corruption.TRUNCATED
