"""DK-*: invariants of the disk tier (issue 31), over the views of :mod:`spec.disk`.

Three subjects:

- ``"disk"`` reads the OWNER's snapshot (:meth:`spec.disk.tier.DiskTier.snapshot`): the byte
  limit (DK-2) and the pins (DK-3). The library exports the contract's part of the same dict
  (index, bytes, reserved, pins, counters); a test adds ``capacity`` and the ``sizes`` it
  stats.
- ``"disk_dir"`` reads ``{"disk": <snapshot or None while crashed>, "files": ..., "temps":
  ..., "restarted": bool, "peer_writes": (key_hex, ...)}``: the directory's listing
  (:meth:`spec.disk.directory.Directory.listing`), whether the last action was a restart, and
  the writes another engine has in flight (DK-4, DK-5).
- ``"disk_content"`` reads ``{"reads": ..., "truth": {key_hex: value_hex}, "damaged":
  int}``: the reads the last action resolved, each ``(key_hex, opened, returned, linked)``
  (``opened``: the verdict of the file the read opened, or ``"absent"``; ``returned``: the
  value's hex, ``"miss"`` or ``"fault"``; ``linked``: whether that inode is still under the
  key's name afterwards), the value each key was written with, and how much the ``damaged``
  counter grew in that action (DK-1, DK-6, DK-7).

Decisions where the contract leaves room:

- DK-3 "eviction never removes a pinned key" is checked as its consequence on the snapshot:
  a pinned key is indexed (an eviction that took one leaves its pin behind), and the pins
  recount the pinned reads in flight (``reads - reads_done``). The model pins only indexed
  keys (a pin keeps an index entry from eviction); the library pins every key it reads, so
  its snapshot is checked between calls, when no read is in flight.
- DK-4 "visible only after its rename, and whole" is checked on the directory (no final name
  holds a file a writer still fills) and on the index (no key both indexed and in flight).
- DK-5 adds what a live writer is owed: another engine's temp is never removed while its
  write is in flight (the rebuild removes the temps of dead writers only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spec.invariants._registry import invariant

__all__: list[str] = []

_SNAPSHOT = "disk"
_DIRECTORY = "disk_dir"
_CONTENT = "disk_content"
_DAMAGED = ("truncated", "foreign", "corrupt", "writing")


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@invariant(_DIRECTORY)
def dk4_visible_when_whole(obs: Mapping[str, Any]) -> list[str]:
    """DK-4: a key is visible only after its rename, and whole (no final file is being written)."""
    messages = [
        f"final file {key} is still being written"
        for key, _, verdict in obs["files"]
        if verdict == "writing"
    ]
    snap = obs["disk"]
    if snap is not None:
        flying = {key for key, _ in snap["writes"]}
        messages += [
            f"key {key} indexed while its write is in flight"
            for key in snap["index"]
            if key in flying
        ]
    return messages


@invariant(_SNAPSHOT)
def dk2_byte_limit(snap: Mapping[str, Any]) -> list[str]:
    """DK-2: bytes + reserved <= capacity at every moment; both recount the files and writes."""
    capacity = snap["capacity"]
    if not _int(capacity) or capacity < 1:
        return [f"capacity {capacity!r} is not an int >= 1"]
    messages = []
    recount = {
        "bytes": sum(size for _, size in snap["sizes"]),
        "reserved": sum(size for _, size in snap["writes"]),
    }
    for name, value in recount.items():
        if snap[name] != value:
            messages.append(f"{name} is {snap[name]}, the entries recount {value}")
    if any(size < 0 for _, size in (*snap["sizes"], *snap["writes"])):
        messages.append("a negative size")
    held = snap["bytes"] + snap["reserved"]
    if held > capacity:
        messages.append(f"bytes {snap['bytes']} + reserved {snap['reserved']} > {capacity}")
    return messages


@invariant(_SNAPSHOT)
def dk3_pins_indexed(snap: Mapping[str, Any]) -> list[str]:
    """DK-3: eviction never removes a pinned key: pinned keys are indexed; pins = reads open."""
    indexed = set(snap["index"])
    messages = []
    for key, count in snap["pins"]:
        if not _int(count) or count < 1:
            messages.append(f"key {key} has pin count {count!r}")
        if key not in indexed:
            messages.append(f"pinned key {key} is not indexed")
    c = snap["counters"]
    flying = c["reads"] - c["reads_done"]
    held = sum(count for _, count in snap["pins"])
    if held != flying:
        messages.append(f"keys hold {held} pins but {flying} reads are in flight")
    return messages


@invariant(_DIRECTORY)
def dk5_rebuild_exact(obs: Mapping[str, Any]) -> list[str]:
    """DK-5: after a restart the index is exactly the final files; dead writers' temps are gone."""
    live = {(key, "peer") for key, writer, alive in obs["temps"] if alive and writer == "peer"}
    messages = [
        f"another engine's temp of {key} was removed mid-write"
        for key in obs["peer_writes"]
        if (key, "peer") not in live
    ]
    snap = obs["disk"]
    if not obs["restarted"] or snap is None:
        return messages
    files = {key: size for key, size, _ in obs["files"]}
    sizes = dict(snap["sizes"])
    messages += [f"final file {key} not indexed" for key in sorted(set(files) - set(sizes))]
    messages += [f"indexed key {key} has no file" for key in sorted(set(sizes) - set(files))]
    messages += [
        f"key {key} indexed as {sizes[key]} bytes, its file has {files[key]}"
        for key in sorted(set(files) & set(sizes))
        if sizes[key] != files[key]
    ]
    messages += [
        f"torn temp of {key} ({writer}) left" for key, writer, alive in obs["temps"] if not alive
    ]
    return messages


@invariant(_CONTENT)
def dk1_reads_verify(obs: Mapping[str, Any]) -> list[str]:
    """DK-1: a get returns bytes only from a complete file whose key and digest verify."""
    messages = []
    for key, opened, returned, _ in obs["reads"]:
        if returned in ("miss", "fault"):
            continue
        if opened != "whole":
            messages.append(f"read of {key} returned bytes from a {opened} file")
        elif returned != obs["truth"].get(key):
            messages.append(f"read of {key} returned {returned}, not the value written")
    return messages


@invariant(_CONTENT)
def dk6_damage_is_a_miss(obs: Mapping[str, Any]) -> list[str]:
    """DK-6: a torn, corrupt or foreign file found by a read is a miss, counted, and removed."""
    messages = []
    found = 0
    for key, opened, returned, linked in obs["reads"]:
        if opened not in _DAMAGED:
            continue
        found += 1
        if returned != "miss":
            messages.append(f"read of a {opened} file {key} returned {returned}")
        if linked:
            messages.append(f"the {opened} file {key} a read found is still there")
    if obs["damaged"] != found:
        messages.append(f"damaged counted {obs['damaged']}, reads found {found}")
    return messages


@invariant(_CONTENT)
def dk7_removed_is_a_miss(obs: Mapping[str, Any]) -> list[str]:
    """DK-7: a get of a file another engine removed is a miss, never a fault or wrong bytes.

    Removed before the open, the read finds nothing: a miss. Removed after it, the inode the
    read holds still reads whole: its bytes.
    """
    messages = []
    for key, opened, returned, _ in obs["reads"]:
        if opened == "absent" and returned != "miss":
            messages.append(f"read of the removed file {key} returned {returned}")
        if opened == "whole" and returned in ("miss", "fault"):
            messages.append(f"read of the whole file {key} it opened returned {returned}")
    return messages
