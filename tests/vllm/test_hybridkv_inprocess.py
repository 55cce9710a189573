"""``HybridKVConnector`` inside the in-process vLLM 0.33 engine
(:mod:`hybridkv.vllm.harness.inprocess`): vLLM's real Scheduler with HMA on, the caches vLLM's own
``allocate_kv_cache`` builds (the hybrid stride, mamba pages viewed as vLLM's runner registers
them), every read content-checked.

- The multi-turn chat of ``test_inprocess_engine.py`` on mamba-align + full and sliding + full:
  host hits, 0 wrong reads, 0 leaked GPU blocks, and at the end nothing in flight, no store
  entry pinned or storing, no block held, no request left in the core.
- Random traces (a seeded generator; ``max_examples`` of the Hypothesis profile, split over three
  layouts: ``ci`` 201 traces, ``nightly`` 2,001) with load and store failures injected before
  submission and inside the copy (:class:`hybridkv.vllm.harness.cpu_worker.FaultPlan`), tight GPU
  pools (preemptions on every layout), aborts of requests waiting for their load, random aborts, and
  load deadlines (a third of the traces draw ``load_deadline_steps`` 1 or 2 against copies 0-3
  steps late, so some loads outlive it: abandoned, their copies cancelled, their requests
  recomputed): 0 wrong reads, 0 wedges, 0 leaks, 0 violations of the spec's invariants
  evaluated on vLLM's and the connector's state after every step (:mod:`_invariants_on_vllm`),
  and across each layout's batch failures injected, loads failed, deadlines fired and the
  requests they hit recovered by recompute, preemptions, and the states the invariants exist
  for (stores and loads in flight, a store reading a preempted request's blocks, delayed frees,
  parked loads).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

import torch  # noqa: E402
from _invariants_on_vllm import EXERCISED  # noqa: E402
from _random_traces import HOST_BYTES, SHAPES, Outcome, Shape, play, residue  # noqa: E402
from _random_traces import random_trace as _random_trace  # noqa: E402, F401 (re-exported)
from _random_traces import transfer as _transfer  # noqa: E402
from diffharness.layouts import RECIPES, Layout  # noqa: E402
from hypothesis import settings  # noqa: E402

from hybridkv import hostmem  # noqa: E402
from hybridkv.vllm.harness.chat import ChatTrace, run_trace  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import FaultPlan, HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402


def _quiescent(engine: InProcessEngine) -> None:
    """Nothing in flight, pinned, storing, held or remembered once every request is done."""
    left = residue(engine)
    assert not left, dict(left)


# ------------------------------------------------------------------ the chat trace

# The GPU pools of test_inprocess_engine.py; chunk = one block of the layout.
CHAT = {
    Layout.MAMBA_FULL: (
        EngineSettings(
            num_gpu_blocks=16, max_model_len=2560, max_num_seqs=2, max_num_batched_tokens=1280
        ),
        ChatTrace(convs=3, turns=3, system_len=700, user_min=150, user_max=300),
        640,
    ),
    Layout.SLIDING_FULL: (
        EngineSettings(
            num_gpu_blocks=30,
            max_model_len=512,
            block_size=32,
            max_num_seqs=3,
            max_num_batched_tokens=128,
        ),
        ChatTrace(convs=4, turns=3, system_len=128),
        32,
    ),
}


@pytest.mark.parametrize("sized", [False, True], ids=["extra-config", "host-bytes-delay0"])
@pytest.mark.parametrize("layout", list(CHAT), ids=lambda lay: lay.value)
def test_hybridkv_hits_the_host_tier_with_correct_content(layout: Layout, sized: bool) -> None:
    """Sized: the adapter's ``host_bytes`` replaces an extra config of 1 byte (too small to
    build the connector) and copies report at the first poll (delay 0, as the native rule)."""
    settings_, trace, chunk = CHAT[layout]
    adapter = HybridKVOnCPU(host_bytes=HOST_BYTES, delay=0) if sized else HybridKVOnCPU()
    transfer = _transfer(chunk, 1 if sized else HOST_BYTES)
    engine = InProcessEngine(RECIPES[layout].config_json(), settings_, transfer, adapter)
    assert engine.scheduler.connector.hybridkv_config.host_memory_bytes == HOST_BYTES
    report = run_trace(engine, trace)
    print(f"\n{layout.value} HybridKVConnector d={adapter.delay}: {report}")
    assert report.connector == "HybridKVConnector"
    assert report.finished == report.requests > 0
    assert report.slots_checked > 0
    assert report.wrong_reads == 0
    assert report.external_loaded > 0
    assert report.external_hits == report.external_loaded
    assert report.preemptions == 0  # the identity below holds without recompute
    total = report.prefill_computed + report.gpu_prefix_hits + report.external_hits
    assert total == report.prompt_tokens
    assert report.transfers["bytes_loaded"] > 0
    assert report.transfers["bytes_stored"] > 0
    assert engine.scheduler.connector.core.stats().loaded_tokens == report.external_loaded
    _quiescent(engine)


POISON = 0xA5


def _chat_cache_bytes(layout: Layout) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The chat of ``CHAT[layout]``: every GPU cache's bytes at the end, and the host slots'."""
    settings_, trace, chunk = CHAT[layout]
    engine = InProcessEngine(
        RECIPES[layout].config_json(), settings_, _transfer(chunk), HybridKVOnCPU()
    )
    report = run_trace(engine, trace)
    assert report.wrong_reads == 0
    assert report.external_loaded > 0
    caches = {n: t.contiguous().view(torch.uint8).clone() for n, t in engine.kv_caches.items()}
    host = engine.worker._host.tensor.clone()
    engine.worker.shutdown()
    return caches, host


@pytest.mark.parametrize("layout", list(CHAT), ids=lambda lay: lay.value)
def test_a_load_writes_only_bytes_a_store_wrote(
    layout: Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chat twice, the second time with every host slot poisoned (0xA5) before the run: the
    GPU caches must end byte for byte the same. A load that copied host bytes no store wrote
    (a pad, a tail past the stored tokens, a slot of another unit) would carry the poison into
    the caches; fresh host memory reads as zeros, like fresh caches, and would hide it. Bytes,
    not values: some content tags read as NaN in bf16."""
    clean, _ = _chat_cache_bytes(layout)
    allocate = hostmem.HostMemory.__init__

    def poisoned(self: hostmem.HostMemory, *args: Any, **kwargs: Any) -> None:
        allocate(self, *args, **kwargs)
        self.tensor.fill_(POISON)

    monkeypatch.setattr(hostmem.HostMemory, "__init__", poisoned)
    dirty, host = _chat_cache_bytes(layout)
    assert int((host == POISON).sum()) > 0  # slots no store wrote still hold the poison
    assert clean.keys() == dirty.keys()
    for name, tensor in clean.items():
        assert torch.equal(tensor, dirty[name]), name


def test_every_load_drawn_to_fail_in_its_copy_fails_one_run_copies_included() -> None:
    """``load_rate=1.0, mid_copy=1.0``: every load fails inside its copy. Most loads of mamba +
    full carry one full-attention block, one copy run: with no second run to raise in, such a
    load moves its bytes and reports failed (it used to succeed, so ``--faults`` fell short of
    its rate); vLLM recomputes every request whose load failed, and no read is wrong. A system
    prompt of two chunks makes a load of two jobs: the first chunk's full block alone, then the
    second's with the mamba states."""
    settings_, _, chunk = CHAT[Layout.MAMBA_FULL]
    trace = ChatTrace(convs=3, turns=3, system_len=1400, user_min=150, user_max=300)
    adapter = HybridKVOnCPU(faults=FaultPlan(3, load_rate=1.0, mid_copy=1.0))
    engine = InProcessEngine(
        RECIPES[Layout.MAMBA_FULL].config_json(), settings_, _transfer(chunk), adapter
    )
    report = run_trace(engine, trace)
    core = engine.scheduler.connector.core.stats()
    assert report.finished == report.requests > 0
    assert report.wrong_reads == 0
    assert core.load_jobs > 0
    assert adapter.stats()["load_faults"] == core.load_jobs_failed == core.load_jobs
    assert adapter.stats().get("store_faults", 0) == core.store_jobs_failed == 0
    assert report.failed_loads > 0
    assert report.transfers["faults_injected"] == 0  # none failed before submission
    _quiescent(engine)


# ------------------------------------------------------------------ random traces
# The generator and the player live in _random_traces (the soak runner, tools/soak.py, plays
# the same seeds by the thousand).

TRACES_PER_LAYOUT = max(10, -(-settings.default.max_examples // len(SHAPES)))


def _play(shape: Shape, seed: int) -> Outcome:
    """One trace, held to what every trace must show: all requests finished, nothing left."""
    out = play(shape, seed)
    assert out.unfinished == 0, f"seed {seed}: unfinished requests"
    assert not out.residue, f"seed {seed}: {dict(out.residue)}"
    return out


@pytest.mark.parametrize("layout", list(SHAPES), ids=lambda lay: lay.value)
def test_random_traces_with_faults_preemptions_and_aborts(layout: Layout) -> None:
    shape = SHAPES[layout]
    total: Counter[str] = Counter()
    for seed in range(TRACES_PER_LAYOUT):
        out = _play(shape, seed)
        r = out.report
        assert r.wrong_reads == 0, f"seed {seed}: {r}"
        total.update(
            traces=1,
            prompt=r.prompt_tokens,
            computed=r.prefill_computed,
            gpu_hits=r.gpu_prefix_hits,
            host_loaded=r.external_loaded,
            slots_checked=r.slots_checked,
            wrong_reads=r.wrong_reads,
            preemptions=r.preemptions,
            faults_injected=out.faults,
            failed_loads=len(out.failed_loads),
            recovered=out.recovered,
            aborted=out.aborted,
            aborted_loading=out.aborted_loading,
            deadlines_fired=out.deadlines,
        )
        total.update(out.situations)
    print(f"\n{layout.value}: {dict(total)}")
    assert total["wrong_reads"] == 0
    counted = ("slots_checked", "host_loaded", "faults_injected", "failed_loads", "recovered")
    for name in (*counted, "deadlines_fired"):
        assert total[name] > 0, (name, dict(total))
    assert total["aborted_loading"] > 0, dict(total)
    # The invariants ran after every step (0 violations, else _play raised) on states that
    # exercise them: preemptions, stores and loads in flight, pins outside the tables...
    for name in ("preemptions", *EXERCISED):
        assert total[name] > 0, (name, dict(total))
