"""The explorer adapter for the disk tier: one OWNER over a directory that other hands share.

A :class:`DiskScenario` names the universe: the keys (``k0``, ``k1``...) and their value
lengths, the capacity in bytes, the file layout, the policy, the fsync policy, and which
outside hands act (another engine writing and removing files; damage). Each key's value is
fixed (content addressing: every writer of a key writes equal bytes).

Actions (each prints as a trace step):

- ``write k0`` / ``write k0 lands|fails``: the owner's ``set`` begins (reserve, evict, temp)
  and ends (rename, or an I/O error);
- ``read k0`` / ``read k0 ends``: the owner's ``get`` opens the file of a key the index or
  the directory holds (or finds it gone: a miss at once) and ends (read, verify, unpin);
- ``rescan``: the owner adopts what others wrote and forgets what they removed;
- ``peer writes k0`` / ``peer renames k0``: another engine's write of a key;
- ``k0 removed``: another engine evicts a file;
- ``corrupt k0`` / ``truncate k0`` / ``foreign k0``: an outside hand damages a whole file;
- ``kill`` / ``power loss``: the owner's process dies (its reads and writes with it);
  ``restart``: a new owner rebuilds from the directory.

Every state is checked against every DK-* invariant (the three subjects of
:mod:`spec.invariants.disk`). A state with work in flight that enables nothing would hold a
pin or a reservation for ever; it is reported as DK-3 (it cannot happen: a crash is always
possible while the owner lives, a restart while it is down).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from spec.disk.directory import (
    Crash,
    Damage,
    Directory,
    FileLayout,
    FsyncPolicy,
    Verdict,
    verify,
)
from spec.disk.tier import DiskRefusal, DiskTier, ReadFault, ReadHandle
from spec.errors import ConfigError
from spec.invariants import check_all

__all__ = [
    "DiskAction",
    "DiskModel",
    "DiskScenario",
    "DiskState",
    "Harm",
    "Lose",
    "PeerDone",
    "PeerWrite",
    "Read",
    "ReadDone",
    "Remove",
    "Rescan",
    "Restart",
    "Write",
    "WriteDone",
]


SMALL_LAYOUT = FileLayout(alignment=2, header_bytes=0)
"""The explorer's layout: files padded to 2 bytes, no header beyond the key."""


@dataclass(frozen=True, slots=True)
class DiskScenario:
    """The universe of one exploration; every field small (the search is exhaustive)."""

    lengths: tuple[int, ...] = (2, 1, 1)
    capacity: int = 8
    layout: FileLayout = SMALL_LAYOUT
    policy: str = "lru"
    fsync: FsyncPolicy = FsyncPolicy.FILE
    peer: bool = True
    damage: bool = True
    crashes: tuple[Crash, ...] = (Crash.KILL,)

    def __post_init__(self) -> None:
        """Pre: at least one value length, each an int >= 1; ``capacity`` an int >= 1
        (``ConfigError`` naming the field otherwise)."""
        if not self.lengths or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.lengths
        ):
            raise ConfigError("lengths", self.lengths, "must be ints >= 1", "give e.g. (2, 1)")
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int):
            raise ConfigError("capacity", self.capacity, "must be an int", "give bytes")

    def chunk_keys(self) -> tuple[bytes, ...]:
        """``k0``, ``k1``... one per value length. Pure."""
        return tuple(f"k{i}".encode() for i in range(len(self.lengths)))

    def truth(self) -> dict[bytes, bytes]:
        """Each key's value: the first bytes of SHA-256 over the key. Pure."""
        return {
            key: hashlib.sha256(key).digest()[:n]
            for key, n in zip(self.chunk_keys(), self.lengths, strict=True)
        }

    def tier(self, directory: Directory) -> DiskTier:
        """A new OWNER over ``directory`` (a start or a restart). Post: the rebuild ran
        (:class:`~spec.disk.tier.DiskTier`); nothing else changes."""
        return DiskTier(
            directory, self.capacity, policy=self.policy, fsync=self.fsync, layout=self.layout
        )


def _name(key: bytes) -> str:
    return key.decode()


@dataclass(frozen=True, slots=True)
class Write:
    """The owner's ``set`` of ``key`` begins."""

    key: bytes

    def __str__(self) -> str:
        return f"write {_name(self.key)}"


@dataclass(frozen=True, slots=True)
class WriteDone:
    """The owner's write of ``key`` ends: renamed (``ok``) or an I/O error."""

    key: bytes
    ok: bool

    def __str__(self) -> str:
        return f"write {_name(self.key)} {'lands' if self.ok else 'fails'}"


@dataclass(frozen=True, slots=True)
class Read:
    """The owner's ``get`` of an indexed ``key`` opens its file."""

    key: bytes

    def __str__(self) -> str:
        return f"read {_name(self.key)}"


@dataclass(frozen=True, slots=True)
class ReadDone:
    """The owner's read of ``key`` reads, verifies and unpins."""

    key: bytes

    def __str__(self) -> str:
        return f"read {_name(self.key)} ends"


@dataclass(frozen=True, slots=True)
class Rescan:
    """The owner adopts others' files and forgets removed ones."""

    def __str__(self) -> str:
        return "rescan"


@dataclass(frozen=True, slots=True)
class PeerWrite:
    """Another engine opens a temp for ``key``."""

    key: bytes

    def __str__(self) -> str:
        return f"peer writes {_name(self.key)}"


@dataclass(frozen=True, slots=True)
class PeerDone:
    """Another engine renames its temp of ``key``."""

    key: bytes

    def __str__(self) -> str:
        return f"peer renames {_name(self.key)}"


@dataclass(frozen=True, slots=True)
class Remove:
    """Another engine unlinks the final file of ``key``."""

    key: bytes

    def __str__(self) -> str:
        return f"{_name(self.key)} removed"


@dataclass(frozen=True, slots=True)
class Harm:
    """An outside hand damages the whole final file of ``key``."""

    key: bytes
    how: Damage

    def __str__(self) -> str:
        return f"{self.how.value} {_name(self.key)}"


@dataclass(frozen=True, slots=True)
class Lose:
    """The owner's process dies."""

    how: Crash

    def __str__(self) -> str:
        return "kill" if self.how is Crash.KILL else "power loss"


@dataclass(frozen=True, slots=True)
class Restart:
    """A new owner rebuilds from the directory."""

    def __str__(self) -> str:
        return "restart"


DiskAction = (
    Write | WriteDone | Read | ReadDone | Rescan | PeerWrite | PeerDone | Remove | Harm | Lose
) | Restart

Resolved = tuple[str, str, str, bool]


@dataclass(slots=True)
class DiskState:
    """The directory, the owner (None while it is down), its reads in flight, the other
    engine's writes in flight (key -> temp number), and what the last action resolved: its
    reads, the growth of ``damaged``, whether it was a restart."""

    directory: Directory
    tier: DiskTier | None
    reads: dict[bytes, ReadHandle]
    peer: dict[bytes, int]
    resolved: tuple[Resolved, ...] = ()
    damaged: int = 0
    restarted: bool = False

    def copy(self) -> DiskState:
        """An independent copy (the tier over the copied directory). Frame: ``self``."""
        directory = self.directory.copy()
        tier = None if self.tier is None else self.tier.copy(directory)
        return DiskState(directory, tier, dict(self.reads), dict(self.peer))


class DiskModel:
    """:class:`spec.explorer.Model` over :class:`DiskState`."""

    stuck_invariant_id = "DK-3"

    def __init__(self, scenario: DiskScenario) -> None:
        """Pre: a :class:`DiskScenario`. Post: a model of it; nothing explored yet."""
        self.scenario = scenario
        self._truth = scenario.truth()
        self._labels: list[str] = []

    # --- the Model protocol ---

    def initial_states(self) -> Iterable[DiskState]:
        """One state: an empty directory and a fresh owner. Pure."""
        directory = Directory()
        return [DiskState(directory, self.scenario.tier(directory), {}, {})]

    def enabled(self, state: DiskState) -> Iterable[DiskAction]:
        """Every action of the module docstring that may happen in ``state``. Pure."""
        return [*self._owner_actions(state), *self._outside_actions(state)]

    def step(self, state: DiskState, action: DiskAction) -> DiskState:
        """The successor of ``state`` under ``action``; ``state`` is left unchanged.

        Pre: ``action`` is enabled in ``state``. Post: the successor; the transition's labels
        kept for :meth:`labels`.
        """
        twin = state.copy()
        self._labels = [type(action).__name__.lower()]
        if isinstance(action, (Read, ReadDone)):
            self._read(twin, action)
        elif isinstance(action, (Lose, Restart)):
            self._crash(twin, action)
        elif isinstance(action, (PeerWrite, PeerDone, Remove, Harm)):
            self._outside(twin, action)
        else:
            self._owner(twin, action)
        return twin

    def key(self, state: DiskState) -> Hashable:
        """Everything that decides the future and the violations. Pure."""
        files, temps = state.directory.files, state.directory.temps
        reads = tuple(
            sorted(
                (
                    key,
                    h.file.header_key,
                    h.file.value,
                    h.file.whole,
                    h.pinned,
                    key in files and files[key].inode == h.file.inode,
                )
                for key, h in state.reads.items()
            )
        )
        peer = tuple(sorted((key, number in temps) for key, number in state.peer.items()))
        tier = None if state.tier is None else state.tier.freeze()
        extra = (state.resolved, state.damaged, state.restarted)
        return (state.directory.freeze(), tier, reads, peer, extra)

    def violations(self, state: DiskState) -> Mapping[str, list[str]]:
        """Every failing DK-* invariant of ``state``. Pure."""
        snap = None if state.tier is None else state.tier.snapshot()
        failing = {} if snap is None else dict(check_all("disk", snap))
        failing.update(check_all("disk_dir", self.directory_view(state, snap)))
        failing.update(check_all("disk_content", self.content(state)))
        return failing

    def is_final(self, state: DiskState) -> bool:
        """The owner is up and nothing is in flight anywhere. Pure."""
        tier = state.tier
        return tier is not None and not (tier.in_flight() or state.reads or state.peer)

    def labels(self, state: DiskState, action: DiskAction) -> Iterable[str]:
        """The action's kind and what it caused (``write:no_space``, ``read:corrupt``...).

        Pre: called right after ``step(state, action)``. Frame: nothing changes.
        """
        return list(self._labels)

    # --- the views the predicates read (the tests use them too) ---

    def directory_view(self, state: DiskState, snap: dict[str, Any] | None) -> dict[str, Any]:
        """The ``disk_dir`` observation of ``state``. Pure."""
        view: dict[str, Any] = dict(state.directory.listing())
        view.update(
            disk=snap,
            restarted=state.restarted,
            peer_writes=tuple(sorted(key.hex() for key in state.peer)),
        )
        return view

    def content(self, state: DiskState) -> dict[str, Any]:
        """The ``disk_content`` observation of ``state``. Pure."""
        truth = {key.hex(): value.hex() for key, value in self._truth.items()}
        return {"reads": state.resolved, "truth": truth, "damaged": state.damaged}

    # --- what may happen ---

    def _owner_actions(self, state: DiskState) -> list[DiskAction]:
        """The owner's calls (or its restart while it is down). Pure."""
        sc, tier = self.scenario, state.tier
        if tier is None:
            return [Restart()]
        actions: list[DiskAction] = []
        flying = set(tier.in_flight())
        for key in sc.chunk_keys():
            if key in flying:
                actions += [WriteDone(key, True), WriteDone(key, False)]
            elif key in state.reads:
                actions.append(ReadDone(key))
            else:
                actions.append(Write(key))
                if tier.indexed(key) or key in state.directory.files:
                    actions.append(Read(key))
        if sc.peer:
            actions.append(Rescan())
        return actions + [Lose(how) for how in sc.crashes]

    def _outside_actions(self, state: DiskState) -> list[DiskAction]:
        """Another engine's writes and removals, and damage. Pure."""
        sc, files = self.scenario, state.directory.files
        actions: list[DiskAction] = []
        for key in sc.chunk_keys():
            if sc.peer:
                actions.append(PeerDone(key) if key in state.peer else PeerWrite(key))
                if key in files:
                    actions.append(Remove(key))
            if key in files and sc.damage and verify(files[key], key) is Verdict.WHOLE:
                actions += [Harm(key, how) for how in Damage]
        return actions

    # --- transitions ---

    def _owner(self, state: DiskState, action: Write | WriteDone | Rescan) -> None:
        tier = state.tier
        assert tier is not None  # enabled only while the owner is up
        if isinstance(action, Write):
            started = tier.write_begin(action.key, self._truth[action.key])
            if isinstance(started, DiskRefusal):
                self._labels.append(f"write:{started.value}")
            elif started.evicted:
                self._labels.append("write:evicted")
        elif isinstance(action, WriteDone):
            if not tier.write_finish(action.key, action.ok):
                self._labels.append("write:failed")
        elif tier.rescan():
            self._labels.append("rescan:adopted")

    def _read(self, state: DiskState, action: Read | ReadDone) -> None:
        tier = state.tier
        assert tier is not None  # enabled only while the owner is up
        key = action.key
        if isinstance(action, Read):
            handle = tier.read_begin(key)
            if isinstance(handle, ReadHandle):
                state.reads[key] = handle
            else:
                word = "miss" if handle is None else "fault"
                state.resolved = ((key.hex(), "absent", word, False),)
                self._labels.append("read:absent")
            return
        handle = state.reads.pop(key)
        current = state.directory.files.get(key)
        same = current is not None and current.inode == handle.file.inode
        opened = verify(current if same and current else handle.file, key).value
        before = tier.snapshot()["counters"]["damaged"]
        returned = tier.read_end(handle)
        after = state.directory.files.get(key)
        linked = after is not None and after.inode == handle.file.inode
        word = (
            "miss"
            if returned is None
            else "fault"
            if isinstance(returned, ReadFault)
            else returned.hex()
        )
        state.resolved = ((key.hex(), opened, word, linked),)
        state.damaged = tier.snapshot()["counters"]["damaged"] - before
        self._labels.append(f"read:{opened}")

    def _outside(self, state: DiskState, action: PeerWrite | PeerDone | Remove | Harm) -> None:
        directory, key = state.directory, action.key
        if isinstance(action, PeerWrite):
            size = self.scenario.layout.footprint(key, self._truth[key])
            state.peer[key] = directory.create_temp(key, "peer", size)
        elif isinstance(action, PeerDone):
            if not directory.rename(state.peer.pop(key), self._truth[key], durable=True):
                self._labels.append("peer:temp_lost")
        elif isinstance(action, Remove):
            directory.unlink(key)
        else:
            other = (
                next(k for k in self.scenario.chunk_keys() if k != key)
                if len(self._truth) > 1
                else key
            )
            value = self._truth[other]
            size = self.scenario.layout.footprint(other, value)
            directory.damage(key, action.how, (other, value, size))

    def _crash(self, state: DiskState, action: Lose | Restart) -> None:
        if isinstance(action, Restart):
            state.tier = self.scenario.tier(state.directory)
            state.restarted = True
            counters = state.tier.snapshot()["counters"]
            self._labels += [f"restart:{name}" for name in ("torn", "evicted") if counters[name]]
            return
        state.directory.crash(action.how, "self")
        state.tier = None
        state.reads = {}
