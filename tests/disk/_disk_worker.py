"""A process of the disk fault tests, run as ``python _disk_worker.py MODE JSON``.

Modes (each prints one JSON line of what it observed on stdout, where it ends by itself):

- ``writer``: an OWNER that writes chunks ``0, 1, 2, ...`` for ever (printing ``started`` once
  its index is built); the test kills it with SIGKILL mid-write.
- ``owner``: an OWNER sharing its directory with another process for ``seconds``: writes its
  share of the keys, reads every key of both shares, verifies each read against the value the
  key stands for, and reports hits, misses, wrong reads and its counters.
- ``diskfull``: mounts a tmpfs of ``fs_bytes`` on ``directory`` (the caller runs it in a new
  mount namespace, so the mount ends with the process), writes ``chunks`` chunks through an
  OWNER whose capacity is larger than the filesystem, then reads every one back.

Values are a function of their key (:func:`value_of`), as content addressing makes them, so
any process can tell a right read from a wrong one.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hybridkv.disk import DiskClient, DiskConfig, FsyncPolicy
from hybridkv.remote import ClientFault


def key_of(i: int) -> bytes:
    """Chunk key ``i`` (32 bytes, as the tier's SHA-256 chunk keys)."""
    return hashlib.sha256(b"chunk %d" % i).digest()


def value_of(key: bytes, size: int) -> bytes:
    """The one value ``key`` stands for, ``size`` bytes."""
    return hashlib.shake_256(key).digest(size)


def _writer(args: dict[str, Any]) -> None:
    config = DiskConfig(
        args["directory"],
        args["capacity"],
        fsync=FsyncPolicy(args["fsync"]),
        rescan_s=0,
        threads=args.get("threads", 2),
    )
    client = DiskClient(config)
    print("started", flush=True)
    i = args.get("first", 0)
    while True:
        key = key_of(i)
        client.set(key, value_of(key, args["size"]), 0)
        i += 1


def _owner(args: dict[str, Any]) -> None:
    config = DiskConfig(args["directory"], args["capacity"], rescan_s=args["rescan_s"])
    client = DiskClient(config)
    mine, theirs, size = args["mine"], args["theirs"], args["size"]
    seen = {"hits": 0, "misses": 0, "wrong": 0, "faults": 0, "other_hits": 0, "errors": 0}
    deadline = time.monotonic() + args["seconds"]
    rounds = 0
    while time.monotonic() < deadline:
        for i in mine:
            key = key_of(i)
            if client.set(key, value_of(key, size), 0) is not None:
                seen["faults"] += 1
        for i in mine + theirs:
            key = key_of(i)
            try:
                got = client.get(key)
            except Exception:  # counted: the contract says none ever escapes
                seen["errors"] += 1
                continue
            if isinstance(got, ClientFault):
                seen["faults"] += 1
            elif got is None:
                seen["misses"] += 1
            elif got != value_of(key, size):
                seen["wrong"] += 1
            else:
                seen["hits"] += 1
                seen["other_hits"] += i in theirs and i not in mine
        rounds += 1
    client.check()
    snap = client.snapshot()
    client.close()
    print(json.dumps({"seen": seen, "rounds": rounds, "snapshot": snap}), flush=True)


def _diskfull(args: dict[str, Any]) -> None:
    directory = Path(args["directory"])
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={args['fs_bytes']}", "tmpfs", str(directory)],
        check=True,
    )
    client = DiskClient(DiskConfig(directory, args["capacity"], rescan_s=0))
    size, written, refused = args["size"], [], []
    for i in range(args["chunks"]):
        key = key_of(i)
        (written if client.set(key, value_of(key, size), 0) is None else refused).append(i)
    reads = [client.get(key_of(i)) for i in range(args["chunks"])]
    wrong = sum(got not in (None, value_of(key_of(i), size)) for i, got in enumerate(reads))
    hits = [i for i, got in enumerate(reads) if got == value_of(key_of(i), size)]
    found = client.exists([key_of(i) for i in range(args["chunks"])])
    temps = [p.name for p in directory.rglob(".*.tmp.*")]
    client.check()
    snap = client.snapshot()
    statvfs = os.statvfs(directory)
    client.close()
    print(
        json.dumps(
            {
                "written": written,
                "refused": refused,
                "wrong": wrong,
                "hits": hits,
                "found": list(found) if isinstance(found, tuple) else str(found),
                "temps": temps,
                "fs_bytes": statvfs.f_blocks * statvfs.f_frsize,
                "snapshot": snap,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    mode, raw = sys.argv[1], json.loads(sys.argv[2])
    {"writer": _writer, "owner": _owner, "diskfull": _diskfull}[mode](raw)
