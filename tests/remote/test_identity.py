"""The scoped namespace (issue 17, :mod:`hybridkv.remote.identity`): equal identities and
versions give equal bytes, any field or version that differs gives another namespace (so other
chunk keys for the same members), and bad values are refused naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote import ModelIdentity, chunk_key, scoped_namespace

BASE = ModelIdentity("Qwen/Qwen3.5-4B", "", "torch.bfloat16/auto", "hash=16;full:16", 1, 0)
MEMBERS = (b"k1", b"k2")
OTHERS = {
    "model": "Qwen/Qwen3.5-9B",
    "revision": "refs/pr/1",
    "dtype": "torch.float16/auto",
    "layout": "hash=16;full:32",
    "tp_size": 2,
    "config": "0" * 64,
}


def test_equal_identities_and_versions_give_equal_namespaces() -> None:
    twin = ModelIdentity(*dataclasses.astuple(BASE))
    assert scoped_namespace(b"prod", BASE, 3) == scoped_namespace(b"prod", twin, 3)
    assert scoped_namespace(b"prod", BASE, 0).startswith(b"prod/")


@pytest.mark.parametrize("field", sorted(OTHERS))
def test_any_field_changes_the_chunk_key(field: str) -> None:
    other = dataclasses.replace(BASE, **{field: OTHERS[field]})
    ours = chunk_key(scoped_namespace(b"prod", BASE, 0), MEMBERS)
    assert chunk_key(scoped_namespace(b"prod", other, 0), MEMBERS) != ours


def test_the_rank_and_the_weights_version_change_the_chunk_key() -> None:
    two = dataclasses.replace(BASE, tp_size=2)
    keys = {
        scoped_namespace(b"prod", two, 0),
        scoped_namespace(b"prod", dataclasses.replace(two, tp_rank=1), 0),
        scoped_namespace(b"prod", two, 1),
        scoped_namespace(b"dev", two, 0),
    }
    assert len(keys) == 4


def test_an_engines_epoch_gives_it_a_namespace_of_its_own() -> None:
    """After a reset each engine writes under its own epoch: equal versions of two engines
    never share (one may have slept, the other trained), and no epoch is the shared one."""
    shared = scoped_namespace(b"prod", BASE, 1)
    mine = scoped_namespace(b"prod", BASE, 1, b"a" * 16)
    theirs = scoped_namespace(b"prod", BASE, 1, b"b" * 16)
    assert len({shared, mine, theirs}) == 3
    assert scoped_namespace(b"prod", BASE, 1, b"a" * 16) == mine
    assert scoped_namespace(b"prod", BASE, 0, b"") == scoped_namespace(b"prod", BASE, 0)


def test_fields_are_length_prefixed_so_they_cannot_run_together() -> None:
    a = dataclasses.replace(BASE, model="ab", revision="c")
    b = dataclasses.replace(BASE, model="a", revision="bc")
    assert scoped_namespace(b"n", a, 0) != scoped_namespace(b"n", b, 0)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: dataclasses.replace(BASE, tp_size=0), "tp_size"),
        (lambda: dataclasses.replace(BASE, tp_rank=1), "tp_rank"),
        (lambda: dataclasses.replace(BASE, model=None), "model"),
        (lambda: scoped_namespace("prod", BASE, 0), "namespace"),  # type: ignore[arg-type]
        (lambda: scoped_namespace(b"prod", BASE, -1), "weights_version"),
        (lambda: scoped_namespace(b"prod", BASE, 1, "e"), "epoch"),  # type: ignore[arg-type]
        (lambda: dataclasses.replace(BASE, config=None), "config"),
    ],
)
def test_bad_values_are_refused_naming_the_field(make: object, field: str) -> None:
    with pytest.raises(HybridKVConfigError, match=field):
        make()  # type: ignore[operator]
