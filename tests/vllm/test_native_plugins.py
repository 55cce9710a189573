"""hybridkv's plug-ins inside vLLM 0.33's native ``OffloadingConnector`` (``hybridkv.native``).

Every engine here is vLLM's real ``Scheduler`` with native's own connector and its
``TieringOffloadingSpec``, its worker on CPU tensors (:mod:`hybridkv.vllm.harness.native_plugins`;
every KV read content-checked), under the engine loop ``HYBRIDKV_ENGINE_LOOP`` names. The tier
and the policy are loaded by native's config keys alone (``type`` + ``module_path``,
``eviction_policy`` + ``cache_policy_module_path``): vLLM's factories import them.

- Two engines share the tier: A serves a chat trace and writes its chunks; B, alive beside A,
  serves the same prompts and promotes A's chunks from Redis (and from a directory with the disk
  tier): 0 wrong reads, B computes fewer prompt tokens than native alone. An engine of another
  model finds none of them.
- The remote tier's faults between A's writes and B's reads (every value corrupted or
  truncated on the server, the server killed before B or while B runs, the server paused past
  the deadline): no exception reaches vLLM, 0 wrong reads, every request finishes, nothing
  leaks, and the counters name the cause.
- The policy: hybridkv's ARC with the prompt-before-continuation admission, in the chat trace
  (0 wrong reads) and in native's own CPU manager (a store of continuation chunks into a full
  tier displaces nothing; a prompt's store evicts; native's ARC evicts for both).

Every test runs under both engine loops (the ``loop`` fixture).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.remote]
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from _inprocess import load_tool  # noqa: E402
from _two_engines import started_server  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.disk import ALIGN  # noqa: E402
from hybridkv.errors import HybridKVConfigError  # noqa: E402
from hybridkv.native import HybridKVARCPolicy, HybridKVRemoteTier  # noqa: E402
from hybridkv.vllm.harness.chat import run_trace  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.harness.native_plugins import NativePluginsOnCPU  # noqa: E402
from hybridkv.vllm.harness.report import InProcessReport  # noqa: E402

bench = load_tool("bench_vs_native")
(CASE,) = (c for c in bench._cases(quick=True) if c.name == "sliding+full")
TRACE = CASE.trace
# The loop the module's engines run under: each test runs under both (the ``loop`` fixture),
# whatever HYBRIDKV_ENGINE_LOOP says, since `nox -s remote` runs the remote tests once.
LOOP = {"async": True}


@pytest.fixture(scope="module", autouse=True, params=["async", "sync"])
def loop(request: pytest.FixtureRequest) -> str:
    LOOP["async"] = request.param == "async"
    return str(request.param)


@pytest.fixture(scope="module")
def host_chunks() -> int:
    """Half the trace's working set: the host tier turns over, so B's hits need the tier."""
    probe = InProcessEngine(CASE.config_json, CASE.settings)
    probe.close()
    _, working, _ = bench._figures(TRACE, probe)
    return max(1, working // 2)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Any]:
    yield from started_server(tmp_path)


def remote_entry(port: int, **keys: Any) -> dict[str, Any]:
    return {
        "type": "HybridKVRemoteTier",
        "module_path": "hybridkv.native",
        "remote_url": f"redis://127.0.0.1:{port}",
        **keys,
    }


def engine(
    host: int, tiers: list[dict[str, Any]], policy: str = "lru", model: str = "model"
) -> tuple[InProcessEngine, NativePluginsOnCPU]:
    extra: dict[str, Any] = {"eviction_policy": policy}
    if policy == "HybridKVARCPolicy":
        extra["cache_policy_module_path"] = "hybridkv.native"
    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )
    adapter = NativePluginsOnCPU(host, tiers)
    settings = replace(CASE.settings, model_name=model, async_scheduling=LOOP["async"])
    return InProcessEngine(CASE.config_json, settings, transfer, adapter), adapter


def served(host: int, tiers: list[dict[str, Any]], **kw: Any) -> tuple[InProcessReport, Any]:
    """A fresh engine serves the trace and closes (its tier writes what it queued)."""
    e, adapter = engine(host, tiers, **kw)
    try:
        report = run_trace(e, TRACE)
        tier = adapter.secondary_tiers(e)[0] if tiers else None
        _quiet(e, report)
    finally:
        e.close()
        adapter.close()
    assert not _tier_threads(), _tier_threads()  # the engine's shutdown stopped the tier's
    return report, tier


def _tier_threads() -> list[str]:
    import threading

    names = ("hybridkv-native", "hybridkv-remote", "vllm_offloading_lookup_HybridKV")
    return [t.name for t in threading.enumerate() if t.name.startswith(names) and t.is_alive()]


def _quiet(e: InProcessEngine, report: InProcessReport) -> None:
    assert report.wrong_reads == 0
    assert report.finished == report.requests
    assert e.pending() == 0
    assert e.leaked_blocks() == 0


def counters(tier: Any) -> dict[str, int]:
    snap = tier.snapshot()
    return {**snap["remote"]["counters"], **snap["counters"]}


@pytest.fixture(scope="module")
def alone(host_chunks: int, loop: str) -> InProcessReport:
    """Native alone (the tiering spec, no secondary tier): what B must beat."""
    report, _ = served(host_chunks, [])
    return report


# ------------------------------------------------------------------ loading, sharing


def test_the_tier_and_the_policy_load_through_natives_keys_alone(
    server: Any, host_chunks: int
) -> None:
    e, adapter = engine(host_chunks, [remote_entry(server.port)], policy="HybridKVARCPolicy")
    try:
        manager = e.scheduler.connector.connector_scheduler.manager
        (tier,) = adapter.secondary_tiers(e)
        assert type(tier) is HybridKVRemoteTier
        assert type(manager.primary_tier._policy) is HybridKVARCPolicy
        assert tier.identity["chunk_bytes"] == tier.block_size_bytes
    finally:
        e.close()
        adapter.close()


def test_a_bad_tier_key_is_refused_at_engine_start_naming_it(server: Any, host_chunks: int) -> None:
    with pytest.raises(HybridKVConfigError, match="remote_timeout_ms"):
        engine(host_chunks, [remote_entry(server.port, remote_timeout_ms=0)])
    with pytest.raises(HybridKVConfigError, match="remote_urll"):
        engine(host_chunks, [remote_entry(server.port, remote_urll="x")])


def test_two_engines_share_the_tier_through_native(
    server: Any, host_chunks: int, alone: InProcessReport
) -> None:
    a, a_adapter = engine(host_chunks, [remote_entry(server.port)])
    b = b_adapter = None
    try:
        a_report = run_trace(a, TRACE)
        _quiet(a, a_report)
        (a_tier,) = a_adapter.secondary_tiers(a)
        assert a_tier.remote.flush(10.0)
        written = counters(a_tier)["written"]
        assert written > 0
        # B beside A (both alive): the same prompts, A's chunks promoted from the server.
        b, b_adapter = engine(host_chunks, [remote_entry(server.port)])
        b_report = run_trace(b, TRACE)
        _quiet(b, b_report)
        got = counters(b_adapter.secondary_tiers(b)[0])
    finally:
        for e, ad in ((a, a_adapter), (b, b_adapter)):
            if e is not None:
                e.close()
                ad.close()
    assert got["promoted"] == got["chunks_promoted"] > 0
    assert got["corrupt"] == got["missing"] == got["fault"] == 0
    assert b_report.external_loaded > alone.external_loaded
    assert b_report.prefill_computed < alone.prefill_computed
    # Another model of the same geometry: its chunk keys are all new (none of A's found), and
    # what it promotes it wrote itself.
    before = server.admin().dbsize()  # A's and B's chunks
    assert before >= written
    _, tier = served(host_chunks, [remote_entry(server.port)], model="other")
    mine = counters(tier)
    assert server.admin().dbsize() == before + mine["written"]
    assert mine["promoted"] <= mine["written"]


def test_two_engines_share_the_disk_tier_through_native(
    tmp_path: Path, host_chunks: int, alone: InProcessReport
) -> None:
    entry = {
        "type": "HybridKVDiskTier",
        "module_path": "hybridkv.native",
        "disk_dir": str(tmp_path / "kv"),
        "disk_bytes": 64 << 20,
    }
    _, a_tier = served(host_chunks, [entry])
    assert counters(a_tier)["written"] > 0
    (scoped,) = (tmp_path / "kv").iterdir()  # <disk_dir>/<the identity's digest>
    assert len(scoped.name) == 64
    b, b_tier = served(host_chunks, [entry])
    got = counters(b_tier)
    assert got["promoted"] > 0
    assert b.prefill_computed < alone.prefill_computed
    # Every file damaged under the tier: misses, counted, never wrong KV.
    for path in scoped.rglob("*"):
        if path.is_file() and not path.name.startswith("."):
            data = bytearray(path.read_bytes())
            data[ALIGN + 200] ^= 0xFF  # inside the value (it starts at ALIGN): never padding
            path.write_bytes(bytes(data))
    # C reads them (each refused: a miss, the file removed) and writes its own in their place.
    _, c_tier = served(host_chunks, [entry])
    got, disk = counters(c_tier), c_tier.snapshot()["disk"]["counters"]
    assert disk["damaged_digest"] == disk["removed_damaged"] > 0  # DK-6: a miss, removed
    assert got["missing"] == disk["damaged"]  # the remote tier's view of a refused file
    assert got["promoted"] + got["missing"] == got["promotions_started"]


# ------------------------------------------------------------------ faults


def _written(server: Any, host: int) -> int:
    _, tier = served(host, [remote_entry(server.port)])
    written = counters(tier)["written"]
    assert written > 0
    return written


def _rewrite_values(server: Any, change: Any) -> int:
    admin = server.admin()
    keys = admin.keys("*")
    for key in keys:
        admin.set(key, change(admin.get(key)))
    return len(keys)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda v: v[:-1] + bytes([v[-1] ^ 1]), id="one-byte-flipped"),
        pytest.param(lambda v: v[: len(v) // 2], id="truncated"),
    ],
)
def test_damaged_values_are_misses_and_recomputed(
    server: Any, host_chunks: int, change: Any
) -> None:
    _written(server, host_chunks)
    assert _rewrite_values(server, change) > 0
    _, tier = served(host_chunks, [remote_entry(server.port)])
    got = counters(tier)
    # Each damaged value a fetch met was refused (nothing copied: 0 wrong reads); what the
    # reader promoted it had written over the damaged value itself.
    assert got["corrupt"] > 0
    assert got["promoted"] + got["corrupt"] == got["promotions_started"]
    assert got["promoted"] == got["chunks_promoted"]


def test_a_server_killed_before_the_reader_makes_every_lookup_a_miss(
    server: Any, host_chunks: int
) -> None:
    _written(server, host_chunks)
    server.kill()
    _, tier = served(host_chunks, [remote_entry(server.port, remote_timeout_ms=50)])
    got = counters(tier)
    assert got["lookup_faults"] == got["lookups"] > 0
    assert got["promotions_started"] == got["chunks_promoted"] == 0
    assert got["writes_failed"] > 0
    assert got["written"] == 0
    assert tier.snapshot()["breaker"]["breaker_trips"] >= 1  # then skipped, no waits


def test_a_server_killed_while_the_reader_runs(server: Any, host_chunks: int) -> None:
    _written(server, host_chunks)
    e, adapter = engine(host_chunks, [remote_entry(server.port, remote_timeout_ms=50)])
    step = e.step
    steps = [0]

    def stepped() -> list[Any]:
        steps[0] += 1
        if steps[0] == 8:
            server.kill()
        return step()

    e.step = stepped  # type: ignore[method-assign]
    try:
        report = run_trace(e, TRACE)
        _quiet(e, report)
        got = counters(adapter.secondary_tiers(e)[0])
    finally:
        e.close()
        adapter.close()
    assert steps[0] > 8
    faults = got["lookup_faults"] + got["fault"] + got["timeout"] + got["writes_failed"]
    assert faults > 0
    assert got["promoted"] == got["chunks_promoted"]


def test_a_paused_server_times_out_and_the_engine_goes_on(server: Any, host_chunks: int) -> None:
    _written(server, host_chunks)
    server.admin().client_pause(1500)
    _, tier = served(host_chunks, [remote_entry(server.port, remote_timeout_ms=50)])
    got = counters(tier)
    assert got["lookup_faults"] > 0
    assert tier.snapshot()["breaker"]["breaker_trips"] >= 1


# ------------------------------------------------------------------ the policy


def test_the_policy_reads_each_prompts_end_as_native_recorded_it(
    host_chunks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the admission rule rests on (hybridkv.native.policy's docstring): at the first hook
    naming a request, native has recorded exactly the prompt's full chunks, so the end read is
    the prompt rounded down to a chunk. Checked for every request of the trace (0 wrong reads,
    every request finished: ``served``)."""
    from hybridkv.native import policy

    read: dict[str, int] = {}
    inner = policy._prompt_end

    def recorded(req_context: Any) -> int:
        end = inner(req_context)
        read.setdefault(req_context.req_id, end)
        return end

    monkeypatch.setattr(policy, "_prompt_end", recorded)
    e, adapter = engine(host_chunks, [], policy="HybridKVARCPolicy")
    try:
        report = run_trace(e, TRACE)
        _quiet(e, report)
        chunk = e.block_size  # native's chunk here: one block
        prompts = {rid: r.num_prompt_tokens for rid, r in e.requests.items()}
    finally:
        e.close()
        adapter.close()
    assert set(read) == set(prompts)
    assert read == {rid: n // chunk * chunk for rid, n in prompts.items()}


def _manager(policy: str) -> Any:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    path = "hybridkv.native" if policy == "HybridKVARCPolicy" else None
    return CPUOffloadingManager(4, cache_policy=policy, cache_policy_module_path=path)


def _request(rid: str, prompt: list[bytes], after: list[bytes]) -> Any:
    """A request whose prompt's full chunks are ``prompt`` (recorded, as native's scheduler
    records them at the first lookup); ``after`` are chunks its answer completes later."""
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id=rid)
    for i, key in enumerate(prompt):
        ctx.set_offload_key_position(key, 16 * (i + 1))
    return ctx, lambda: [
        ctx.set_offload_key_position(key, 16 * (len(prompt) + i + 1)) for i, key in enumerate(after)
    ]


def _stored(manager: Any, keys: list[bytes], ctx: Any) -> list[bytes] | None:
    out = manager.prepare_store(keys, ctx)
    if out is None:
        return None
    manager.complete_store(out.keys_to_store, ctx)
    return list(out.evicted_keys)


@pytest.mark.parametrize("policy", ["HybridKVARCPolicy", "arc"])
def test_a_continuation_displaces_nothing_a_prompt_evicts(policy: str) -> None:
    manager = _manager(policy)
    prompt = [bytes([i]) * 36 for i in range(4)]
    answer = [b"\xaa" * 36]
    ctx, decode = _request("r1", prompt, answer)
    assert _stored(manager, prompt, ctx) == []  # the tier is full
    decode()  # the answer completes a chunk past the prompt
    evicted = _stored(manager, answer, ctx)
    other, _ = _request("r2", [b"\xbb" * 36], [])
    prompt_evicted = _stored(manager, [b"\xbb" * 36], other)
    if policy == "HybridKVARCPolicy":
        assert evicted is None  # refused: every cached prompt chunk stays
        assert manager.lookup(answer[0], ctx).name == "MISS"
        assert all(manager.lookup(k, ctx).name == "HIT" for k in prompt[1:])
        assert prompt_evicted == [prompt[0]]
    else:
        assert evicted == [prompt[0]]  # native's ARC displaces a prompt chunk for it
        assert prompt_evicted == [prompt[1]]


# ------------------------------------------------------------------ the documented config

HOWTO = Path(__file__).resolve().parents[2] / "docs" / "howto" / "native-offloading.md"


def test_the_howto_configs_load_through_vllms_factories() -> None:
    import json
    import re

    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from hybridkv.native import HybridKVDiskTier
    from hybridkv.native.settings import remote_settings

    blocks = [json.loads(b) for b in re.findall(r"```json\n(.*?)```", HOWTO.read_text(), re.S)]
    server, disk, policy = blocks
    (entry,) = server["kv_connector_extra_config"]["secondary_tiers"]
    assert server["kv_connector"] == "OffloadingConnector"
    assert server["kv_connector_extra_config"]["spec_name"] == "TieringOffloadingSpec"
    assert SecondaryTierFactory.get_tier_class(entry) is HybridKVRemoteTier
    keys = {k: v for k, v in entry.items() if k not in ("type", "module_path")}
    assert remote_settings(**keys).remote.namespace == b"fleet-a"  # every key accepted
    assert SecondaryTierFactory.get_tier_class(disk) is HybridKVDiskTier
    found = CachePolicyFactory.get_cache_policy_cls(
        policy["eviction_policy"], policy["cache_policy_module_path"]
    )
    assert found is HybridKVARCPolicy
