"""``hybridkv simulate`` runs torch on one intra-op thread, and why.

Each step writes every running request's mamba states whole (``ContentCodec.write_state``: a
``fill_`` of a few MB per state, tens of GB over a default run) and moves MB-sized blocks on the
transfer thread. torch runs each of those ops as an OpenMP parallel region over its intra-op
threads, and every region ends at a barrier that waits for all of them. On a machine with more
runnable threads than free cores (CI's 2 shared cores, a desktop that is busy) a thread that
lost its core holds the barrier for a scheduler time slice, tens of thousands of times a run:
measured (cProfile) on a loaded 2-core machine, ``--faults 1.0`` spent 11 to 25 s in ``fill_``
against 1.3 s at ``OMP_NUM_THREADS=1``, the same fills. One thread makes a run's wall time a
function of its work, not of the machine's load: ``tools/bench_simulate_cost.py`` prints both
sides.
What it costs, on an idle many-core machine, is the parallel speed-up of the fills
(docs/benchmarks/simulate.md has the figures).

The setting is torch's process-wide one (the transfer thread follows it); it is restored when
the run returns, so a caller that imports :func:`hybridkv.simulator.run.simulate` keeps its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

__all__ = ["one_intra_op_thread"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def one_intra_op_thread(run: Callable[_P, _R]) -> Callable[_P, _R]:
    """``run`` with torch's intra-op threads set to 1 while it runs (module docstring).

    Post: torch's thread count is what it was before the call, whether ``run`` returned or
    raised.
    """

    @functools.wraps(run)
    def on_one_thread(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return run(*args, **kwargs)
        finally:
            torch.set_num_threads(previous)

    return on_one_thread
