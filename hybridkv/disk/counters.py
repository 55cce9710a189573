"""The disk client's counters: :data:`DISK_COUNTER_NAMES`, every key of the ``counters`` of
:meth:`~hybridkv.disk.client.DiskClient.snapshot`, each present from the start:

- lookups: ``exists_calls``, ``exists_keys`` (keys asked), ``exists_found``, ``exists_faults``;
- reads: ``gets``, ``hits``, ``misses`` (no file), ``vanished`` (an indexed file found gone by a
  read, an eviction or a rescan), ``damaged`` (a file that failed verification) and one
  ``damaged_<why>`` per :class:`~hybridkv.disk.fileformat.Damage`, ``removed_damaged``,
  ``get_faults``, ``bytes_read`` (file bytes read by hits and misses alike);
- writes: ``sets``, ``written``, ``bytes_written`` (file bytes), ``set_present`` (indexed:
  not written), ``set_adopted`` (complete on disk, written by another engine: indexed, not
  written), ``set_pending`` (the same key's write in flight), ``set_no_space`` (pins and
  writes in flight hold too much), ``set_too_large`` (larger than the capacity),
  ``set_faults`` (an I/O error), ``set_enospc`` (of which ENOSPC), ``set_refused_reader``,
  ``capacity_lowered`` (ENOSPC lowered the limit: the client's module docstring);
- eviction: ``evictions``, ``evicted_bytes``;
- start-up and rescans: ``rebuild_files``, ``rebuild_bytes``, ``rebuild_torn`` (temporary files
  removed), ``rebuild_truncated`` (removed), ``rebuild_over_capacity`` (oldest files removed to
  fit), ``rebuild_us`` (the rebuild's wall time, microseconds: a measurement, not a count),
  ``rescans`` (whole passes), ``adopted``, ``adopt_refused`` (no room), ``temps_removed``
  (torn, by a rescan), ``rescan_truncated`` (truncated files a rescan removed),
  ``rescan_faults`` (a subdirectory a rescan could not list: tried again next pass);
- ``direct_fallbacks`` (1 once O_DIRECT was refused and AUTO fell back), ``closed_calls``
  (calls after ``close``, each a FAULT).
"""

from __future__ import annotations

from hybridkv.disk.fileformat import Damage

__all__ = ["DISK_COUNTER_NAMES"]

DISK_COUNTER_NAMES: tuple[str, ...] = (
    "exists_calls",
    "exists_keys",
    "exists_found",
    "exists_faults",
    "gets",
    "hits",
    "misses",
    "vanished",
    "damaged",
    *(f"damaged_{damage.value}" for damage in Damage),
    "removed_damaged",
    "get_faults",
    "bytes_read",
    "sets",
    "written",
    "bytes_written",
    "set_present",
    "set_adopted",
    "set_pending",
    "set_no_space",
    "set_too_large",
    "set_faults",
    "set_enospc",
    "set_refused_reader",
    "capacity_lowered",
    "evictions",
    "evicted_bytes",
    "rebuild_files",
    "rebuild_bytes",
    "rebuild_torn",
    "rebuild_truncated",
    "rebuild_over_capacity",
    "rebuild_us",
    "rescans",
    "adopted",
    "adopt_refused",
    "temps_removed",
    "rescan_truncated",
    "rescan_faults",
    "direct_fallbacks",
    "closed_calls",
)
"""The snapshot's ``counters`` keys (module docstring)."""
