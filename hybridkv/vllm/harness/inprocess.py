"""An in-process vLLM 0.33 engine on CPU: the real ``Scheduler`` with any KV connector, and a
stand-in model runner that drives the connector's worker side in the runner's hook order and
checks every KV slot and mamba state it reads against the content the request's tokens imply.

Built (:class:`InProcessEngine`) from a config.json, :class:`~.engine_config.EngineSettings` and a
``KVTransferConfig`` (or none):

1. ``VllmConfig`` with prefix caching, chunked prefill, async or sync scheduling; vLLM's own
   planning (:func:`hybridkv.vllm.harness.planning.plan_kv_caches`) derives the KV-cache config
   and block sizes; HMA must stay on.
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

Each step (:meth:`InProcessEngine.step`) is one turn of vLLM's own engine loop
(:mod:`hybridkv.vllm.harness.engine_loop`): ``EngineCore.step`` under sync scheduling,
``EngineCore.step_with_batch_queue`` under async scheduling (step N+1 scheduled and run before
step N's output is applied). Each scheduled step runs ``schedule()``; the stand-in runner
(``handle_preemptions``, ``bind_connector_metadata``, ``start_load_kv`` before the forward
for sync loads, the forward with ``wait_for_layer_load``/``save_kv_layer`` around each
attention layer only, ``start_load_kv`` after it otherwise, ``wait_for_save``,
``get_transfer_results``, ``get_block_ids_with_load_errors``, stats, events, worker meta,
``clear_connector_metadata``); ``update_from_output()`` with the sampled tokens and that
``KVConnectorOutput``. With ``EngineSettings.speculative_hooks`` a step that runs the model
follows the speculative-decoding order instead (``defer_finalize``,
``v1/worker/kv_connector_model_runner_mixin.py:83-107``, ``gpu_model_runner.py:4145, 4471-4475``):
target forward, ``start_load_kv``, ``get_transfer_results`` and the rest of the output, the
drafter's layer written, then ``wait_for_save`` and ``clear_connector_metadata``; a step with
nothing scheduled keeps the plain order (``kv_connector_no_forward`` never defers).

The forward (:mod:`hybridkv.vllm.harness.forward`) writes every layer's KV of the step's
tokens and checks what each layer reads. The settings and the ``VllmConfig`` are in
:mod:`hybridkv.vllm.harness.engine_config`, the report in
:mod:`hybridkv.vllm.harness.report`, the chat trace that most runs play in
:mod:`hybridkv.vllm.harness.chat`.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hybridkv.vllm.harness.content import LayerTags, layer_tags
from hybridkv.vllm.harness.engine_config import (
    EngineSettings,
    _checkpoint_settings,
    _process_setup,
    _vllm_config,
)
from hybridkv.vllm.harness.engine_loop import EngineLoop, StandInExecutor, build_engine_core
from hybridkv.vllm.harness.forward import StandInForward
from hybridkv.vllm.harness.planning import plan_kv_caches, plan_tensor_parallel
from hybridkv.vllm.harness.report import ConnectorClock, InProcessReport, Tally

__all__ = ["InProcessEngine", "RegisterCaches", "WorkerAdapter"]

logging.getLogger("vllm").setLevel(logging.ERROR)


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


@dataclass(slots=True)
class _Rank:
    """One tensor-parallel rank: its KV cache config, caches, layer tags, adapter and worker."""

    rank: int
    kv_cache_config: Any
    kv_caches: dict[str, torch.Tensor]
    adapter: WorkerAdapter
    layers: list[tuple[int, LayerTags, Any]] = field(default_factory=list)
    worker: Any = None


class InProcessEngine(StandInForward):
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
        scheduler_cls = self.vllm_config.scheduler_config.get_scheduler_cls()
        self.scheduler = scheduler_cls(
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
        self.clock: ConnectorClock | None = None
        self._aggregator: Any = None
        if self.scheduler.connector is not None:
            self.clock = ConnectorClock(self.scheduler.connector)
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
        self._draft_spans, self._draft_tables = [], {}  # declared on StandInForward
        self._hasher = self._block_hasher()
        self.free_at_start = self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        self.requests: dict[str, Any] = {}
        self._hashes: dict[str, list[int]] = {}
        self._state_idx: dict[str, int] = {}
        self.tally = Tally()
        self.connector_stats: list[dict[str, Any]] = []
        self.loop = self._engine_loop()

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
        self._runner_tokens.pop(request_id, None)
        return bool(aborted)

    def status(self, request_id: str) -> str:
        """The request's vLLM status name (e.g. ``WAITING_FOR_REMOTE_KVS``)."""
        return str(self.requests[request_id].status.name)

    def busy(self) -> bool:
        """vLLM's ``has_requests()`` (includes the connector's pending push work), or a step
        in the batch queue whose output is not applied yet."""
        return self.loop.busy()

    def _engine_loop(self) -> EngineLoop:
        """vLLM's engine loop over this engine's scheduler (timed) and stand-in runner."""
        # The tokens the runner sampled, per request, until the scheduler applies them (under
        # async scheduling the next step computes one before it is applied).
        self._runner_tokens: dict[str, list[int]] = {}
        self._timed_scheduler()
        core = build_engine_core(self.vllm_config, self.scheduler, StandInExecutor(self._execute))
        return EngineLoop(core)

    def _timed_scheduler(self) -> None:
        """Time ``schedule`` and ``update_from_output`` where vLLM's loop calls them (the
        scheduler's own methods, wrapped on this instance only), and count preemptions."""
        scheduler, tally = self.scheduler, self.tally
        schedule, update = scheduler.schedule, scheduler.update_from_output

        def timed_schedule(*args: Any, **kwargs: Any) -> Any:
            start, start_cpu = time.perf_counter(), time.thread_time()
            output = schedule(*args, **kwargs)
            tally.schedule_s += time.perf_counter() - start
            tally.schedule_cpu_s += time.thread_time() - start_cpu
            tally.preemptions += len(output.preempted_req_ids or ())
            tally.schedules += 1
            return output

        def timed_update(*args: Any, **kwargs: Any) -> Any:
            start, start_cpu = time.perf_counter(), time.thread_time()
            outputs = update(*args, **kwargs)
            tally.schedule_s += time.perf_counter() - start
            tally.schedule_cpu_s += time.thread_time() - start_cpu
            return outputs

        scheduler.schedule = timed_schedule
        scheduler.update_from_output = timed_update

    def _execute(self, output: Any) -> Any:
        """The stand-in executor's step: the runner over ``output``, as a ``ModelRunnerOutput``."""
        from vllm.v1.outputs import ModelRunnerOutput

        connector_output, sampled = self._run_model(output)
        if output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.with_kv_conn_output_only(connector_output)
        req_ids = list(output.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=connector_output,
        )

    def step(self) -> list[Any]:
        """One turn of vLLM's engine loop; returns the request outputs it produced (none for a
        turn of the batch queue that only scheduled)."""
        clock_before = self.clock.seconds if self.clock else 0.0
        cpu_before = self.clock.cpu_seconds if self.clock else 0.0
        engine_outputs, _ran = self.loop.step()
        t = self.tally
        t.steps += 1
        t.connector_s += (self.clock.seconds - clock_before) if self.clock else 0.0
        t.connector_cpu_s += (self.clock.cpu_seconds - cpu_before) if self.clock else 0.0
        found = []
        for outputs in engine_outputs:
            stats_out = outputs.scheduler_stats
            if stats_out is not None and stats_out.kv_connector_stats:
                self.connector_stats.append(stats_out.kv_connector_stats)
            for out in outputs.outputs:
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
