"""The reference offload connector: scheduler side, worker side, and the pure rules they use.

- :mod:`spec.connector.geometry`: units, keys and what each group needs for a claim;
- :mod:`spec.connector.claims`: the claim rule as a pure function;
- :mod:`spec.connector.checkpoints`: which mamba states a step writes, at which positions;
- :mod:`spec.connector.stores`: which units a step stores;
- :mod:`spec.connector.loads`: load jobs per alignment segment, load records, resume points;
- :mod:`spec.connector.scheduler_side`: :class:`ReferenceConnector`;
- :mod:`spec.connector.worker_side`: :class:`ReferenceWorker`.
"""

from spec.connector.scheduler_side import LoadMode, ReferenceConnector
from spec.connector.worker_side import ReferenceWorker

__all__ = ["LoadMode", "ReferenceConnector", "ReferenceWorker"]
