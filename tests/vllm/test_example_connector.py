"""examples/hma_offload inside vLLM 0.33's real Scheduler (the in-process engine), under the
engine loop HYBRIDKV_ENGINE_LOOP names (`nox -s vllm` runs both).

The example connector is loaded the way a user loads it, by module path in the
KVTransferConfig; its worker side gets vLLM's CPU caches through ``register_kv_caches`` and
moves real bytes with hybridkv's CPU transfer engine. The stand-in forward checks every KV slot
each step reads against the content its request's tokens imply, so a wrong load is a
``wrong_reads`` count, and the control (loads that move no byte) shows that count is live.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

# examples/ is not in the wheel: it is found in the checkout, after the installed hybridkv.
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # appended: a regular package there wins over a namespace one
    sys.path.append(str(ROOT))

from diffharness.layouts import RECIPES, Layout  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from examples.hma_offload.scheduler import JobKind  # noqa: E402
from examples.hma_offload.worker import OffloadWorker  # noqa: E402
from hybridkv import HybridKVConfigError  # noqa: E402
from hybridkv.vllm.harness.chat import ChatTrace, run_trace  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402

HOST_BYTES = 64 << 20

# Small GPU pools, so later turns find their prefix on the host rather than in vLLM's cache.
CASES = {
    Layout.SLIDING_FULL: (
        EngineSettings(
            num_gpu_blocks=40,
            max_model_len=512,
            block_size=32,
            max_num_seqs=3,
            max_num_batched_tokens=128,
        ),
        ChatTrace(convs=4, turns=3, system_len=128),
    ),
    Layout.THREE_GROUPS: (
        EngineSettings(
            num_gpu_blocks=48,
            max_model_len=512,
            block_size=32,
            max_num_seqs=3,
            max_num_batched_tokens=128,
        ),
        ChatTrace(convs=8, turns=3, system_len=128),
    ),
    Layout.FULL_ONLY: (
        EngineSettings(
            num_gpu_blocks=24,
            max_model_len=512,
            block_size=32,
            max_num_seqs=3,
            max_num_batched_tokens=128,
        ),
        ChatTrace(convs=4, turns=3, system_len=128),
    ),
}


def _config(host_bytes: object = HOST_BYTES) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="ExampleOffloadConnector",
        kv_connector_module_path="examples.hma_offload",
        kv_role="kv_both",
        kv_connector_extra_config={"host_bytes": host_bytes},
    )


def _run(layout: Layout):
    settings, trace = CASES[layout]
    engine = InProcessEngine(RECIPES[layout].config_json(), settings, _config())
    return engine, run_trace(engine, trace)


@pytest.mark.parametrize("layout", list(CASES), ids=lambda lay: lay.value)
def test_loads_come_back_from_the_host_with_the_right_content(layout: Layout) -> None:
    settings, trace = CASES[layout]
    plain = run_trace(InProcessEngine(RECIPES[layout].config_json(), settings), trace)
    engine, report = _run(layout)
    print(f"\n{layout.value} no connector: {plain}\n{layout.value} example: {report}")
    assert report.finished == report.requests > 0
    assert report.slots_checked > 0
    assert report.wrong_reads == 0
    assert report.leaked_blocks == 0
    assert report.connector == "ExampleOffloadConnector"
    assert report.external_loaded > 0
    assert report.external_hits == report.external_loaded
    assert report.prefill_computed < plain.prefill_computed
    # The scheduler side's own record agrees with vLLM's: every load and store reported.
    side = engine.scheduler.connector.scheduler
    stats = side.store.stats()
    assert side.hit_tokens == report.external_loaded
    assert stats.stored > 0
    assert stats.loads_prepared == stats.loads_completed > 0
    assert stats.storing == stats.pinned == 0
    assert stats.used <= stats.capacity


def test_a_load_that_moves_no_bytes_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: loads reported done without copying. The forward must see wrong KV."""
    real = OffloadWorker.run

    def stores_only(self: OffloadWorker, jobs) -> None:  # type: ignore[no-untyped-def]
        if jobs and jobs[0].kind is JobKind.LOAD:
            self._results.extend((job.job_id, True) for job in jobs)
            return
        real(self, jobs)

    monkeypatch.setattr(OffloadWorker, "run", stores_only)
    _, report = _run(Layout.SLIDING_FULL)
    assert report.external_loaded > 0
    assert report.wrong_reads > 0


def test_a_mamba_model_is_refused_at_start() -> None:
    settings = EngineSettings(num_gpu_blocks=16, max_model_len=2560)
    with pytest.raises(HybridKVConfigError, match="mamba/GDN"):
        InProcessEngine(RECIPES[Layout.MAMBA_FULL].config_json(), settings, _config())


@pytest.mark.parametrize("value", [None, 0, -1, True, "1GB"])
def test_host_bytes_must_be_a_positive_int(value: object) -> None:
    settings, _ = CASES[Layout.FULL_ONLY]
    with pytest.raises(HybridKVConfigError, match="host_bytes"):
        InProcessEngine(RECIPES[Layout.FULL_ONLY].config_json(), settings, _config(value))
