"""The in-process engine's worker adapter for
:class:`~hybridkv.vllm.multi.WeightedMultiConnector`: one child adapter per named child
(:class:`~hybridkv.vllm.harness.cpu_worker.HybridKVOnCPU`,
:class:`~hybridkv.vllm.harness.native_cpu.NativeOffloadOnCPU` or
:class:`~hybridkv.vllm.harness.inprocess.RegisterCaches`), each sizing and registering its own
child.

``configure`` hands each child adapter a view of the vLLM config whose ``kv_transfer_config``
exposes that child's own ``kv_connector_extra_config`` (the very dict inside the multi-connector's
``connectors`` entry), so what the child adapter writes there (a host size) is what the child
reads when vLLM builds it. ``attach`` registers the same caches with every child, as the
multi-connector's own ``register_kv_caches`` would.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["MultiOnCPU"]


class MultiOnCPU:
    """A :class:`~hybridkv.vllm.harness.inprocess.WorkerAdapter` over child adapters keyed by the
    children's names (every child named in the config needs one)."""

    def __init__(self, children: Mapping[str, Any]) -> None:
        if not children:
            raise ValueError("children: give one worker adapter per child name")
        self.children = dict(children)

    def _entries(self, vllm_config: Any) -> list[dict[str, Any]]:
        entries = vllm_config.kv_transfer_config.kv_connector_extra_config["connectors"]
        names = [entry.get("name") for entry in entries]
        if sorted(map(str, names)) != sorted(self.children):
            raise ValueError(f"adapters for {sorted(self.children)}; the config names {names}")
        return list(entries)

    def configure(self, vllm_config: Any, kv_cache_config: Any) -> None:
        for entry in self._entries(vllm_config):
            view = copy.copy(vllm_config)
            # Only kv_connector_extra_config is read by the child adapters' configure.
            extra = entry.setdefault("kv_connector_extra_config", {})
            view.kv_transfer_config = SimpleNamespace(kv_connector_extra_config=extra)
            self.children[entry["name"]].configure(view, kv_cache_config)

    def attach(self, connector: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, adapter in self.children.items():
            adapter.attach(connector.child(name), kv_caches)

    def pending(self) -> int:
        return sum(adapter.pending() for adapter in self.children.values())

    def stats(self) -> dict[str, int]:
        """Each child adapter's counters, as ``"<child>.<counter>"``."""
        return {
            f"{name}.{key}": value
            for name, adapter in self.children.items()
            for key, value in adapter.stats().items()
        }
