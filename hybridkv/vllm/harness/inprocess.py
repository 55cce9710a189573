"""An in-process vLLM 0.33 engine on CPU: the real ``Scheduler`` with any KV connector, and a
stand-in model runner that drives the connector's worker side in the runner's hook order and
checks every KV slot and mamba state it reads against the content the request's tokens imply.

Built (:class:`InProcessEngine`) from a config.json, :class:`EngineSettings` and a
``KVTransferConfig`` (or none):

1. ``VllmConfig`` with prefix caching, chunked prefill, sync scheduling; vLLM's own planning
   (:func:`hybridkv.vllm.harness.planning.plan_kv_caches`) derives the KV-cache config and block
   sizes; HMA must stay on.
2. The adapter's ``configure`` (e.g. the host tier size) before ``Scheduler(...)``, which builds
   the connector's scheduler role as the engine core does.
3. The worker role: the same class built with ``KVConnectorRole.WORKER``; the CPU caches come from
   vLLM's own ``allocate_kv_cache`` in the resolved layout; the adapter's ``attach`` registers
   them (default: ``register_kv_caches`` then ``set_host_xfer_buffer_ops``, as
   ``v1/worker/gpu/kv_connector.py`` does).

Tensor parallel (``EngineSettings.tensor_parallel_size`` > 1), simulated in this one process:
vLLM plans each rank's shard (:func:`hybridkv.vllm.harness.planning.plan_tensor_parallel`: each
rank's model built on the meta device while the one-rank TP group reads as that rank) and hands each
rank its ``KVCacheConfig``; each rank gets its own caches from ``allocate_kv_cache``, its own
worker-role connector and adapter, and its own copy of each step's metadata (the executor
pickles it to each worker); the forward writes and checks every rank's caches, with rank-salted
tags; the ranks' ``KVConnectorOutput`` are combined by vLLM's own ``KVOutputAggregator``
(``world_size`` expected, as ``Executor.init_kv_output_aggregator`` builds it) before
``update_from_output``. What is not real: no second process, no collective, no model.
Each rank's worker gets the engine's ``VllmConfig`` with ``parallel_config.rank`` set to its own
rank, as vLLM's worker does. ``EngineSettings.replicated_kv`` simulates an MLA model's
replicated cache on these layouts: every rank's ``KVCacheConfig`` gets ``kv_tp_replicas`` =
the TP size (what vLLM's planner computes when every layer is MLA,
``kv_cache_groups_tp_replicas``) and every rank writes the same tags, as replicas hold the same
KV.

Each step (:meth:`InProcessEngine.step`) mirrors ``EngineCore.step``: ``schedule()``; the
stand-in runner (``handle_preemptions``, ``bind_connector_metadata``, ``start_load_kv`` before the
forward for sync loads, the forward with ``wait_for_layer_load``/``save_kv_layer`` around each
attention layer only, ``start_load_kv`` after it otherwise, ``wait_for_save``,
``get_transfer_results``, ``get_block_ids_with_load_errors``, stats, events, worker meta,
``clear_connector_metadata``); ``update_from_output()`` with the sampled tokens and that
``KVConnectorOutput``. With ``EngineSettings.speculative_hooks`` a step that runs the model
follows the speculative-decoding order instead (``defer_finalize``,
``v1/worker/kv_connector_model_runner_mixin.py:83-107``, ``gpu_model_runner.py:4145, 4471-4475``):
target forward, ``start_load_kv``, ``get_transfer_results`` and the rest of the output, the
drafter's layer written, then ``wait_for_save`` and ``clear_connector_metadata``; a step with
nothing scheduled keeps the plain order (``kv_connector_no_forward`` never defers).

The forward (:mod:`hybridkv.vllm.harness.content`): a mamba layer copies the state of block
``(c0 - 1) // block`` to ``cdiv(c1, block) - 1`` as ``preprocess_mamba`` does, checks it holds
the prefix ``[:c0]`` and writes the prefix ``[:c1]``, and, for a spec with prefill checkpoint
blocks, writes the prefix ``[:p]`` into the column vLLM's ``compute_mamba_prefill_checkpoints``
names (the backend's checkpoint export); an attention layer writes the tags of ``[c0, c1)`` and
checks the positions ``[lo, c0)`` it attends (``lo`` = 0, or the window's start). With
``EngineSettings.speculative`` only the scheduler side of speculative decoding runs: the runner
proposes no draft tokens.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import random
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from hybridkv.vllm.harness.content import LayerTags, layer_tags, prefix_tags
from hybridkv.vllm.harness.planning import init_distributed, plan_kv_caches, plan_tensor_parallel

__all__ = [
    "ChatTrace",
    "EngineSettings",
    "InProcessEngine",
    "InProcessReport",
    "WedgedError",
    "WorkerAdapter",
    "run_trace",
]

logging.getLogger("vllm").setLevel(logging.ERROR)

_SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "get_external_cache_hit_sources",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "on_new_request",
    "take_events",
    "has_pending_push_work",
    "has_pending_block_frees",
    "get_kv_connector_stats",
    "get_loaded_kv_cache_group_ids",
    "register_finished_partial_tail",
)


class WedgedError(RuntimeError):
    """The run did not finish within ``max_steps`` engine steps."""


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The engine's knobs.

    Attributes:
        num_gpu_blocks: the GPU pool (``num_gpu_blocks_override``).
        max_model_len: ``--max-model-len``.
        block_size: ``--block-size`` (``None``: the platform's choice).
        max_num_seqs / max_num_batched_tokens: the scheduler's limits (chunked prefill).
        max_steps: the wedge guard.
        tensor_parallel_size: ranks simulated in this process (module docstring).
        device: where ``allocate_kv_cache`` puts the caches (``"cuda"``: the connector's
            worker picks its CUDA transfer engine; tests/gpu).
        max_loras: > 0 turns LoRA on (``LoRAConfig(max_loras=...)``) so requests may name an
            adapter (:meth:`InProcessEngine.add`); no adapter weights are loaded.
        kv_events: turn vLLM's KV cache events on (``KVEventsConfig``, the null publisher):
            the scheduler then drains the block pool's and the connector's ``take_events``.
        replicated_kv: under tensor parallel, simulate KV replicated on every rank (module
            docstring).
        model_name: names the model's directory (vLLM's ``model``, with a digest of the
            config.json): engines of equal names and configs serve the same model path, like
            two replicas; another name is another model of the same geometry.
        speculative: ``SpeculativeConfig`` fields (e.g. ``{"method": "mtp",
            "num_speculative_tokens": 1}``; the target model is the draft's ``model``): the
            scheduler side of speculative decoding (EAGLE's block drop, speculative mamba
            blocks). The stand-in runner proposes no draft tokens, so every step schedules the
            request's real tokens only.
        prefix_match_unit: ``--prefix-match-unit`` (the hash block, below the block size: vLLM's
            partial hash hits and its ``cache_hit_alignment_tokens``).
        speculative_hooks: follow the runner's hook order under speculative decoding (module
            docstring): the model's last attention layer stands in for the drafter's layer
            (an EAGLE head shares its group's block table); the target forward writes every
            other layer, ``get_transfer_results`` runs, then the "drafter" writes that layer's
            KV of the step's tokens, then ``wait_for_save``. No draft tokens are proposed:
            only the order of the writes and the hooks is the runner's.
    """

    num_gpu_blocks: int
    max_model_len: int
    block_size: int | None = None
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 256
    max_steps: int = 5000
    tensor_parallel_size: int = 1
    device: str = "cpu"
    max_loras: int = 0
    kv_events: bool = False
    replicated_kv: bool = False
    model_name: str = "model"
    speculative: dict[str, Any] | None = None
    prefix_match_unit: int | None = None
    speculative_hooks: bool = False


@dataclass(frozen=True, slots=True)
class ChatTrace:
    """Multi-turn chat: ``convs`` conversations of ``turns`` turns sharing a system prompt.

    Turn ``t + 1``'s prompt is turn ``t``'s prompt, its output and new user tokens; it arrives
    ``think`` steps after turn ``t`` finished (closed loop); conversation ``c`` starts at step
    ``c * stagger``. Tokens come from ``random.Random(seed)``.
    """

    convs: int = 4
    turns: int = 3
    system_len: int = 128
    user_min: int = 40
    user_max: int = 80
    output_len: int = 4
    think: int = 2
    stagger: int = 2
    seed: int = 1234

    def system(self) -> list[int]:
        rng = random.Random(self.seed)
        return [rng.randint(3, 999) for _ in range(self.system_len)]

    def user(self, conv: int, turn: int) -> list[int]:
        rng = random.Random(self.seed * 7919 + conv * 101 + turn + 1)
        return [rng.randint(3, 999) for _ in range(rng.randint(self.user_min, self.user_max))]


@dataclass(frozen=True, slots=True)
class InProcessReport:
    """What a run observed. Token figures count prompt positions only.

    Attributes:
        connector: the connector class name (``""`` without one).
        requests / finished: requests added and finished.
        steps: engine steps executed (idle think-time ticks not counted).
        prompt_tokens: prompt tokens of all requests.
        prefill_computed: prompt positions the scheduler scheduled (recompute included).
        external_loaded: the ``num_external_tokens > 0`` vLLM handed ``update_state_after_alloc``.
        gpu_prefix_hits / external_hits: vLLM's ``PrefillStats`` (local / external cached).
        preemptions: requests preempted.
        slots_checked / wrong_reads: KV slots and mamba states the forward checked, and those
            holding other content (a wrong load or a wrong reuse).
        schedule_us / connector_us: mean per step of ``schedule() + update_from_output()`` and of
            the scheduler-side connector calls inside them (wall clock).
        schedule_cpu_us / connector_cpu_us: the same spans in the calling thread's CPU time
            (``time.thread_time``): what the calls cost, without the time the thread waited
            for a core. On a shared machine the wall clock charges a call for every other job
            that held the core meanwhile, so the two connectors' wall figures are compared
            under whatever load each run met; their CPU figures are not.
        leaked_blocks: GPU blocks not back in vLLM's free pool after everything finished.
        transfers: the worker adapters' counters (e.g. jobs and bytes moved), summed over ranks.
        failed_loads: requests vLLM got in ``failed_recving`` (after aggregation over ranks).

    The engine also keeps every ``SchedulerStats.kv_connector_stats`` payload vLLM produced
    (``InProcessEngine.connector_stats``: the workers' stats aggregated, then the scheduler's).
    """

    connector: str
    requests: int
    finished: int
    steps: int
    prompt_tokens: int
    prefill_computed: int
    external_loaded: int
    gpu_prefix_hits: int
    external_hits: int
    preemptions: int
    slots_checked: int
    wrong_reads: int
    schedule_us: float
    connector_us: float
    leaked_blocks: int
    schedule_cpu_us: float = 0.0
    connector_cpu_us: float = 0.0
    transfers: dict[str, int] = field(default_factory=dict)
    failed_loads: int = 0

    @property
    def connector_share(self) -> float:
        """The scheduler-side connector's share of the scheduler's time."""
        return self.connector_us / self.schedule_us if self.schedule_us else 0.0

    @property
    def connector_cpu_share(self) -> float:
        """The same share in CPU time (see ``connector_cpu_us``)."""
        return self.connector_cpu_us / self.schedule_cpu_us if self.schedule_cpu_us else 0.0


class WorkerAdapter(Protocol):
    """How a connector's worker side is set up on CPU tensors."""

    def configure(self, vllm_config: Any, kv_cache_config: Any) -> None: ...

    def attach(self, connector: Any, kv_caches: dict[str, torch.Tensor]) -> None: ...

    def pending(self) -> int: ...

    def stats(self) -> dict[str, int]: ...


class RegisterCaches:
    """The runner's own registration: ``register_kv_caches`` then ``set_host_xfer_buffer_ops``."""

    def configure(self, vllm_config: Any, kv_cache_config: Any) -> None:
        """Nothing to size: the connector reads its settings from the KVTransferConfig as is."""

    def attach(self, connector: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks

        connector.register_kv_caches(kv_caches)
        connector.set_host_xfer_buffer_ops(copy_kv_blocks)

    def pending(self) -> int:
        return 0

    def stats(self) -> dict[str, int]:
        return {}


# ------------------------------------------------------------------ building


def _adapters(
    adapter: WorkerAdapter | Sequence[WorkerAdapter] | None, world: int
) -> list[WorkerAdapter]:
    """One adapter per rank: a sequence of ``world`` under tensor parallel, else one."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size={world}: at least 1")
    if adapter is None:
        return [RegisterCaches() for _ in range(world)]
    found = list(adapter) if isinstance(adapter, Sequence) else [adapter]
    if len(found) != world:
        raise ValueError(
            f"adapter: {len(found)} given for tensor_parallel_size={world}; pass one per rank"
        )
    return found


@functools.cache
def _process_setup() -> None:
    # With AVX-512 BF16 vLLM makes the SSM state float32 and the hybrid block doubles: pin "no"
    # so the geometry does not depend on the host CPU.
    torch.cpu._is_avx512_bf16_supported = lambda: False  # type: ignore[attr-defined]
    init_distributed(23000)


def _config_dir(config_json: dict[str, Any], name: str) -> str:
    """The model directory ``name`` + a digest of the config: equal for equal arguments (the
    remote tier keys chunks by the model path, so two replicas must serve the same one)."""
    text = json.dumps(config_json, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    directory = (
        Path(tempfile.gettempdir()) / f"hybridkv-inprocess-{os.getuid()}" / (f"{name}-{digest}")
    )
    target = directory / "config.json"
    if not target.exists():
        directory.mkdir(parents=True, exist_ok=True)
        # Written whole, then renamed: a process building the same engine never reads half.
        fd, partial = tempfile.mkstemp(dir=directory, suffix=".json")
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(partial, target)
    return str(directory)


def _vllm_config(config_json: dict[str, Any], settings: EngineSettings, kv_transfer: Any) -> Any:
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig

    directory = _config_dir(config_json, settings.model_name)
    cache: dict[str, Any] = {
        "enable_prefix_caching": True,
        "num_gpu_blocks_override": settings.num_gpu_blocks,
    }
    if settings.block_size is not None:
        cache["block_size"] = settings.block_size
    if settings.prefix_match_unit is not None:
        cache["prefix_match_unit"] = settings.prefix_match_unit
    model_config = ModelConfig(
        model=directory,
        tokenizer=directory,
        skip_tokenizer_init=True,
        max_model_len=settings.max_model_len,
        seed=0,
        enforce_eager=True,
    )
    parallel_config = ParallelConfig(tensor_parallel_size=settings.tensor_parallel_size)
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(**cache),
        scheduler_config=SchedulerConfig(
            max_model_len=settings.max_model_len,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_num_seqs=settings.max_num_seqs,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=False,
        ),
        parallel_config=parallel_config,
        speculative_config=_speculative_config(settings.speculative, model_config, parallel_config),
        kv_transfer_config=copy.deepcopy(kv_transfer),
        lora_config=_lora_config(settings.max_loras),
        kv_events_config=_kv_events_config(settings.kv_events),
    )
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        raise ValueError(
            f"kv_transfer_config={kv_transfer!r}: vLLM switched the hybrid KV cache manager off "
            "(the connector class must subclass SupportsHMA)"
        )
    return vllm_config


def _speculative_config(fields: dict[str, Any] | None, model: Any, parallel: Any) -> Any:
    if fields is None:
        return None
    from vllm.config import SpeculativeConfig

    return SpeculativeConfig(
        **{"model": model.model, **fields},
        target_model_config=model,
        target_parallel_config=parallel,
    )


def _lora_config(max_loras: int) -> Any:
    if max_loras <= 0:
        return None
    from vllm.config import LoRAConfig

    return LoRAConfig(max_loras=max_loras)


def _kv_events_config(enabled: bool) -> Any:
    from vllm.config import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=enabled, publisher="null")


def _checkpoint_settings(
    vllm_config: Any, kv_cache_config: Any, block_size: int, hash_block_size: int
) -> tuple[int, bool]:
    """``(cache_hit_alignment_tokens, drop_eagle_block)`` as the worker's
    ``MambaPrefillCheckpointBuilder`` reads them (vLLM's own resolution of the first)."""
    from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens

    alignment = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, block_size, hash_block_size
    )
    spec = vllm_config.speculative_config
    drop = (
        spec is not None
        and spec.use_eagle_block_drop()
        and not vllm_config.num_hash_lookahead_tokens
    )
    return alignment, bool(drop)


class _ConnectorClock:
    """Times the scheduler-side connector calls (outermost call only) and sums the external
    tokens vLLM hands ``update_state_after_alloc``."""

    def __init__(self, connector: Any):
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.external = 0
        self._depth = 0
        for name in _SCHEDULER_HOOKS:
            method = getattr(connector, name, None)
            if callable(method):
                setattr(connector, name, self._wrap(name, method))

    def _wrap(self, name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if name == "update_state_after_alloc":
                external = args[2] if len(args) > 2 else kwargs["num_external_tokens"]
                self.external += max(0, external)
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            # The CPU span nests inside the wall span, so CPU time <= wall time per call.
            start = time.perf_counter()
            start_cpu = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.cpu_seconds += time.thread_time() - start_cpu
                self.seconds += time.perf_counter() - start
                self._depth -= 1

        return timed


@dataclass(slots=True)
class _Tally:
    steps: int = 0
    prompt_tokens: int = 0
    prefill_computed: int = 0
    gpu_hits: int = 0
    external_hits: int = 0
    preemptions: int = 0
    checked: int = 0
    wrong: int = 0
    wrong_by: dict[str, int] = field(default_factory=dict)  # per request, where any
    schedule_s: float = 0.0
    connector_s: float = 0.0
    schedule_cpu_s: float = 0.0
    connector_cpu_s: float = 0.0
    failed_loads: int = 0


@dataclass(slots=True)
class _Rank:
    """One tensor-parallel rank: its KV cache config, caches, layer tags, adapter and worker."""

    rank: int
    kv_cache_config: Any
    kv_caches: dict[str, torch.Tensor]
    adapter: WorkerAdapter
    layers: list[tuple[int, LayerTags, Any]] = field(default_factory=list)
    worker: Any = None


class InProcessEngine:
    """vLLM's Scheduler, a connector's two roles and the stand-in runner (module docstring)."""

    def __init__(
        self,
        config_json: dict[str, Any],
        settings: EngineSettings,
        kv_transfer_config: Any = None,
        adapter: WorkerAdapter | Sequence[WorkerAdapter] | None = None,
    ) -> None:
        """``adapter``: one per rank under tensor parallel (a sequence), else one."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        _process_setup()
        self.settings = settings
        world = settings.tensor_parallel_size
        adapters = _adapters(adapter, world)
        if world == 1:
            self.vllm_config = _vllm_config(config_json, settings, kv_transfer_config)
            kv_cache_config, block_size, hash_block_size = plan_kv_caches(self.vllm_config, 1 << 30)
            rank_configs = [kv_cache_config]
        else:
            self.vllm_config, kv_cache_config, rank_configs, block_size, hash_block_size = (
                plan_tensor_parallel(
                    lambda: _vllm_config(config_json, settings, kv_transfer_config), 1 << 30
                )
            )
        if settings.replicated_kv and world > 1:
            for config in (kv_cache_config, *rank_configs):
                config.kv_tp_replicas = world
        self.kv_cache_config = kv_cache_config
        self.block_size, self.hash_block_size = block_size, hash_block_size
        self._cache_hit_alignment, self._drop_eagle_block = _checkpoint_settings(
            self.vllm_config, kv_cache_config, block_size, hash_block_size
        )
        self.adapter: WorkerAdapter = adapters[0]
        if kv_transfer_config is not None:
            self.adapter.configure(self.vllm_config, kv_cache_config)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=copy.deepcopy(kv_cache_config),
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size,
            hash_block_size=hash_block_size,
            log_stats=True,
        )
        layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
        self.ranks = [
            _Rank(
                r,
                config,
                allocate_kv_cache(config, torch.device(settings.device), layout),
                adapters[r],
            )
            for r, config in enumerate(rank_configs)
        ]
        self.kv_caches = self.ranks[0].kv_caches
        self.clock: _ConnectorClock | None = None
        self._aggregator: Any = None
        if self.scheduler.connector is not None:
            self.clock = _ConnectorClock(self.scheduler.connector)
            for rank in self.ranks:
                rank.worker = type(self.scheduler.connector)(
                    self._rank_config(rank.rank),
                    KVConnectorRole.WORKER,
                    copy.deepcopy(rank.kv_cache_config),
                )
                rank.adapter.attach(rank.worker, rank.kv_caches)
            if world > 1:
                from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

                self._aggregator = KVOutputAggregator.from_connector(self.ranks[0].worker, world)
        self.worker: Any = self.ranks[0].worker
        for rank in self.ranks:
            rank.layers = self._layer_tags(rank)
        self._layers = self.ranks[0].layers
        # The stand-in drafter's layer (EngineSettings.speculative_hooks): the last attention layer.
        attention = [tags.name for _, tags, _ in self._layers if not tags.is_mamba]
        self._draft_layer = attention[-1] if settings.speculative_hooks and attention else None
        self._draft_spans: list[tuple[str, int, int]] = []
        self._draft_tables: dict[str, Any] = {}
        self._hasher = self._block_hasher()
        self.free_at_start = self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        self.requests: dict[str, Any] = {}
        self._hashes: dict[str, list[int]] = {}
        self._state_idx: dict[str, int] = {}
        self.tally = _Tally()
        self.connector_stats: list[dict[str, Any]] = []

    # ------------------------------------------------------------ set-up helpers
    def _rank_config(self, rank: int) -> Any:
        """The engine's ``VllmConfig`` as worker ``rank`` sees it (its own parallel rank)."""
        if rank == 0:
            return self.vllm_config
        config = copy.copy(self.vllm_config)
        config.parallel_config = copy.copy(config.parallel_config)
        config.parallel_config.rank = rank
        return config

    def _layer_tags(self, rank: _Rank) -> list[tuple[int, LayerTags, Any]]:
        """(group, tags, spec) per layer of ``rank``, in model order (vLLM's layer index)."""
        from vllm.v1.kv_cache_interface import MambaSpec

        found = []
        for gid, group in enumerate(rank.kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            for name in group.layer_names:
                index = int(name.split("layers.")[1].split(".")[0])
                mamba = isinstance(spec, MambaSpec)
                salt = 0 if self.settings.replicated_kv else rank.rank  # replicas: same KV
                tags = layer_tags(name, index, mamba, rank.kv_caches[name], salt)
                found.append((gid, tags, spec))
        return sorted(found, key=lambda item: item[1].index)

    def _block_hasher(self) -> Any:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        return get_request_block_hasher(
            self.hash_block_size, hash_fn, self.vllm_config.num_hash_lookahead_tokens
        )

    # ------------------------------------------------------------ driving
    def make_request(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        *,
        cache_salt: str | None = None,
        lora_request: Any = None,
        mm_features: list[Any] | None = None,
    ) -> Any:
        """A vLLM ``Request`` hashed by this engine's block hasher, not added. ``cache_salt``,
        ``lora_request`` and ``mm_features`` reach the hasher as the engine's input processor
        passes them (the forward still tags content by token ids alone)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            mm_features=mm_features,
            lora_request=lora_request,
            cache_salt=cache_salt,
            block_hasher=self._hasher,
        )

    def add(self, request_id: str, prompt: list[int], max_tokens: int, **extra: Any) -> None:
        """Add a request (``Scheduler.add_request``); ``extra``: :meth:`make_request`'s."""
        request = self.make_request(request_id, prompt, max_tokens, **extra)
        self.requests[request_id] = request
        self._hashes[request_id] = []
        self.tally.prompt_tokens += len(prompt)
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> bool:
        """Abort a request as the engine core does when a client goes away
        (``Scheduler.finish_requests`` with ``FINISHED_ABORTED``); False if it had finished."""
        from vllm.v1.request import RequestStatus

        aborted = self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        self._state_idx.pop(request_id, None)
        return bool(aborted)

    def status(self, request_id: str) -> str:
        """The request's vLLM status name (e.g. ``WAITING_FOR_REMOTE_KVS``)."""
        return str(self.requests[request_id].status.name)

    def busy(self) -> bool:
        """vLLM's ``has_requests()`` (includes the connector's pending push work)."""
        return bool(self.scheduler.has_requests())

    def step(self) -> list[Any]:
        """One engine step; returns the request outputs ``update_from_output`` produced."""
        from vllm.v1.outputs import ModelRunnerOutput

        clock_before = self.clock.seconds if self.clock else 0.0
        cpu_before = self.clock.cpu_seconds if self.clock else 0.0
        start = time.perf_counter()
        start_cpu = time.thread_time()
        output = self.scheduler.schedule()
        scheduled_cpu = time.thread_time()
        scheduled = time.perf_counter()
        connector_output, sampled = self._run_model(output)
        req_ids = list(output.num_scheduled_tokens)
        if output.total_num_scheduled_tokens == 0:
            runner_output = ModelRunnerOutput.with_kv_conn_output_only(connector_output)
        else:
            runner_output = ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                sampled_token_ids=sampled,
                kv_connector_output=connector_output,
            )
        ran = time.perf_counter()
        ran_cpu = time.thread_time()
        outputs = self.scheduler.update_from_output(output, runner_output)
        done_cpu = time.thread_time()
        done = time.perf_counter()
        t = self.tally
        t.steps += 1
        t.schedule_s += (scheduled - start) + (done - ran)
        t.connector_s += (self.clock.seconds - clock_before) if self.clock else 0.0
        t.schedule_cpu_s += (scheduled_cpu - start_cpu) + (done_cpu - ran_cpu)
        t.connector_cpu_s += (self.clock.cpu_seconds - cpu_before) if self.clock else 0.0
        t.preemptions += len(output.preempted_req_ids or ())
        found = []
        for engine_outputs in outputs.values():
            stats_out = engine_outputs.scheduler_stats
            if stats_out is not None and stats_out.kv_connector_stats:
                self.connector_stats.append(stats_out.kv_connector_stats)
            for out in engine_outputs.outputs:
                stats = out.prefill_stats
                if stats is not None:
                    t.gpu_hits += stats.num_local_cached_tokens
                    t.external_hits += stats.num_external_cached_tokens
                found.append(out)
        return found

    # ------------------------------------------------------------ the stand-in runner
    def _run_model(self, output: Any) -> tuple[Any, list[list[int]]]:
        if self.worker is None:
            sampled = self._forward(output)
            self._draft()
            return None, sampled
        meta = output.kv_connector_metadata
        for rank in self.ranks:
            w = rank.worker
            # Each worker gets its own copy of the metadata, as the executor's pickling does.
            own = meta if len(self.ranks) == 1 else copy.deepcopy(meta)
            w.handle_preemptions(own)
            w.bind_connector_metadata(own)
            if output.has_sync_kv_loads:
                w.start_load_kv(None)
        sampled = self._forward(output)
        # The runner defers wait_for_save past the drafter only when the model ran.
        defer = self._draft_layer is not None and output.total_num_scheduled_tokens > 0
        outputs = [self._rank_output(rank.worker, output, defer) for rank in self.ranks]
        connector_output = outputs[0] if self._aggregator is None else self._aggregate(outputs)
        self.tally.failed_loads += len(connector_output.failed_recving or ())
        self._draft()
        if defer:  # finalize_kv_connector, after the drafter
            for rank in self.ranks:
                rank.worker.wait_for_save()
                rank.worker.clear_connector_metadata()
        return connector_output, sampled

    def _rank_output(self, w: Any, output: Any, defer: bool = False) -> Any:
        """One worker's hooks after the forward and its ``KVConnectorOutput``; ``defer``:
        ``wait_for_save`` and ``clear_connector_metadata`` are left for after the drafter."""
        from vllm.v1.outputs import KVConnectorOutput

        if not output.has_sync_kv_loads:
            w.start_load_kv(None)
        if not defer:
            w.wait_for_save()
        results = w.get_transfer_results(output.finished_req_ids)
        connector_output = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_stats=w.get_kv_connector_stats(),
            kv_cache_events=w.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        if not defer:
            w.clear_connector_metadata()
        return connector_output

    def _aggregate(self, outputs: list[Any]) -> Any:
        """vLLM's ``KVOutputAggregator`` over the ranks' outputs (rank 0's is the result)."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        runner_outputs = []
        for kv_output in outputs:
            # A fresh object per rank: the aggregator rewrites the chosen one's field.
            runner_output = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
            runner_output.kv_connector_output = kv_output
            runner_outputs.append(runner_output)
        return self._aggregator.aggregate(runner_outputs).kv_connector_output

    def _spans(self, output: Any) -> Iterator[tuple[str, int, int]]:
        for rid, n in output.num_scheduled_tokens.items():
            c1 = self.requests[rid].num_computed_tokens
            yield rid, c1 - n, c1

    def _forward(self, output: Any) -> list[list[int]]:
        spans = list(self._spans(output))
        tables = {}
        for rid, c0, c1 in spans:
            request = self.requests[rid]
            prefix_tags(request.all_token_ids, self._hashes[rid])
            tables[rid] = self.scheduler.kv_cache_manager.get_block_ids(rid)
            prompt = request.num_prompt_tokens
            self.tally.prefill_computed += max(0, min(c1, prompt) - c0)
        for rid in output.finished_req_ids:
            self._state_idx.pop(rid, None)
        for rid in output.preempted_req_ids or ():
            self._state_idx.pop(rid, None)
        self._mamba_precopy(spans, tables)
        self._draft_spans, self._draft_tables = spans, tables
        for rank in self.ranks:
            w = rank.worker
            for gid, tags, spec in rank.layers:
                if tags.name == self._draft_layer:
                    continue  # the drafter writes it (_draft)
                attention = not tags.is_mamba
                if attention and w is not None:
                    w.wait_for_layer_load(tags.name)
                for rid, c0, c1 in spans:
                    if tags.is_mamba:
                        self._mamba_layer(tags, tables[rid][gid], (rid, c0, c1), spec)
                    else:
                        self._attention_layer(tags, tables[rid][gid], (rid, c0, c1), spec)
                if attention and w is not None:
                    w.save_kv_layer(tags.name, rank.kv_caches[tags.name], None)
        sampled = []
        for rid, _c0, c1 in spans:
            request = self.requests[rid]
            done = c1 >= request.num_tokens
            sampled.append([3 + (self._hashes[rid][c1 - 1] % 997)] if done else [])
        return sampled

    def _draft(self) -> None:
        """The stand-in drafter (``EngineSettings.speculative_hooks``): writes and checks its
        layer's KV of the step's tokens, after the target forward; nothing without one."""
        spans, tables = self._draft_spans, self._draft_tables
        self._draft_spans, self._draft_tables = [], {}
        if self._draft_layer is None:
            return
        for rank in self.ranks:
            w = rank.worker
            for gid, tags, spec in rank.layers:
                if tags.name != self._draft_layer:
                    continue
                if w is not None:
                    w.wait_for_layer_load(tags.name)
                for rid, c0, c1 in spans:
                    self._attention_layer(tags, tables[rid][gid], (rid, c0, c1), spec)
                if w is not None:
                    w.save_kv_layer(tags.name, rank.kv_caches[tags.name], None)

    def _mamba_precopy(self, spans: list[tuple[str, int, int]], tables: dict[str, Any]) -> None:
        """``preprocess_mamba``: the running state moves to the last block before the forward
        (on every rank)."""
        for rank in self.ranks:
            for gid, tags, spec in rank.layers:
                if not tags.is_mamba:
                    continue
                size = spec.block_size
                for rid, c0, c1 in spans:
                    prev = self._state_idx.get(rid, (c0 - 1) // size) if c0 > 0 else -1
                    curr = -(-c1 // size) - 1
                    if prev not in (-1, curr):
                        table = tables[rid][gid]
                        tags.copy_state(table[prev], table[curr], rank.kv_caches[tags.name])
        for rid, _c0, c1 in spans:
            size = next((s.block_size for _, t, s in self._layers if t.is_mamba), 0)
            if size:
                self._state_idx[rid] = -(-c1 // size) - 1

    def _mamba_layer(
        self, tags: LayerTags, table: Any, span: tuple[str, int, int], spec: Any
    ) -> None:
        rid, c0, c1 = span
        size = spec.block_size
        block = torch.tensor([table[-(-c1 // size) - 1]])
        slot = torch.zeros(1, dtype=torch.long)
        hashes = self._hashes[rid]
        if c0 > 0:
            self._count(rid, tags.check(block, slot, tags.expected(hashes, range(c0 - 1, c0))))
        tags.write(block, slot, tags.expected(hashes, range(c1 - 1, c1)))
        self._mamba_checkpoint(tags, table, span, spec)

    def _mamba_checkpoint(
        self, tags: LayerTags, table: Any, span: tuple[str, int, int], spec: Any
    ) -> None:
        """The backend's prefill checkpoint export: the state after ``position`` tokens into
        the column vLLM's ``compute_mamba_prefill_checkpoints`` names, where it names one (the
        null block absorbs the export when the manager reserved no block there)."""
        if not spec.num_prefill_checkpoint_blocks:
            return
        from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints

        _rid, c0, c1 = span
        (offset,), (col,) = compute_mamba_prefill_checkpoints(
            [c1],
            [c1 - c0],
            hash_block_size=self.hash_block_size,
            mamba_block_size=spec.block_size,
            checkpoint_alignment=spec.prefill_checkpoint_alignment,
            drop_eagle_block=self._drop_eagle_block,
            cache_hit_alignment_tokens=self._cache_hit_alignment,
            num_hash_lookahead_tokens=self.vllm_config.num_hash_lookahead_tokens,
        )
        if col < 0 or not table[col]:
            return
        position = c0 + offset
        block = torch.tensor([table[col]])
        slot = torch.zeros(1, dtype=torch.long)
        tags.write(block, slot, tags.expected(self._hashes[_rid], range(position - 1, position)))

    def _attention_layer(
        self, tags: LayerTags, table: Any, span: tuple[str, int, int], spec: Any
    ) -> None:
        rid, c0, c1 = span
        size = spec.block_size
        hashes = self._hashes[rid]
        ids = torch.tensor(list(table), dtype=torch.long)
        new = torch.arange(c0, c1)
        tags.write(ids[new // size], new % size, tags.expected(hashes, range(c0, c1)))
        window = getattr(spec, "sliding_window", None)
        lo = 0 if not window else max(0, c0 - (window - 1))
        if lo < c0:
            old = torch.arange(lo, c0)
            self._count(
                rid, tags.check(ids[old // size], old % size, tags.expected(hashes, range(lo, c0)))
            )

    def _count(self, rid: str, counts: Any) -> None:
        self.tally.checked += counts.checked
        self.tally.wrong += counts.wrong
        if counts.wrong:
            self.tally.wrong_by[rid] = self.tally.wrong_by.get(rid, 0) + counts.wrong

    # ------------------------------------------------------------ end of run
    def close(self) -> None:
        """Shut both connector roles down, as the engine core does at exit
        (``Scheduler.shutdown``, the worker's ``shutdown``): a worker's copy thread otherwise
        outlives the engine and keeps its caches and host memory (about 35 MB per mamba + full
        engine), so a process that builds many engines runs out of memory."""
        self.scheduler.shutdown()
        for rank in self.ranks:
            if rank.worker is not None:
                rank.worker.shutdown()

    def leaked_blocks(self) -> int:
        """GPU blocks not back in vLLM's free pool (meaningful once every request finished)."""
        return self.free_at_start - self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def report(self, finished: int) -> InProcessReport:
        t = self.tally
        steps = max(1, t.steps)
        connector = self.scheduler.connector
        return InProcessReport(
            connector="" if connector is None else type(connector).__name__,
            requests=len(self.requests),
            finished=finished,
            steps=t.steps,
            prompt_tokens=t.prompt_tokens,
            prefill_computed=t.prefill_computed,
            external_loaded=self.clock.external if self.clock else 0,
            gpu_prefix_hits=t.gpu_hits,
            external_hits=t.external_hits,
            preemptions=t.preemptions,
            slots_checked=t.checked,
            wrong_reads=t.wrong,
            schedule_us=1e6 * t.schedule_s / steps,
            connector_us=1e6 * t.connector_s / steps,
            schedule_cpu_us=1e6 * t.schedule_cpu_s / steps,
            connector_cpu_us=1e6 * t.connector_cpu_s / steps,
            leaked_blocks=self.leaked_blocks(),
            transfers=self._transfers(),
            failed_loads=t.failed_loads,
        )

    def _transfers(self) -> dict[str, int]:
        summed: dict[str, int] = {}
        for rank in self.ranks:
            for name, value in rank.adapter.stats().items():
                summed[name] = summed.get(name, 0) + value
        return summed

    def pending(self) -> int:
        """Transfer jobs in flight on any rank."""
        return sum(rank.adapter.pending() for rank in self.ranks)


def run_trace(engine: InProcessEngine, trace: ChatTrace) -> InProcessReport:
    """Play ``trace`` closed-loop on ``engine`` until every turn finished and the connector has
    nothing in flight; :class:`WedgedError` after ``settings.max_steps`` steps."""
    system = trace.system()
    arrive: dict[int, int] = {c: c * trace.stagger for c in range(trace.convs)}
    turn = dict.fromkeys(range(trace.convs), 0)
    history: dict[int, list[int]] = {c: [] for c in range(trace.convs)}
    owner: dict[str, int] = {}
    finished = 0
    clock = 0
    while True:
        for conv, at in list(arrive.items()):
            if at <= clock:
                del arrive[conv]
                t = turn[conv]
                prompt = (history[conv] or system) + trace.user(conv, t)
                rid = f"c{conv}-t{t}"
                owner[rid] = conv
                history[conv] = prompt
                engine.add(rid, prompt, trace.output_len)
        clock += 1
        if not engine.busy():
            if not arrive:
                break
            continue
        if engine.tally.steps >= engine.settings.max_steps:
            raise WedgedError(
                f"max_steps={engine.settings.max_steps}: {finished} of "
                f"{len(engine.requests)} requests finished; raise max_steps or look for a "
                "request that never leaves WAITING_FOR_REMOTE_KVS"
            )
        for out in engine.step():
            if out.finish_reason is None:
                continue
            finished += 1
            conv = owner[out.request_id]
            history[conv] = list(engine.requests[out.request_id].all_token_ids)
            turn[conv] += 1
            if turn[conv] < trace.turns:
                arrive[conv] = clock + trace.think
    if engine.pending():
        raise WedgedError(f"{engine.pending()} transfer jobs still in flight at the end")
    return engine.report(finished)
