"""``WeightedMultiConnector``: vLLM 0.33's ``MultiConnector`` with the load chosen by
``matched_tokens * load_weight``, children named, HMA checked per child, and per-child stats keyed
by the child's name that rebuild in another process.

Load it with ``kv_connector="WeightedMultiConnector"`` and
``kv_connector_module_path="hybridkv.vllm.multi"``; ``kv_connector_extra_config.connectors`` lists
the children as vLLM's own ``MultiConnector`` does (each a ``KVTransferConfig``'s fields), each
with two keys more: ``name`` (unique; required) and ``load_weight`` (>= 0, default 1.0)
(docs/howto/serve.md, "Compose with other connectors").

What it changes in vLLM's ``MultiConnector`` (which it subclasses; the rest is vLLM's code run
as is: saves to every child, per-child metadata, worker-side calls, ``handle_preemptions``
forwarded with each child's own metadata, ``request_finished``/``request_finished_all_groups``
to every child with the free delayed while any child sends, results and errors merged):

- **Selection** (:func:`hybridkv.connector.selection.select`): every child is asked on every
  lookup; the child with the largest ``matched_tokens * load_weight`` loads, ties to the first
  listed; any child still looking up (``None``) makes the answer ``None`` (vLLM asks again);
  vLLM's own takes the first child with hits. ``update_state_after_alloc`` then gives the chosen
  child vLLM's external count and every other child 0 (they still see the real blocks, to store).
  A request asked again (after a preemption or a failed load) is chosen afresh.
- **HMA per child**: a model with more than one KV cache group, with vLLM's hybrid KV cache
  manager on, needs every child to subclass ``SupportsHMA``; one that does not is refused at
  start-up with a :class:`~hybridkv.errors.HybridKVConfigError` naming it (vLLM's asserts
  "HMA should not be enabled unless all sub-connectors support it", naming none).
- **Stats** (:class:`WeightedMultiStats`): keyed by the child's ``name``, not its class, so two
  children of one class stay apart; each entry carries its connector class as
  ``"module:Class"``, so :meth:`WeightedMultiConnector.build_kv_connector_stats` rebuilds a
  payload that crossed processes by importing that class, with no registration in vLLM's
  ``KVConnectorFactory`` (vLLM's rebuilds by registered class name and raises for a child loaded
  only by module path, docs/shared interface notes §6).

This relies on the attributes vLLM 0.33's ``MultiConnector`` methods read (``_connectors``,
``_ktc_kv_transfer_config``, ``_all_support_hma``, ``_requests_to_connector``,
``_extra_async_saves``); ``__init__`` sets them, because the parent's ``__init__`` would build
``KVTransferConfig(**entry)`` from entries that hold ``name`` and ``load_weight``.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    supports_hma,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

from hybridkv.connector.selection import (
    ChildSpec,
    Chosen,
    Pending,
    SelectionTally,
    parse_children,
    select,
)
from hybridkv.errors import HybridKVConfigError

__all__ = ["WeightedMultiConnector", "WeightedMultiPromMetrics", "WeightedMultiStats"]

_FIELD = "kv_connector_extra_config.connectors"


def class_path(cls: type) -> str:
    """``"module:QualName"``: what :func:`load_class` imports back in another process."""
    return f"{cls.__module__}:{cls.__qualname__}"


def load_class(path: str) -> Any:
    """The class :func:`class_path` named (raises a ``HybridKVConfigError`` naming the path)."""
    module, _, name = path.partition(":")
    try:
        found: Any = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError, ValueError) as error:
        raise HybridKVConfigError(
            "kv_connector_stats[].connector",
            path,
            f"names no importable connector class ({error})",
            "rebuild stats where the child connectors' modules import",
        ) from error
    return found


# ------------------------------------------------------------------ stats


@dataclass
class WeightedMultiStats(KVConnectorStats):
    """Per-child stats: ``data`` maps a child's name to its own ``KVConnectorStats``;
    ``connectors`` maps the same names to the child's connector class (:func:`class_path`).

    ``to_dict`` is ``{name: {"connector": "module:Class", "stats": <child's to_dict()>}}``: plain
    data that pickles and crosses to the logger process, where
    :meth:`WeightedMultiConnector.build_kv_connector_stats` rebuilds it.
    """

    data: dict[str, Any] = field(default_factory=dict)
    connectors: dict[str, str] = field(default_factory=dict)

    def put(self, name: str, connector: str, stats: KVConnectorStats) -> None:
        """Add ``stats`` of the child ``name``, aggregated into what it already holds."""
        known = self.connectors.setdefault(name, connector)
        if known != connector:
            raise ValueError(f"stats of child {name!r}: connector {connector}, before {known}")
        held = self.data.get(name)
        self.data[name] = stats if held is None else held.aggregate(stats)

    def to_dict(self) -> dict[str, Any]:
        return {
            name: {"connector": self.connectors[name], "stats": stats.to_dict()}
            for name, stats in self.data.items()
        }

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, WeightedMultiStats):
            raise TypeError(f"WeightedMultiStats aggregates its own kind, not {type(other)}")
        for name, stats in other.data.items():
            self.put(name, other.connectors[name], stats)
        return self

    def reset(self) -> None:
        for stats in self.data.values():
            stats.reset()

    def reduce(self) -> dict[str, int | float]:
        """One flat mapping for vLLM's log line: ``"<child>.<key>"`` per child's reduced value."""
        return {
            f"{name}.{key}": value
            for name, stats in self.data.items()
            for key, value in stats.reduce().items()
        }

    def is_empty(self) -> bool:
        return all(stats.is_empty() for stats in self.data.values())


class WeightedMultiPromMetrics(KVConnectorPromMetrics):
    """Each child's Prometheus metrics, built once per connector class (two children of one
    class would register the same metric names twice); ``observe`` hands each child's payload
    to its class's metrics."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        by_class: dict[str, KVConnectorPromMetrics],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.by_class = by_class

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for entry in transfer_stats_data.values():
            prom = self.by_class.get(entry["connector"])
            if prom is not None:
                prom.observe(entry["stats"], engine_idx)


# ------------------------------------------------------------------ the connector


def _child_transfer_config(spec: ChildSpec, index: int, engine_id: str | None) -> KVTransferConfig:
    fields = dict(spec.config)
    if engine_id is not None:
        fields.setdefault("engine_id", engine_id)
    try:
        return KVTransferConfig(**fields)
    except (TypeError, ValueError) as error:
        raise HybridKVConfigError(
            f"{_FIELD}[{index}] ({spec.name})",
            dict(spec.config),
            f"is not a valid KVTransferConfig ({' '.join(str(error).split())[:200]})",
            "give the child vLLM's KVTransferConfig fields plus name and load_weight only",
        ) from error


def _child_class(config: KVTransferConfig, spec: ChildSpec, index: int) -> type:
    try:
        return KVConnectorFactory.get_connector_class(config)
    except (ValueError, AttributeError, ImportError) as error:
        raise HybridKVConfigError(
            f"{_FIELD}[{index}].kv_connector ({spec.name})",
            config.kv_connector,
            f"names no connector vLLM can load ({error})",
            "name a registered connector, or set kv_connector_module_path to its module",
        ) from error


class WeightedMultiConnector(MultiConnector):
    """vLLM's ``MultiConnector`` with weighted selection, named children, per-child HMA checks
    and name-keyed stats (module docstring)."""

    # --------------------------------------------------------------- configuration

    @classmethod
    def _specs(cls, kv_transfer_config: KVTransferConfig) -> tuple[ChildSpec, ...]:
        return parse_children(kv_transfer_config.kv_connector_extra_config)

    @classmethod
    def _get_connector_classes_and_configs(cls, vllm_config: Any) -> list[tuple[type, Any]]:
        """Each child's class and a shallow copy of ``vllm_config`` carrying the child's own
        ``KVTransferConfig`` (what vLLM's parent-class methods iterate)."""
        parent = vllm_config.kv_transfer_config
        found = []
        for index, spec in enumerate(cls._specs(parent)):
            child_config = copy.copy(vllm_config)
            child_config.kv_transfer_config = _child_transfer_config(spec, index, parent.engine_id)
            found.append((_child_class(child_config.kv_transfer_config, spec, index), child_config))
        return found

    @classmethod
    def _classes(
        cls, extra_config: Mapping[str, Any], engine_id: str | None
    ) -> list[tuple[ChildSpec, type, KVTransferConfig]]:
        found = []
        for index, spec in enumerate(parse_children(extra_config)):
            config = _child_transfer_config(spec, index, engine_id)
            found.append((spec, _child_class(config, spec, index), config))
        return found

    @classmethod
    def _children(cls, ktc: KVTransferConfig) -> list[tuple[ChildSpec, type, KVTransferConfig]]:
        return cls._classes(ktc.kv_connector_extra_config, ktc.engine_id)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return any(
            child_cls.requires_piecewise_for_cudagraph(config.kv_connector_extra_config)
            for _, child_cls, config in cls._classes(extra_config, None)
        )

    @classmethod
    def all_children_support_hma(cls, kv_transfer_config: KVTransferConfig) -> bool:
        return all(supports_hma(child_cls) for _, child_cls, _ in cls._children(kv_transfer_config))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        return all(
            child_cls.supports_sleep_mode(config)
            for _, child_cls, config in cls._children(kv_transfer_config)
        )

    @staticmethod
    def _check_hma(
        vllm_config: Any, kv_cache_config: Any, specs: list[tuple[ChildSpec, type]]
    ) -> None:
        """Refuse a child without ``SupportsHMA`` when vLLM hands the connector more than one KV
        cache group: vLLM would call ``request_finished_all_groups`` on it."""
        groups = 1 if kv_cache_config is None else len(kv_cache_config.kv_cache_groups)
        if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager or groups <= 1:
            return
        for index, (spec, child_cls) in enumerate(specs):
            if not supports_hma(child_cls):
                raise HybridKVConfigError(
                    f"{_FIELD}[{index}] ({spec.name})",
                    child_cls.__name__,
                    f"does not subclass SupportsHMA, and this model has {groups} KV cache "
                    "groups under vLLM's hybrid KV cache manager",
                    f"drop child {spec.name!r} or use a connector that subclasses SupportsHMA "
                    "(a model with one KV cache group takes any child)",
                )

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        # The parent's __init__ is skipped on purpose (module docstring); the base class's runs.
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        specs = self._specs(vllm_config.kv_transfer_config)
        built = self._get_connector_classes_and_configs(vllm_config)
        classes = [(spec, cls_) for spec, (cls_, _) in zip(specs, built, strict=True)]
        self._check_hma(vllm_config, kv_cache_config, classes)
        self.specs: tuple[ChildSpec, ...] = specs
        self._connectors = [child_cls(config, role, kv_cache_config) for child_cls, config in built]
        self._ktc_kv_transfer_config = [config.kv_transfer_config for _, config in built]
        self._all_support_hma = all(supports_hma(c) for c in self._connectors)
        self._requests_to_connector: dict[str, int] = {}
        self._extra_async_saves: dict[str, int] = {}
        self._weights = tuple(s.load_weight for s in specs)
        self.selections = SelectionTally([s.name for s in specs])

    def child(self, name: str) -> KVConnectorBase_V1:
        """The child connector named ``name``."""
        for spec, connector in zip(self.specs, self._connectors, strict=True):
            if spec.name == name:
                return connector
        raise KeyError(f"no child named {name!r} (children: {[s.name for s in self.specs]})")

    # --------------------------------------------------------------- selection

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        # A request asked again (preempted, or its load failed) is chosen afresh.
        self._requests_to_connector.pop(rid, None)
        answers: list[int | None] = []
        flags: list[bool] = []
        for spec, connector in zip(self.specs, self._connectors, strict=True):
            tokens, load_async = connector.get_num_new_matched_tokens(request, num_computed_tokens)
            if tokens is not None and tokens < 0:
                raise RuntimeError(
                    f"child {spec.name!r} ({type(connector).__name__}) answered {tokens} "
                    f"matched tokens for request {rid!r}: vLLM's contract is >= 0 or None"
                )
            answers.append(tokens)
            flags.append(bool(load_async))
        selection = select(answers, self._weights)
        self.selections.record(selection)
        if isinstance(selection, Pending):
            return None, False
        if isinstance(selection, Chosen):
            self._requests_to_connector[rid] = selection.index
            return selection.tokens, flags[selection.index]
        return 0, False

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        index = self._requests_to_connector.get(request.request_id)
        if index is None:  # vLLM asks after a positive answer only; be total anyway
            return KVConnectorBase_V1.get_loaded_kv_cache_group_ids(self, request)
        return self._connectors[index].get_loaded_kv_cache_group_ids(request)

    # --------------------------------------------------------------- stats

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        found = WeightedMultiStats()
        for spec, connector in zip(self.specs, self._connectors, strict=True):
            stats = connector.get_kv_connector_stats()
            if stats is not None:
                found.put(spec.name, class_path(type(connector)), stats)
        return found if found.data else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        """Rebuild :class:`WeightedMultiStats` from its ``to_dict()`` payload (values may also
        be stats objects still, in the process that made them)."""
        found = WeightedMultiStats()
        for name, entry in (data or {}).items():
            if not isinstance(entry, Mapping) or set(entry) != {"connector", "stats"}:
                raise HybridKVConfigError(
                    f"kv_connector_stats[{name!r}]",
                    entry,
                    'is not a WeightedMultiStats entry {"connector": ..., "stats": ...}',
                    "pass WeightedMultiStats.to_dict()'s output",
                )
            stats = entry["stats"]
            if not isinstance(stats, KVConnectorStats):
                # A copy: some children's stats wrap the dict they are given and aggregate into
                # it in place (vLLM's OffloadingConnectorStats), which would rewrite the payload.
                child_cls = load_class(entry["connector"])
                stats = child_cls.build_kv_connector_stats(data=copy.deepcopy(stats))
            if stats is not None:
                found.put(name, entry["connector"], stats)
        return found

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        by_class: dict[str, KVConnectorPromMetrics] = {}
        for child_cls, child_config in cls._get_connector_classes_and_configs(vllm_config):
            path = class_path(child_cls)
            if path in by_class:
                continue
            prom = child_cls.build_prom_metrics(
                child_config, metric_types, labelnames, per_engine_labelvalues
            )
            if prom is not None:
                by_class[path] = prom
        return WeightedMultiPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues, by_class
        )
