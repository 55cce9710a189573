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
- ``hybridkv.connector.worker.TransferWorker``: runs the jobs with a transfer engine over
  canonical caches (imports torch, so it is not re-exported here), and
  ``hybridkv.connector.stack.build_cpu_stack``, which wires core, store, host memory, engine
  and worker for one model's caches.
"""

from __future__ import annotations

from hybridkv.connector import api
from hybridkv.connector.api import *  # noqa: F403  (exactly api.__all__, appended below)
from hybridkv.connector.checkpoints import NO_CHECKPOINTS, CheckpointRule
from hybridkv.connector.core import ConnectorCore, ConnectorStats, LoadMode
from hybridkv.connector.geometry import ConnectorGeometry
from hybridkv.connector.tracker import JobTracker

# The core and its helpers; the boundary values of :mod:`.api` are re-exported through its own
# ``__all__``, appended below, so the two lists cannot drift apart.
__all__ = [
    "NO_CHECKPOINTS",
    "CheckpointRule",
    "ConnectorCore",
    "ConnectorGeometry",
    "ConnectorStats",
    "JobTracker",
    "LoadMode",
]
__all__ += api.__all__
