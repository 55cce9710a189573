"""What one ``hybridkv simulate`` run may ask of this machine, checked before anything is built.

Three kinds of refusal, each naming the flag, the value and a value that works:

- a number flag out of range (``--gpu-blocks 0``);
- a run that would not fit in memory: the bytes it would allocate (KV caches, host store, block
  bookkeeping, the trace and the engine's per-token state) against what the machine has
  available, computed BEFORE the trace is generated and before any cache is allocated;
- a trace whose arrivals lie beyond the steps a run may take.

The caches and the host store are counted exactly (pages x blocks x layers; ``--host-bytes``).
The per-token and per-block costs of the Python side are measured constants (below).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hybridkv.errors import HybridKVConfigError
from hybridkv.simulator.flags import require_at_least
from hybridkv.testbed.trace import TraceRequest

if TYPE_CHECKING:
    from hybridkv.simulator.options import SimOptions
    from hybridkv.simulator.setup import SimSetup

__all__ = [
    "MAX_STEPS",
    "Lever",
    "MemoryTerm",
    "available_bytes",
    "check_arrivals",
    "check_flags",
    "check_run_memory",
    "check_trace_memory",
]

# Measured: a multi-turn run of 256 requests took 108 MB more resident memory than one of 32
# with the host store fixed (~140 bytes per prompt token: token tuples, block hashes, the
# engine's records); counted at 256 for headroom.
BYTES_PER_TOKEN = 256
# The block pool keeps a reference count and a free-list entry per block (~48 bytes).
BYTES_PER_BLOCK = 64
# A trace file holds ~5 characters per token; parsed, a token takes ~40 bytes (list + int),
# plus the text itself while it is parsed.
TRACE_FILE_EXPANSION = 10
# A run may take this share of the memory available when it starts.
USABLE_SHARE = 0.8
# Steps a run may take after its last arrival before it counts as a wedge.
MAX_STEPS = 1_000_000
SAMPLE_REQUESTS = 64  # a built-in workload's size is measured on this many requests


@dataclass(frozen=True, slots=True)
class Lever:
    """A flag that scales a memory term: ``fixed + (value + overhead_units) * per_unit`` bytes.

    ``overhead_units`` are units the run adds to the flag's own value (the null block of
    ``--gpu-blocks``); ``fixed`` the term's bytes this flag does not scale.
    """

    flag: str
    value: int
    per_unit: int
    fixed: int = 0
    overhead_units: int = 0

    def fits(self, room: int) -> int:
        """The largest value of the flag whose term takes at most ``room`` bytes."""
        return (room - self.fixed) // self.per_unit - self.overhead_units


@dataclass(frozen=True, slots=True)
class MemoryTerm:
    """One part of a run's memory: ``nbytes`` in all, and the flags that scale it."""

    what: str
    nbytes: int
    levers: tuple[Lever, ...]


def check_flags(options: SimOptions) -> None:
    """Refuse a number flag out of range, naming the flag and a value that works."""
    for flag, value, example in (
        ("--requests", options.requests, 32),
        ("--gpu-blocks", options.gpu_blocks, 64),
        ("--layers-per-group", options.layers_per_group, 1),
        ("--max-num-batched-tokens", options.max_num_batched_tokens, 2048),
        ("--max-num-running", options.max_num_running, 8),
        ("--max-model-len", options.max_model_len, 32768),
    ):
        require_at_least(flag, value, 1, example)


def available_bytes() -> int:
    """Memory this process may still take: MemAvailable, bounded by a cgroup limit if any."""
    found = [_meminfo_available(), _cgroup_room()]
    known = [n for n in found if n is not None]
    if known:
        return min(known)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown platform: the allocation itself decides


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text(encoding="ascii").strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text(encoding="ascii").strip()
        return None if limit == "max" else int(limit) - int(used)
    except (OSError, ValueError):
        return None


def _gpu_bytes() -> int:
    import torch

    free, _total = torch.cuda.mem_get_info()
    return int(free)


def check_trace_memory(options: SimOptions, available: int | None = None) -> None:
    """Refuse a trace that would not fit, before it is generated or read.

    A built-in workload is measured on its first :data:`SAMPLE_REQUESTS` requests; a file by
    its size on disk. Refusal: :class:`HybridKVConfigError` naming ``--requests`` or
    ``--trace``.
    """
    budget = int(USABLE_SHARE * (available_bytes() if available is None else available))
    if options.trace.endswith(".jsonl"):
        try:
            size = Path(options.trace).stat().st_size
        except OSError:
            return  # the reader names a missing or unreadable file
        if size * TRACE_FILE_EXPANSION > budget:
            raise HybridKVConfigError(
                "--trace",
                options.trace,
                f"is {_size(size)}; read and parsed it would take about "
                f"{_size(size * TRACE_FILE_EXPANSION)} and {_size(budget)} is free to use",
                f"cut the trace below {_size(budget // TRACE_FILE_EXPANSION)}",
            )
        return
    _refuse_if_over([_requests_term(options)], budget, "memory")


def _requests_term(options: SimOptions) -> MemoryTerm:
    from hybridkv.simulator.options import DEFAULT_REQUESTS
    from hybridkv.testbed.workloads import builtin_workload

    count = DEFAULT_REQUESTS if options.requests is None else options.requests
    sample = builtin_workload(options.trace, min(count, SAMPLE_REQUESTS))
    return _trace_term(count, -(-sum(sequence_lengths(sample)) // len(sample)))


def _trace_term(requests: int, tokens_per_request: int) -> MemoryTerm:
    lever = Lever("--requests", requests, tokens_per_request * BYTES_PER_TOKEN)
    return MemoryTerm("trace and engine state", requests * lever.per_unit, (lever,))


def sequence_lengths(trace: Sequence[TraceRequest]) -> list[int]:
    """Each request's whole sequence: its conversation so far, its prompt and its output."""
    context: dict[str, int] = {}
    lengths = []
    for r in trace:
        total = (context.get(r.conversation, 0) if r.conversation else 0) + len(r.prompt)
        total += r.max_tokens
        if r.conversation:
            context[r.conversation] = total
        lengths.append(total)
    return lengths


def check_run_memory(
    options: SimOptions,
    setup: SimSetup,
    trace: Sequence[TraceRequest],
    available: int | None = None,
) -> None:
    """Refuse a run whose allocations would not fit (module docstring), before any is made.

    ``available`` stands in for the machine's free memory (tests; then the caches count
    against it even with ``--device cuda``). Refusal: :class:`HybridKVConfigError` naming
    the flag that scales the largest term and the value of it that fits, all else unchanged.
    """
    page = setup.layout.groups[0].page_size_bytes  # vLLM pads every group to one page
    blocks, layers = setup.scheduler.num_blocks - 1, options.layers_per_group
    on_gpu = options.device == "cuda" and available is None
    # The block pool's bookkeeping is host memory; it rides with the caches on the CPU.
    per_block = layers * page + (0 if on_gpu else BYTES_PER_BLOCK)
    by_blocks = Lever("--gpu-blocks", blocks, per_block, overhead_units=1)
    by_layers = Lever(
        "--layers-per-group",
        layers,
        (blocks + 1) * page,
        fixed=(blocks + 1) * (per_block - layers * page),
    )
    levers = (by_layers, by_blocks) if layers > 1 else (by_blocks, by_layers)
    caches = MemoryTerm("KV caches", (blocks + 1) * per_block, levers)
    lengths = sequence_lengths(trace)
    host_lever = Lever("--host-bytes", options.host_bytes, 1)
    rest = [
        MemoryTerm("host store", options.host_bytes, (host_lever,)),
        _trace_term(len(trace), -(-sum(lengths) // len(lengths))),
    ]
    ram = int(USABLE_SHARE * (available_bytes() if available is None else available))
    if on_gpu:
        _refuse_if_over([caches], int(USABLE_SHARE * _gpu_bytes()), "GPU memory")
        pool = Lever("--gpu-blocks", blocks, BYTES_PER_BLOCK, overhead_units=1)
        rest.append(MemoryTerm("block bookkeeping", (blocks + 1) * BYTES_PER_BLOCK, (pool,)))
        _refuse_if_over(rest, ram, "memory")
    else:
        _refuse_if_over([caches, *rest], ram, "memory")


def _refuse_if_over(terms: Sequence[MemoryTerm], budget: int, where: str) -> None:
    total = sum(t.nbytes for t in terms)
    if total <= budget:
        return
    parts = ", ".join(f"{t.what} {_size(t.nbytes)}" for t in terms if t.nbytes)
    problem = f"the run would allocate {_size(total)} ({parts}); {_size(budget)} of {where} is free"
    ordered = sorted(terms, key=lambda t: t.nbytes, reverse=True)
    for term in ordered:
        room = budget - (total - term.nbytes)
        for lever in term.levers:
            fits = lever.fits(room)
            if lever.value > fits >= 1:
                shown = f"{fits >> 20}MiB" if lever.flag == "--host-bytes" else str(fits)
                raise HybridKVConfigError(
                    lever.flag, lever.value, problem, f"pass {lever.flag} {shown} or less"
                )
    first = ordered[0].levers[0]
    flags = ", ".join(sorted({lever.flag for t in terms for lever in t.levers}))
    raise HybridKVConfigError(first.flag, first.value, problem, f"free memory, or lower {flags}")


def _size(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


def check_arrivals(trace: Sequence[TraceRequest]) -> int:
    """The step budget of a run of ``trace``: :data:`MAX_STEPS` after its last arrival.

    Refusal: an ``arrival_step`` past :data:`MAX_STEPS` (every idle step is simulated, so a far
    arrival is a run of hours that serves nothing) raises :class:`HybridKVConfigError` naming
    the request's line and the value.
    """
    index, last = max(enumerate(r.arrival_step for r in trace), key=lambda pair: pair[1])
    if last > MAX_STEPS:
        raise HybridKVConfigError(
            f"--trace request {index + 1}: arrival_step",
            last,
            f"is past the {MAX_STEPS} steps a run may spend before it serves anything (each "
            "step is one scheduler step, simulated even when idle)",
            f"count arrival_step in scheduler steps from 0, each below {MAX_STEPS}",
        )
    return last + MAX_STEPS
