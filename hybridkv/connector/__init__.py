"""The connector core: the scheduler-side state machine and the worker-side job bookkeeping.

Written from the connector contract (docs/explanation/connector-core.md), which the reference
connector ``spec.connector`` models on its own (never imported here); the two are compared call
for call (tests/differential/test_connector_agreement.py). Its engine-facing
interface is vLLM's connector hooks as plain values (:mod:`hybridkv.connector.api`), so the
spec scheduler (through ``hybridkv.simulator.engine_adapter``) and vLLM's scheduler drive it alike.

- :class:`ConnectorCore` (:mod:`.core`): claims, load and store jobs, failure memory, delayed
  frees, pins of store sources in the GPU block pool; pure Python over a
  :class:`~hybridkv.store.HostStore`.
- :class:`JobTracker` (:mod:`.tracker`): the worker side's folding of job results into
  request-level outcomes.
- :func:`decide_claim` (:mod:`.claims`): the claim rule, how many tokens a request may load.
- :class:`TransferWorker` (:mod:`.worker`): runs the jobs with a transfer engine over
  canonical caches, and :func:`build_cpu_stack` (:mod:`.stack`), which wires core, store, host
  memory, engine and worker for one model's caches. Both import torch, so they load on first
  use (``from hybridkv.connector import TransferWorker``): a scheduler process that imports
  only the core never loads torch (tests/connector/test_core_costs.py).

The public names are ``__all__`` (docs/reference/api/connector.md); the modules under it are
not, and may move.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hybridkv.connector import api
from hybridkv.connector.api import *  # noqa: F403  (exactly api.__all__, appended below)
from hybridkv.connector.checkpoints import NO_CHECKPOINTS, CheckpointRule
from hybridkv.connector.claims import ClaimDecision, decide_claim, some_group_passes
from hybridkv.connector.core import ConnectorCore, ConnectorStats, LoadMode
from hybridkv.connector.geometry import ConnectorGeometry
from hybridkv.connector.tracker import JobTracker

if TYPE_CHECKING:
    from hybridkv.connector.stack import OffloadStack, build_cpu_stack
    from hybridkv.connector.worker import HostSlots, JobFaultHook, TransferWorker, WorkerStats

# The worker side imports torch: its names load on first use, from the module that defines them
# (PEP 562), so ``import hybridkv.connector`` stays pure Python.
_ON_FIRST_USE = {
    "HostSlots": "hybridkv.connector.worker",
    "JobFaultHook": "hybridkv.connector.worker",
    "TransferWorker": "hybridkv.connector.worker",
    "WorkerStats": "hybridkv.connector.worker",
    "OffloadStack": "hybridkv.connector.stack",
    "build_cpu_stack": "hybridkv.connector.stack",
}


def __getattr__(name: str) -> Any:
    module = _ON_FIRST_USE.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridkv.connector' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    """The names the package has now and those it loads on first use (``dir()``, autodoc)."""
    return sorted({*globals(), *_ON_FIRST_USE})


# The core and its helpers; the boundary values of :mod:`.api` are re-exported through its own
# ``__all__``, appended below, so the two lists cannot drift apart.
__all__ = [
    "NO_CHECKPOINTS",
    "CheckpointRule",
    "ClaimDecision",
    "ConnectorCore",
    "ConnectorGeometry",
    "ConnectorStats",
    "HostSlots",
    "JobFaultHook",
    "JobTracker",
    "LoadMode",
    "OffloadStack",
    "TransferWorker",
    "WorkerStats",
    "build_cpu_stack",
    "decide_claim",
    "some_group_passes",
]
__all__ += api.__all__
