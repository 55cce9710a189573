"""The vLLM side: vLLM 0.33's own ``Scheduler``, built as its engine core builds it, driven by a
trace through a scripted ``SupportsHMA`` connector.

Building (:func:`build_engine`), once per layout and engine settings:

1. ``VllmConfig`` from the layout's config.json (written here; no hub, no weights), a
   ``CacheConfig`` with prefix caching and ``num_gpu_blocks_override``, a ``SchedulerConfig``
   with chunked prefill, no async scheduling, and a ``KVTransferConfig`` naming
   :class:`TraceHMAConnector` through ``kv_connector_module_path`` (so HMA stays on).
2. The model class built on the meta device by vLLM's loader (``initialize_model``), so every
   layer registers itself; ``current_platform.update_block_size_for_backend`` (what the
   executors call after loading).
3. The GPU model runner's per-layer specs (``attn_utils.get_kv_cache_spec``) and
   ``EngineCore._initialize_kv_caches`` itself, with a stand-in executor reporting those specs.
4. ``resolve_kv_cache_block_sizes`` and ``Scheduler(...)`` as ``EngineCore.__init__`` calls
   them (``v1/engine/core.py:160-187``), and the request block hasher of ``core.py:220-230``.

Driving (:class:`VllmSide`): ``schedule()``; a fabricated ``ModelRunnerOutput`` (one sampled
token for every request whose prefill is complete, the worker's ``KVConnectorOutput`` every
step, as the runner sends it even for empty steps); ``update_from_output()``. Aborts go through
``finish_requests(..., FINISHED_ABORTED)`` as the engine core's abort path does.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from _inprocess import init_distributed, plan_kv_caches
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from diffharness.layouts import RECIPES, Layout, LayoutRecipe
from diffharness.observe import (
    ClaimObs,
    Hook,
    HookCall,
    Phase,
    RecoveryObs,
    RequestObs,
    StepObservation,
)
from diffharness.trace import (
    ClaimMode,
    EngineSettings,
    KVReport,
    RequestScript,
    ScriptPlayer,
    Trace,
    TraceError,
    sample_token,
)

__all__ = ["BuiltEngine", "TraceHMAConnector", "VllmSide", "build_engine"]

# One warning per scheduler built ("KVConnectorBase_V1 ... experimental") would bury failures.
logging.getLogger("vllm").setLevel(logging.ERROR)

_STATUS = {
    RequestStatus.WAITING: "waiting",
    RequestStatus.WAITING_FOR_REMOTE_KVS: "waiting_for_remote_kvs",
    RequestStatus.RUNNING: "running",
    RequestStatus.PREEMPTED: "preempted",
    RequestStatus.FINISHED_STOPPED: "finished_stopped",
    RequestStatus.FINISHED_LENGTH_CAPPED: "finished_length",
    RequestStatus.FINISHED_ABORTED: "finished_aborted",
    RequestStatus.FINISHED_ERROR: "finished_error",
}


class _IdOrderSet(set[str]):
    """A set that iterates in id order.

    vLLM frees the requests named in ``finished_recving``/``finished_sending`` in the order it
    iterates those sets (``scheduler.py:3568-3581``); a worker's sets come in any order, so any
    order is valid input. The harness feeds the one the spec uses (sorted ids), so the two free
    queues stay comparable block id for block id.
    """

    def __iter__(self) -> Any:
        return iter(sorted(set.__iter__(self)))


def _tables(block_ids: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(b) for b in group) for group in block_ids)


class TraceHMAConnector(KVConnectorBase_V1, SupportsHMA):
    """A scheduler-side connector whose answers come from a trace (bound after construction,
    :meth:`bind`); it records every scheduler-side call as a
    :class:`~diffharness.observe.HookCall`. The worker-side methods are never called here."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.player: ScriptPlayer | None = None
        self.block_sizes = tuple(
            g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups
        )
        self.calls: list[HookCall] = []

    def bind(self, player: ScriptPlayer) -> None:
        """Answer from ``player`` from now on."""
        self.player = player

    def drain(self) -> tuple[HookCall, ...]:
        """The calls since the last drain."""
        calls, self.calls = tuple(self.calls), []
        return calls

    def _play(self) -> ScriptPlayer:
        if self.player is None:
            raise RuntimeError("TraceHMAConnector used before bind(player)")
        return self.player

    # ---------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> Any:
        mode, tokens = self._play().answer(
            request.request_id, num_computed_tokens, request.num_tokens
        )
        self.calls.append(
            HookCall(
                Hook.GET_NUM_NEW_MATCHED_TOKENS,
                request.request_id,
                (num_computed_tokens,),
                answer=(mode.value, tokens),
            )
        )
        if mode is ClaimMode.DEFER:
            return None, False
        return tokens, mode is ClaimMode.ASYNC and tokens > 0

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        tables = _tables(blocks.get_block_ids())
        self.calls.append(
            HookCall(
                Hook.UPDATE_STATE_AFTER_ALLOC,
                request.request_id,
                (num_external_tokens,),
                tables=tables,
            )
        )
        self._play().allocated(request.request_id, num_external_tokens, tables, self.block_sizes)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self.calls.append(
            HookCall(
                Hook.BUILD_CONNECTOR_META,
                None,
                (
                    tuple(scheduler_output.num_scheduled_tokens.items()),
                    tuple(sorted(scheduler_output.finished_req_ids)),
                    tuple(sorted(scheduler_output.preempted_req_ids or ())),
                ),
            )
        )
        return KVConnectorMetadata()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        recv = frozenset(connector_output.finished_recving or ())
        self.calls.append(
            HookCall(
                Hook.UPDATE_CONNECTOR_OUTPUT,
                None,
                (
                    tuple(sorted(recv)),
                    tuple(sorted(connector_output.failed_recving or ())),
                    tuple(sorted(connector_output.finished_sending or ())),
                ),
            )
        )
        self._play().saw_output(recv)

    def request_finished_all_groups(self, request: Request, block_ids: Any) -> Any:
        hold = self._play().finished(request.request_id)
        self.calls.append(
            HookCall(
                Hook.REQUEST_FINISHED_ALL_GROUPS,
                request.request_id,
                tables=_tables(block_ids),
                answer=(hold,),
            )
        )
        return hold, None

    def request_finished(self, request: Request, block_ids: Any) -> Any:
        raise AssertionError(
            "vLLM must call request_finished_all_groups on a SupportsHMA connector"
        )

    # ---------------------------------------------------------- worker side (unused)
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise AssertionError("worker-side hook called on the scheduler side")

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise AssertionError("worker-side hook called on the scheduler side")

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        raise AssertionError("worker-side hook called on the scheduler side")

    def wait_for_save(self) -> None:
        raise AssertionError("worker-side hook called on the scheduler side")


# ------------------------------------------------------------------ building


@functools.cache
def _process_setup() -> None:
    """Once per process: pin the host ISA answer and start vLLM's (one-rank) distributed state,
    which the model constructors read."""

    # vLLM reads the host ISA: with AVX-512 BF16 the SSM state goes float32 and the hybrid block
    # doubles. Pin "no", the platform spec.platforms calls "cpu".
    torch.cpu._is_avx512_bf16_supported = lambda: False
    init_distributed(21000)


@functools.cache
def _config_dir(layout: Layout) -> str:
    directory = Path(tempfile.mkdtemp(prefix=f"hybridkv-{layout.name.lower()}-"))
    (directory / "config.json").write_text(json.dumps(RECIPES[layout].config_json()))
    return str(directory)


class BuiltEngine:
    """What the engine core hands its scheduler: config, KV cache config, block sizes.

    ``kv_connector`` names an in-tree connector of vLLM's registry instead of
    :class:`TraceHMAConnector` (the default), to see what vLLM's configuration does with it; the
    hybrid KV cache manager is then whatever vLLM decides, and no scheduler should be built.
    """

    def __init__(
        self, recipe: LayoutRecipe, settings: EngineSettings, *, kv_connector: str | None = None
    ) -> None:

        _process_setup()
        directory = _config_dir(recipe.layout)
        max_model_len = (
            recipe.max_model_len if settings.max_model_len is None else settings.max_model_len
        )
        model_config = ModelConfig(
            model=directory,
            tokenizer=directory,
            skip_tokenizer_init=True,
            max_model_len=max_model_len,
            seed=0,
            enforce_eager=True,
        )
        cache_kwargs: dict[str, Any] = {
            "enable_prefix_caching": True,
            "num_gpu_blocks_override": settings.num_blocks,
            "prefix_cache_retention_interval": settings.retention_interval,
        }
        if recipe.block_size is not None:
            cache_kwargs["block_size"] = recipe.block_size
        vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(**cache_kwargs),
            scheduler_config=SchedulerConfig(
                max_model_len=max_model_len,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                max_num_seqs=settings.max_num_seqs,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
                async_scheduling=False,
                scheduler_reserve_full_isl=settings.reserve_full_sequence,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector=kv_connector or TraceHMAConnector.__name__,
                kv_connector_module_path=None if kv_connector else __name__,
                kv_role="kv_both",
                kv_load_failure_policy=settings.failure_policy.value,
            ),
        )
        if kv_connector is None and vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
            raise AssertionError("vLLM switched the hybrid KV cache manager off")
        kv_cache_config, block_size, hash_block_size = plan_kv_caches(vllm_config, 1 << 30)
        self.recipe = recipe
        self.settings = settings
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.block_size = block_size
        self.hash_block_size = hash_block_size

    def groups(self) -> tuple[tuple[str, int, int], ...]:
        """Each group as ``(spec class, block size, sliding window or 0)``."""
        return tuple(
            (
                type(g.kv_cache_spec).__name__,
                g.kv_cache_spec.block_size,
                getattr(g.kv_cache_spec, "sliding_window", None) or 0,
            )
            for g in self.kv_cache_config.kv_cache_groups
        )

    def new_scheduler(self) -> Scheduler:
        """A fresh scheduler, as ``EngineCore.__init__`` makes it (``core.py:176-187``)."""
        from vllm.v1.structured_output import StructuredOutputManager

        return Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=copy.deepcopy(self.kv_cache_config),
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=self.block_size,
            hash_block_size=self.hash_block_size,
            log_stats=True,
        )

    def request_block_hasher(self) -> Any:
        """The engine core's request block hasher (``core.py:220-230``)."""
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        return get_request_block_hasher(
            self.hash_block_size, hash_fn, self.vllm_config.num_hash_lookahead_tokens
        )


@functools.lru_cache(maxsize=64)
def build_engine(layout: Layout, settings: EngineSettings) -> BuiltEngine:
    """The engine parts for a layout and settings (built once, each trace gets a new scheduler)."""
    return BuiltEngine(RECIPES[layout], settings)


# ------------------------------------------------------------------ driving


class VllmSide:
    """vLLM's Scheduler and the scripted connector, one trace at a time."""

    def __init__(self, trace: Trace, *, name: str = "vllm") -> None:
        self.name = name
        self.trace = trace
        self.engine = build_engine(trace.layout, trace.settings)
        self.scheduler = self.engine.new_scheduler()
        connector = self.scheduler.connector
        if not isinstance(connector, TraceHMAConnector):
            raise AssertionError(f"vLLM built {type(connector).__name__}, not TraceHMAConnector")
        self.connector = connector
        self.player = ScriptPlayer(trace, self.engine.block_size)
        connector.bind(self.player)
        self.hasher = self.engine.request_block_hasher()
        self.requests: dict[str, Request] = {}
        self._output: Any = None
        self._runner_output: ModelRunnerOutput | None = None

    # ------------------------------------------------------------ driving
    def add(self, script: RequestScript) -> None:
        """Add a request of the trace (vLLM's ``Scheduler.add_request``)."""
        if script.request_id in self.requests:
            raise TraceError("request_id", script.request_id, "added twice", "use a new id")
        request = Request(
            request_id=script.request_id,
            prompt_token_ids=list(script.prompt),
            sampling_params=SamplingParams(max_tokens=script.max_tokens, ignore_eos=True),
            pooling_params=None,
            cache_salt=script.cache_salt,
            block_hasher=self.hasher,
        )
        self.requests[script.request_id] = request
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> None:
        """Abort a request (the engine core's ``finish_requests(..., FINISHED_ABORTED)``)."""
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def schedule(self) -> StepObservation:
        """``schedule()``, then the fabricated model runner's sampled tokens for this step."""
        output = self.scheduler.schedule()
        self._output = output
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            r = self.requests[rid]
            done = r.num_computed_tokens >= r.num_tokens
            sampled.append([sample_token(rid, r.num_output_tokens)] if done else [])
        self._runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        claims = _claims(tuple(self.connector.calls))  # _observe drains the calls
        return self._observe(Phase.SCHEDULE, output, claims, ())

    def update(self, report: KVReport) -> StepObservation:
        """``update_from_output()`` with the sampled tokens and the worker's report."""
        if self._output is None or self._runner_output is None:
            raise RuntimeError("update() before schedule()")
        failed_before = {
            rid: self.requests[rid].num_computed_tokens
            for rid in sorted(report.failed_recving)
            if self.requests[rid].status is RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        runner_output = replace(
            self._runner_output,
            kv_connector_output=KVConnectorOutput(
                finished_recving=_IdOrderSet(report.finished_recving),
                failed_recving=_IdOrderSet(report.failed_recving),
                finished_sending=_IdOrderSet(report.finished_sending),
                invalid_block_ids=set(report.invalid_block_ids),
            ),
        )
        self.scheduler.update_from_output(self._output, runner_output)
        recoveries = []
        for rid, before in failed_before.items():
            r = self.requests[rid]
            if r.status is RequestStatus.FINISHED_ERROR:
                recoveries.append(RecoveryObs(rid, before, "error", 0))
            else:
                recoveries.append(RecoveryObs(rid, before, "recompute", r.num_computed_tokens))
        return self._observe(Phase.UPDATE, None, (), tuple(recoveries))

    # ------------------------------------------------------------ observing
    def quiescent(self) -> bool:
        """Every request finished and freed, and no report is still to come."""
        done = all(r.is_finished() for r in self.requests.values())
        return done and not self.scheduler.requests and not self.player.pending()

    def _observe(
        self,
        phase: Phase,
        output: Any,
        claims: tuple[ClaimObs, ...],
        recoveries: tuple[RecoveryObs, ...],
    ) -> StepObservation:
        s = self.scheduler
        manager = s.kv_cache_manager
        tables = []
        for rid in sorted(self.requests):
            blocks = manager.get_block_ids(rid)
            if any(blocks):
                tables.append((rid, _tables(blocks)))
        return StepObservation(
            step=s.current_step,
            phase=phase,
            scheduled=tuple(output.num_scheduled_tokens.items()) if output else (),
            preempted=tuple(sorted(output.preempted_req_ids or ())) if output else (),
            finished_ids=tuple(sorted(output.finished_req_ids)) if output else (),
            requests=tuple(
                RequestObs(rid, _status(r), r.num_computed_tokens, r.num_output_tokens)
                for rid, r in sorted(self.requests.items())
            ),
            running=tuple(r.request_id for r in s.running),
            waiting=tuple(r.request_id for r in s.waiting),
            kv_holding=tuple(r.request_id for r in s.kv_holding_waiting),
            tables=tuple(tables),
            num_free_blocks=manager.block_pool.get_num_free_blocks(),
            hooks=self.connector.drain(),
            claims=claims,
            recoveries=recoveries,
        )


def _status(request: Request) -> str:
    status = _STATUS.get(request.status)
    if status is None:
        raise AssertionError(f"{request.request_id}: status {request.status} outside the model")
    return status


def _claims(hooks: tuple[HookCall, ...]) -> tuple[ClaimObs, ...]:
    """Admissions after an answer: each ask paired with the allocation that followed it."""
    asked: dict[str, HookCall] = {}
    found = []
    for call in hooks:
        rid = call.request_id
        if call.hook is Hook.GET_NUM_NEW_MATCHED_TOKENS and rid is not None:
            asked[rid] = call
        elif call.hook is Hook.UPDATE_STATE_AFTER_ALLOC and rid in asked:
            ask = asked.pop(rid)
            local = ask.args[0]
            claimed = ask.answer[1]
            accepted = call.args[0]
            assert isinstance(local, int)
            assert isinstance(claimed, int)
            assert isinstance(accepted, int)
            found.append(ClaimObs(rid, local, claimed, accepted))
    return tuple(found)
