"""The budget of ``hybridkv check``: how many states and how much memory a search may take.

A breadth-first search keeps every state it has seen. Measured on the engine model
(``--requests 2 --groups full,mamba``, 2-core machine): the process grows by about 10 KB per
state (1 GB at 100,000 states) and explores 500-1,700 states a second, slower as the states
deepen. Without a bound, ``--depth 1000000000`` grew to 8 GB in 30 minutes without a word.

The defaults: :data:`DEFAULT_MAX_STATES` states (about 1 GB and a few minutes on that machine,
four times the largest accepted configuration, 25,286 states), and a resident-memory ceiling of
half the memory available when the command starts (:func:`default_max_memory_mib`), which
stops a search whose states are larger than measured before the machine runs short.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "DEFAULT_MAX_STATES",
    "EXIT_CUT",
    "available_memory_bytes",
    "bound_message",
    "default_max_memory_mib",
]

DEFAULT_MAX_STATES = 100_000
EXIT_CUT = 3
"""Exit code of a search a budget stopped: not a failure of the model (exit 1), not bad
arguments (exit 2), but a result that proves nothing past what it explored."""

MIB = 1 << 20
# Where the platform tells nothing: a ceiling a laptop or a CI runner holds.
_FALLBACK_AVAILABLE = 4 << 30


def available_memory_bytes() -> int:
    """Memory the machine can give a process now: MemAvailable of /proc/meminfo (Linux), else
    the physical memory (sysconf), else 4 GiB."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                name, _, value = line.partition(":")
                if name == "MemAvailable":
                    return int(value.split()[0]) * 1024  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return _FALLBACK_AVAILABLE


def default_max_memory_mib() -> int:
    """Half the memory available now, in MiB: the rest stays for the machine's other work."""
    return max(available_memory_bytes() // 2 // MIB, 1)


_FLAGS = {"max_states": "--max-states", "max_memory": "--max-memory"}
_WHAT = {"max_states": "the state budget", "max_memory": "the memory budget"}


def bound_message(report: Mapping[str, Any]) -> str:
    """The one line that ends a search a budget stopped: the flag, what was explored, and that
    the result is not exhaustive. Pre: ``report["bound"]`` names the budget that cut it."""
    cut = report["bound"]["cut_by"]
    flag = _FLAGS[cut]
    limit = report["budget"]["max_states" if cut == "max_states" else "max_memory_mib"]
    unit = "" if cut == "max_states" else " MiB"
    checked = report["bound"]["checked_depth"]
    memory = report["memory_mib"]
    held = "" if memory is None else f" and {memory:,} MiB"
    return (
        f"hybridkv check: not exhaustive: {_WHAT[cut]} ({flag} {limit}{unit}) stopped the "
        f"search after {report['states']:,} states{held}, every "
        f"state within {checked} actions checked (depth {report['depth']} of "
        f"{report['max_depth']} reached); raise {flag} to explore further"
    )
