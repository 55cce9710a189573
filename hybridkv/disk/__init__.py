"""The disk tier (issue 31): content-addressed chunks as files in a directory, under the host
tier. The remote tier's machinery (:class:`hybridkv.remote.RemoteTier`: write-behind, lookups,
verified fetches, breaker) drives it through :class:`DiskClient`, a
:class:`~hybridkv.remote.client.ChunkClient` on a directory. One idea per module:
:mod:`.config` (settings, fsync and O_DIRECT policies, roles), :mod:`.fileformat` (a file's
header, digest and padding), :mod:`.names` (file and temporary names, when a temporary file is
torn), :mod:`.io` (aligned buffers, O_DIRECT with a buffered fallback, segments on the I/O
pool), :mod:`.index` (bytes, reservations, pins; the LRU/ARC policy orders), :mod:`.scan` (one
pass over the directory: rebuild and rescans), :mod:`.rebuild` (an OWNER's start: the directory,
the O_DIRECT probe, the index rebuilt), :mod:`.counters` (what the snapshot counts) and
:mod:`.client`.

Invariants (named; the spec and the docs cite them):

- DK-1: a ``get`` returns bytes only from a complete file whose key and digest verify.
- DK-2: bytes of complete files + reservations of writes in flight <= capacity, at every moment.
- DK-3: eviction never removes a pinned key.
- DK-4: a key is visible to ``exists``/``get`` only after its rename, and whole.
- DK-5: after a restart the index is exactly the complete files in the directory, torn
  temporary files of dead writers removed.
- DK-6: a torn, corrupt or foreign file found by a read is a miss, counted, and removed.
- DK-7: a file removed by another engine makes our ``get`` a miss, never an exception or wrong
  bytes.
"""

from __future__ import annotations

from hybridkv.disk.client import DiskClient
from hybridkv.disk.config import POLICIES, DirectIO, DiskConfig, DiskRole, FsyncPolicy
from hybridkv.disk.counters import DISK_COUNTER_NAMES
from hybridkv.disk.fileformat import ALIGN, Damage, padded_size
from hybridkv.disk.index import DiskIndexError

__all__ = [
    "ALIGN",
    "DISK_COUNTER_NAMES",
    "POLICIES",
    "Damage",
    "DirectIO",
    "DiskClient",
    "DiskConfig",
    "DiskIndexError",
    "DiskRole",
    "FsyncPolicy",
    "padded_size",
]
