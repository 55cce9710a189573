"""The disk tier of issue 31, modelled: a bounded, crash-safe directory of chunk files below
the host tier. One idea per module:

- :mod:`spec.disk.directory`: the filesystem the tier lives in (final files, temp files,
  what the file format lets a reader check, what a crash and an outside hand leave behind);
- :mod:`spec.disk.tier`: the OWNER client over one directory (index, byte reservations,
  pins, eviction by policy, restart = rebuild) and the READER's view;
- :mod:`spec.disk.model`: the bounded exhaustive explorer's view of it.

The DK-* invariants (:mod:`spec.invariants.disk`) read the snapshots these modules export.
"""
