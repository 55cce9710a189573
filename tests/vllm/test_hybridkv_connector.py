"""``hybridkv.vllm.HybridKVConnector`` built and driven by vLLM 0.33's own code (``nox -s vllm``).

- Built through vLLM's ``KVConnectorFactory`` from exactly the JSON of docs/howto/serve.md, both
  roles; registered by name on import of ``hybridkv.vllm``.
- Every ``kv_connector_extra_config`` key's bad value: one line naming the key; the non-HMA
  configuration refused at construction.
- End to end: vLLM's real ``Scheduler`` with the connector's scheduler side, the worker side
  in-process on CPU tensors in the model runner's hook order; a request stores and finishes, the
  GPU prefix cache is reset, a second request with the same prefix gets an external hit whose
  async load completes, and every loaded block's bytes equal the bytes its store read.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed (run `nox -s vllm`)"
)

import torch
import vllm
import vllm.platforms
from _inprocess import plan_kv_caches
from diffharness.layouts import RECIPES, Layout
from diffharness.vllm_side import _config_dir, _process_setup
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.platforms.interface import Platform, PlatformEnum
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

import hybridkv.vllm
from hybridkv.canonical import build_canonical_caches
from hybridkv.connector import RequestId, RequestView
from hybridkv.errors import HybridKVConfigError
from hybridkv.vllm.connector import HybridKVConnector
from hybridkv.vllm.metrics import SCHEDULER_COUNTERS, scheduler_mark
from hybridkv.vllm.versions import supported

pytestmark = pytest.mark.vllm

SERVE_DOC = Path(__file__).parents[2] / "docs" / "howto" / "serve.md"
NUM_BLOCKS = 64
BUDGET = 256


def _recipe_json() -> dict[str, Any]:
    """The ``--kv-transfer-config`` JSON of the how-to, exactly as written there."""
    match = re.search(r"--kv-transfer-config '(\{.*\})'", SERVE_DOC.read_text())
    assert match, f"{SERVE_DOC} has no --kv-transfer-config '...' line"
    return json.loads(match.group(1))


def _vllm_config(
    transfer: dict[str, Any], *, layout: Layout = Layout.MAMBA_FULL, **sched: Any
) -> Any:
    _process_setup()
    recipe = RECIPES[layout]
    directory = _config_dir(layout)
    cache: dict[str, Any] = {"enable_prefix_caching": True, "num_gpu_blocks_override": NUM_BLOCKS}
    if recipe.block_size is not None:
        cache["block_size"] = recipe.block_size
    return VllmConfig(
        model_config=ModelConfig(
            model=directory,
            tokenizer=directory,
            skip_tokenizer_init=True,
            max_model_len=recipe.max_model_len,
            seed=0,
            enforce_eager=True,
        ),
        cache_config=CacheConfig(**cache),
        scheduler_config=SchedulerConfig(
            max_model_len=recipe.max_model_len,
            max_num_batched_tokens=BUDGET,
            max_num_seqs=4,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=False,
            **sched,
        ),
        kv_transfer_config=KVTransferConfig(**transfer),
    )


def _with_extra(**extra: Any) -> dict[str, Any]:
    transfer = _recipe_json()
    transfer["kv_connector_extra_config"] = {**transfer["kv_connector_extra_config"], **extra}
    return transfer


# ------------------------------------------------------------------ construction


def test_registered_by_name_on_import_and_idempotently() -> None:
    hybridkv.vllm.register()
    hybridkv.vllm.register()
    config = KVTransferConfig(kv_connector="HybridKVConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(config) is HybridKVConnector


def test_the_docs_recipe_builds_both_roles_through_vllms_factory() -> None:
    transfer = _recipe_json()
    assert transfer["kv_connector"] == "HybridKVConnector"
    assert transfer["kv_connector_module_path"] == "hybridkv.vllm"
    config = _vllm_config(transfer)
    assert not config.scheduler_config.disable_hybrid_kv_cache_manager
    kv_cache_config, _, _ = plan_kv_caches(config, 1 << 30)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        connector = KVConnectorFactory.create_connector(config, role, kv_cache_config)
        assert isinstance(connector, HybridKVConnector)
        assert (connector.core is not None) == (role is KVConnectorRole.SCHEDULER)
        extra = transfer["kv_connector_extra_config"]
        assert connector.num_chunks == extra["host_memory_bytes"] // connector.layout.slot_bytes
        assert connector.hybridkv_config.eviction_policy == extra["eviction_policy"]


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("0.33.0", True),
        ("0.33.4", True),
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("0.34.0", False),
        ("0.31.2", False),
        ("1.0.0", False),
        ("unknown", False),
    ],
)
def test_supported_vllm_versions_are_0_32_and_0_33(version: str, ok: bool) -> None:
    assert supported(version) is ok


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_an_unsupported_vllm_is_refused_at_start_up_naming_version_and_fix(
    monkeypatch: pytest.MonkeyPatch, role: KVConnectorRole
) -> None:
    """A vLLM outside hybridkv.vllm.versions.SUPPORTED stops start-up (both roles) with the
    version and the fix, before any state is built (it might place loads wrongly)."""
    config = _vllm_config(_recipe_json())
    kv_cache_config, _, _ = plan_kv_caches(config, 1 << 30)
    monkeypatch.setattr(vllm, "__version__", "0.34.1")
    with pytest.raises(HybridKVConfigError) as refused:
        KVConnectorFactory.create_connector(config, role, kv_cache_config)
    assert refused.value.field == "vllm.__version__"
    assert refused.value.value == "0.34.1"
    assert "0.33.x" in str(refused.value)
    assert "vllm==0.33.*" in str(refused.value)


BAD_VALUES = [
    ("host_memory_bytes", 0),
    ("host_memory_bytes", "8GiB"),
    ("host_memory_bytes", 1),  # smaller than one slot: refused when sized
    ("chunk_size", 0),
    ("chunk_size", 3),  # not a multiple of the hash block: the planner refuses it
    ("chunk_size", True),
    ("eviction_policy", "fifo"),
    ("load_deadline_steps", 0),
    ("load_deadline_steps", -3),
    ("load_deadline_steps", True),
    ("load_deadline_steps", "8"),
    ("offload_decode_state", "yes"),
    ("gpu_scratch_bytes", -1),
    ("gpu_scratch_bytes", "64MiB"),
    ("sync_load_max_bytes", -1),
    ("sync_load_max_bytes", 4096),  # refused: test_sync_load_failures_vs_vllm.py says why
    ("no_such_key", 1),
]


@pytest.mark.parametrize(("key", "value"), BAD_VALUES)
def test_every_bad_extra_config_value_is_one_line_naming_the_key(key: str, value: Any) -> None:
    config = _vllm_config(_with_extra(**{key: value}))
    kv_cache_config, _, _ = plan_kv_caches(config, 1 << 30)
    with pytest.raises(HybridKVConfigError) as caught:
        KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    message = str(caught.value)
    assert "\n" not in message
    assert caught.value.field == f"kv_connector_extra_config.{key}"
    assert key in message
    assert repr(value) in message or str(value) in message


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_load_deadline_is_built_under_recompute_and_refused_under_fail(policy: str) -> None:
    transfer = {**_with_extra(load_deadline_steps=3), "kv_load_failure_policy": policy}
    config = _vllm_config(transfer)
    kv_cache_config, _, _ = plan_kv_caches(config, 1 << 30)
    if policy == "fail":  # an abandoned load would fail its request instead of recomputing it
        with pytest.raises(HybridKVConfigError) as caught:
            KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
        assert caught.value.field == "kv_connector_extra_config.load_deadline_steps"
        assert "\n" not in str(caught.value)
        assert "recompute" in str(caught.value)
        return
    scheduler = KVConnectorFactory.create_connector(
        config, KVConnectorRole.SCHEDULER, kv_cache_config
    )
    assert scheduler.hybridkv_config.load_deadline_steps == 3
    assert scheduler.deadlines is not None
    assert scheduler.deadlines.deadline_steps == 3
    assert scheduler._counters()["deadlines_fired"] == 0
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
    assert worker.deadlines is None  # the worker only stops what the metadata names


def test_stats_carry_what_moved_since_the_last_call_and_nothing_when_no_counter_moved() -> None:
    config = _vllm_config(_with_extra())
    kv_cache_config, _, _ = plan_kv_caches(config, 1 << 30)
    scheduler = KVConnectorFactory.create_connector(
        config, KVConnectorRole.SCHEDULER, kv_cache_config
    )
    zero = dict.fromkeys(SCHEDULER_COUNTERS, 0)
    assert scheduler.get_kv_connector_stats() is None  # nothing counted yet
    guard = scheduler._reclaim
    guard.deferred += 2  # two restarted requests answered DEFER in front of the core
    guard.overridden += 2
    stats = scheduler.get_kv_connector_stats()
    assert stats is not None
    assert stats.data == {**zero, "lookups": 2, "lookups_deferred": 2, "restarts_deferred": 2}
    assert scheduler.get_kv_connector_stats() is None  # read once: the next call has nothing
    # Hashing a request's chain moves a count of the core that no counter reads: no payload.
    core = scheduler.core
    unit = core.geometry.units[0]
    view = RequestView(RequestId("r"), tuple(range(2 * unit)), 2 * unit)
    assert core.chunk_members(view, unit)
    assert core.stats().hashes_computed > 0
    assert scheduler.get_kv_connector_stats() is None
    guard.whole += 1
    stats = scheduler.get_kv_connector_stats()
    assert stats is not None
    assert stats.data == {**zero, "restarts_whole": 1}
    # The hook's mark is laid out as metrics.scheduler_mark lays it out.
    scheduler._deadline_answers += 3  # three lookups answered 0 past a load deadline
    assert scheduler._stats_mark() == scheduler_mark(
        core, scheduler._agreement.count, guard, deadlines_fired=0, deadline_answers=3
    )
    stats = scheduler.get_kv_connector_stats()
    assert stats is not None
    assert stats.data == {**zero, "lookups": 3}
    assert scheduler._counters() == {  # the totals: the increments above summed
        **zero,
        "lookups": 5,
        "lookups_deferred": 2,
        "restarts_deferred": 2,
        "restarts_whole": 1,
    }


def test_a_hybrid_model_with_the_hybrid_manager_off_is_refused_at_construction() -> None:
    good = _vllm_config(_recipe_json())
    kv_cache_config, _, _ = plan_kv_caches(good, 1 << 30)
    off = copy.copy(good)
    off.scheduler_config = copy.copy(good.scheduler_config)
    off.scheduler_config.disable_hybrid_kv_cache_manager = True
    with pytest.raises(HybridKVConfigError) as caught:
        HybridKVConnector(off, KVConnectorRole.SCHEDULER, kv_cache_config)
    assert caught.value.field == "disable_hybrid_kv_cache_manager"
    assert "\n" not in str(caught.value)


class _Rocm(Platform):
    """vLLM's ``Platform`` interface as ROCm reports itself (``vllm.platforms.rocm`` cannot be
    imported without a ROCm build: it loads amdsmi and vLLM's ROCm kernels)."""

    _enum = PlatformEnum.ROCM
    device_name = "rocm"
    device_type = "cuda"


class _Xpu(Platform):
    _enum = PlatformEnum.XPU
    device_name = "xpu"
    device_type = "xpu"


@pytest.mark.parametrize("detected", ["current_platform", "torch.version.hip"])
def test_rocm_is_refused_at_construction_naming_the_platform(
    detected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _vllm_config(_recipe_json())
    kv_cache_config, _, _ = plan_kv_caches(config, 1 << 30)
    if detected == "current_platform":
        monkeypatch.setattr(vllm.platforms, "_current_platform", _Rocm())
    else:
        monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(HybridKVConfigError) as caught:
            KVConnectorFactory.create_connector(config, role, kv_cache_config)
        message = str(caught.value)
        assert caught.value.field == "platform"
        assert "\n" not in message
        assert "ROCm" in message
        assert str(caught.value.value).startswith("rocm")
        if detected == "torch.version.hip":
            assert "6.4.43482" in message


def test_an_accelerator_without_a_hybridkv_engine_is_refused_and_cpu_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = _vllm_config(_recipe_json())
    kv_cache_config, _, _ = plan_kv_caches(config, 1 << 30)
    # This session's own platform (CPU) builds both roles.
    assert vllm.platforms.current_platform.is_cpu()
    HybridKVConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    monkeypatch.setattr(vllm.platforms, "_current_platform", _Xpu())
    with pytest.raises(HybridKVConfigError) as caught:
        HybridKVConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    assert (caught.value.field, caught.value.value) == ("platform", "xpu")


# ------------------------------------------------------------------ end to end


def _allocate_caches(kv_cache_config: Any) -> dict[str, Any]:
    """Per-layer CPU caches shaped as vLLM's attention (K/V planes) and mamba state tuples."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    n = kv_cache_config.num_blocks
    caches: dict[str, Any] = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            if isinstance(spec, MambaSpec):
                caches[name] = [
                    torch.zeros((n, *shape), dtype=dtype)
                    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
                ]
            else:
                assert isinstance(spec, AttentionSpec)
                shape = (2, n, spec.block_size, spec.num_kv_heads, spec.head_size)
                caches[name] = torch.zeros(shape, dtype=spec.dtype)
    return caches


class _Run:
    """vLLM's scheduler plus the worker side in the model runner's hook order."""

    def __init__(self) -> None:
        config = _vllm_config(_with_extra(host_memory_bytes=64 << 20))
        kv_cache_config, block_size, hash_block_size = plan_kv_caches(config, 1 << 30)
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.structured_output import StructuredOutputManager

        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=copy.deepcopy(kv_cache_config),
            structured_output_manager=StructuredOutputManager(config),
            block_size=block_size,
            hash_block_size=hash_block_size,
            log_stats=True,
        )
        assert isinstance(self.scheduler.connector, HybridKVConnector)
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(
            hash_block_size, hash_fn, config.num_hash_lookahead_tokens
        )
        self.worker = HybridKVConnector(config, KVConnectorRole.WORKER, kv_cache_config)
        kv_caches = _allocate_caches(kv_cache_config)
        self.worker.register_kv_caches(kv_caches)
        self.caches = build_canonical_caches(
            kv_caches, self.worker.layout.groups, kv_cache_config.num_blocks
        )
        self.block_sizes = [g.block_size for g in self.worker.layout.groups]
        self.requests: dict[str, Request] = {}
        self.stored: dict[bytes, bytes] = {}
        self.loaded: list[tuple[bytes, bytes]] = []
        self.gen = torch.Generator().manual_seed(0)

    def block_bytes(self, group: int, block: int) -> bytes:
        parts = []
        for ref in self.caches.group_refs[group]:
            row = self.caches.tensors[ref.tensor_index].view[block]
            parts.extend(row[r.offset : r.offset + r.length].numpy().tobytes() for r in ref.runs)
        return b"".join(parts)

    def _compute(self, rid: str, start: int, num: int) -> None:
        """The forward: fresh bytes in every block the step's tokens write, per group."""
        tables = self.scheduler.kv_cache_manager.get_block_ids(rid)
        for g, table in enumerate(tables):
            bs = self.block_sizes[g]
            for index in range(start // bs, min(-(-(start + num) // bs), len(table))):
                block = table[index]
                if block == 0:
                    continue
                for ref in self.caches.group_refs[g]:
                    row = self.caches.tensors[ref.tensor_index].view[block]
                    for r in ref.runs:
                        fresh = torch.randint(-128, 127, (r.length,), generator=self.gen)
                        row[r.offset : r.offset + r.length] = fresh.to(torch.int8)

    def add(self, rid: str, prompt: list[int], salt: str | None = None) -> Request:
        request = Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=2, ignore_eos=True),
            pooling_params=None,
            cache_salt=salt,
            block_hasher=self.hasher,
        )
        self.requests[rid] = request
        self.scheduler.add_request(request)
        return request

    def step(self) -> Any:
        before = {rid: r.num_computed_tokens for rid, r in self.requests.items()}
        output = self.scheduler.schedule()
        metadata = output.kv_connector_metadata
        worker = self.worker
        worker.handle_preemptions(metadata)
        worker.bind_connector_metadata(metadata)
        for rid, num in output.num_scheduled_tokens.items():
            self._compute(rid, before[rid], num)
        worker.start_load_kv(None)  # async loads start after the forward is launched
        worker.wait_for_save()
        assert worker.worker is not None
        worker.worker.drain()  # every copy done before the report: the check is timing-free
        for job in metadata.meta.store_jobs:
            for item in job.items:
                self.stored[item.key] = self.block_bytes(item.group_idx, item.block_id)
        results = worker.get_transfer_results(set(output.finished_req_ids))
        for job in metadata.meta.load_jobs:
            for item in job.items:
                self.loaded.append((item.key, self.block_bytes(item.group_idx, item.block_id)))
        assert worker.get_block_ids_with_load_errors() == set()
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        req_ids = list(output.num_scheduled_tokens)
        sampled = [
            [7] if self.requests[r].num_computed_tokens >= self.requests[r].num_tokens else []
            for r in req_ids
        ]
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending,
                finished_recving=results.finished_recving,
                failed_recving=results.failed_recving,
                kv_connector_worker_meta=worker_meta,
            ),
        )
        self.scheduler.update_from_output(output, runner)
        return output

    def run_until_done(self, request: Request, limit: int = 40) -> None:
        for _ in range(limit):
            if request.is_finished() and request.request_id not in self.scheduler.requests:
                return
            self.step()
        raise AssertionError(f"{request.request_id} not done in {limit} steps: {request.status}")


def test_a_stored_prefix_is_loaded_back_byte_for_byte_inside_vllms_scheduler() -> None:
    run = _Run()
    core = run.scheduler.connector.core
    assert core is not None
    unit = core.geometry.scheduler_block
    prompt = [(i * 7919) % 1000 + 1 for i in range(3 * unit + 5)]

    first = run.add("a", prompt)
    run.run_until_done(first)
    assert first.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert run.stored, "the first request stored nothing"
    stats = core.stats()
    assert stats.store_jobs > 0
    assert stats.jobs_in_flight == 0
    assert stats.held_blocks == 0

    # The GPU prefix cache forgets the prefix, so only the host tier can serve it.
    assert run.scheduler.kv_cache_manager.reset_prefix_cache()
    second = run.add("b", [*prompt[: 3 * unit], 999, 998])
    run.step()
    assert second.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert core.stats().claims == 1
    claimed = core.stats().claimed_tokens
    assert claimed >= unit
    assert claimed % unit == 0
    run.run_until_done(second)
    assert second.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert run.loaded, "the external hit loaded nothing"
    for key, content in run.loaded:
        assert content == run.stored[key], f"loaded bytes of {key.hex()} differ from the stored"
    # every group took part: attention KV and mamba state both came back
    groups = {key[-4:] for key, _ in run.loaded}
    assert len(groups) == len(run.worker.layout.groups)
    final = core.stats()
    assert final.load_jobs_failed == 0
    assert final.jobs_in_flight == 0
    assert final.held_blocks == 0
    worker_stats = run.worker.get_kv_connector_stats()
    assert worker_stats is not None
    assert worker_stats.data["load_bytes"] > 0
    run.worker.shutdown()


def test_a_different_cache_salt_gets_no_external_hit_on_equal_tokens() -> None:
    """vLLM folds the salt into ``request.block_hashes``; the keys come from those hashes."""
    run = _Run()
    core = run.scheduler.connector.core
    assert core is not None
    unit = core.geometry.scheduler_block
    prompt = [(i * 31) % 500 + 1 for i in range(2 * unit + 3)]
    first = run.add("a", prompt)
    run.run_until_done(first)
    assert run.stored
    assert run.scheduler.kv_cache_manager.reset_prefix_cache()
    salted = run.add("s", prompt, salt="tenant-2")
    run.step()
    assert salted.status is not RequestStatus.WAITING_FOR_REMOTE_KVS
    assert core.stats().claims == 0
    assert core.stats().lookups >= 2
    run.run_until_done(salted)
    assert not run.loaded
    run.worker.shutdown()
