"""hybridkv.vllm.harness.inprocess: vLLM 0.33's real Scheduler with its native OffloadingConnector
(both roles, the worker moving real bytes on CPU tensors) on the multi-turn chat trace,
content-checked, on a mamba-align + full layout and a sliding + full layout; and the same runs
without a connector."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from diffharness.layouts import RECIPES, Layout  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.vllm.harness.chat import ChatTrace, run_trace  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings, WedgedError  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.harness.native_cpu import HostCopyWorker, NativeOffloadOnCPU  # noqa: E402
from hybridkv.vllm.harness.report import InProcessReport  # noqa: E402

# Small GPU pools, so later turns find their prefix on the host tier rather than on the GPU.
CASES = {
    Layout.MAMBA_FULL: (
        EngineSettings(
            num_gpu_blocks=16, max_model_len=2560, max_num_seqs=2, max_num_batched_tokens=1280
        ),
        ChatTrace(convs=3, turns=3, system_len=700, user_min=150, user_max=300),
        32,
    ),
    Layout.SLIDING_FULL: (
        EngineSettings(
            num_gpu_blocks=40,
            max_model_len=512,
            block_size=32,
            max_num_seqs=3,
            max_num_batched_tokens=128,
        ),
        ChatTrace(convs=4, turns=3, system_len=128),
        256,
    ),
}


def _native() -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config={}
    )


def _run(layout: Layout, native: bool, adapter: NativeOffloadOnCPU | None = None):
    settings, trace, chunks = CASES[layout]
    if native and adapter is None:
        adapter = NativeOffloadOnCPU(chunks, delay=1)
    engine = InProcessEngine(
        RECIPES[layout].config_json(), settings, _native() if native else None, adapter
    )
    return engine, run_trace(engine, trace)


def _accounted(report: InProcessReport, *, may_preempt: bool = False) -> None:
    """Every request finished, no block leaked, and every prompt token computed or hit. The
    identity is exact without preemption; a preempted request may compute part of its prompt
    again (or find it in vLLM's prefix cache), so with preemptions the left side can only
    grow."""
    assert report.finished == report.requests > 0
    assert report.leaked_blocks == 0
    assert report.slots_checked > 0
    total = report.prefill_computed + report.gpu_prefix_hits + report.external_hits
    if not may_preempt:
        assert report.preemptions == 0
    if report.preemptions:
        assert total >= report.prompt_tokens
    else:
        assert total == report.prompt_tokens


@pytest.mark.parametrize("layout", list(CASES), ids=lambda lay: lay.value)
def test_native_offloading_hits_the_host_tier_with_correct_content(layout: Layout) -> None:
    _, plain = _run(layout, native=False)
    engine, native = _run(layout, native=True)
    print(f"\n{layout.value} no connector: {plain}\n{layout.value} native: {native}")
    # Without a connector the mamba + full pool preempts under async scheduling (a finished
    # request's blocks are freed a step later, while the next prefill is in flight).
    _accounted(plain, may_preempt=True)
    _accounted(native)
    for report in (plain, native):
        assert report.wrong_reads == 0
    assert plain.connector == ""
    assert plain.external_loaded == 0
    assert native.connector == "OffloadingConnector"
    assert native.external_loaded > 0
    assert native.external_hits == native.external_loaded
    assert native.prefill_computed < plain.prefill_computed
    assert native.transfers["bytes_loaded"] > 0
    assert native.transfers["bytes_stored"] > 0
    assert engine.adapter.pending() == 0
    assert 0 < native.connector_us < native.schedule_us


def test_a_load_that_moves_no_bytes_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = HostCopyWorker._copy_ref

    def stores_only(self, *args):  # type: ignore[no-untyped-def]
        return real(self, *args) if args[-1] else 0

    monkeypatch.setattr(HostCopyWorker, "_copy_ref", stores_only)
    _, report = _run(Layout.SLIDING_FULL, native=True)
    assert report.external_loaded > 0
    assert report.wrong_reads > 0


def test_the_wedge_guard_names_max_steps() -> None:
    settings, trace, _ = CASES[Layout.SLIDING_FULL]
    engine = InProcessEngine(
        RECIPES[Layout.SLIDING_FULL].config_json(),
        EngineSettings(**{**_fields(settings), "max_steps": 3}),
    )
    with pytest.raises(WedgedError, match="max_steps=3"):
        run_trace(engine, trace)


def _fields(settings: EngineSettings) -> dict[str, object]:
    return {name: getattr(settings, name) for name in settings.__dataclass_fields__}
