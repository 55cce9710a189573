"""hybridkv inside vLLM 0.33 and 0.32.x (the CPU build): the only package that imports vllm.

Load the connector with ``kv_connector="HybridKVConnector"`` and
``kv_connector_module_path="hybridkv.vllm"`` (docs/howto/serve.md). Importing this package
also registers the name in vLLM's ``KVConnectorFactory`` (idempotent), so a configuration that
names only ``kv_connector`` finds it once ``hybridkv.vllm`` is imported, and vLLM's stats logger
can rebuild :class:`HybridKVStats` by class name.

- :mod:`hybridkv.vllm.config`: ``kv_connector_extra_config``, validated at start-up;
- :mod:`hybridkv.vllm.connector`: ``HybridKVConnector`` (both roles) over the connector core;
  its hooks in :mod:`hybridkv.vllm.scheduler_role` and :mod:`hybridkv.vllm.worker_role`, what
  crosses between the roles each step in :mod:`hybridkv.vllm.step_metadata`;
- :mod:`hybridkv.vllm.versions`: the vLLM versions it supports (0.32.x CPU build, 0.33.x),
  any other refused at start-up;
- :mod:`hybridkv.vllm.metrics`: its counters through vLLM's stats and Prometheus pipeline, and
  the host store's events as vLLM KV cache events;
- :mod:`hybridkv.vllm.ranks`: tensor parallel (a job counts once every rank reported it);
- :mod:`hybridkv.vllm.reclaim`: the restart guard against vLLM 0.33's re-admission wedges;
- :mod:`hybridkv.vllm.reset`: ``reset_prefix_cache`` (weight updates): the host and remote
  tiers forget, and the store pins make way for vLLM's pool check;
- :mod:`hybridkv.vllm.remote`: the shared remote tier's scheduler and worker sides;
- :mod:`hybridkv.vllm.views`: the core's view of a vLLM request, rebuilt only when it changed;
- :mod:`hybridkv.vllm.multi`: ``WeightedMultiConnector``, vLLM's ``MultiConnector`` with the
  loading child chosen by ``matched_tokens * load_weight`` (:mod:`hybridkv.connector.selection`),
  named children and name-keyed stats.

These, with the modules they import (checkpoints, events, layout, platform_check), are what
``vllm serve`` loads. :mod:`hybridkv.vllm.harness`, the
in-process engine that tests, benchmarks and ``hybridkv simulate --engine vllm`` run, is a
subpackage that none of them imports (import-linter contract "connector does not import
harness"; ``tests/vllm/test_server_imports.py``).
"""

from __future__ import annotations

from hybridkv.vllm.config import HybridKVConfig, parse_extra_config
from hybridkv.vllm.connector import HybridKVConnector, HybridKVStats

__all__ = ["HybridKVConfig", "HybridKVConnector", "HybridKVStats", "parse_extra_config", "register"]


def register() -> None:
    """Register ``HybridKVConnector`` in vLLM's ``KVConnectorFactory`` (a no-op if present)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    name = HybridKVConnector.__name__
    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, "hybridkv.vllm.connector", name)


register()
