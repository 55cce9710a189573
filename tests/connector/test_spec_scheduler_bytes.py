"""End to end with real bytes: the spec scheduler drives the core, the worker moves the bytes.

``spec.scheduler.Scheduler`` schedules requests over a small shared GPU pool whose block ids
index real canonical caches (full attention + mamba overlaid on one allocation); the core
(through ``hybridkv.simulator.engine_adapter``) claims, loads and stores; a
:class:`~hybridkv.connector.worker.TransferWorker` runs every job on the CPU engine. The forward
is played by the test: before writing, it checks that every block it reads holds the true
content for the request's tokens (DATA-1: ``spec.system.content``), read back from the bytes;
then it writes the true content's bytes into the blocks it computes.

A first request computes and stores a prompt; other requests push its blocks out of the GPU
prefix cache; a follow-up turn extending the prompt then claims it from the host, loads it,
and its forward reads the loaded bytes. Faults: the same flow with the worker failing every
load job: the failed load is recovered (the request recomputes) and nothing wrong is read.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridkv.cache_layouts import hybrid_overlay_case
from hybridkv.connector import TransferJob, TransferKind
from hybridkv.connector.stack import OffloadStack, build_cpu_stack
from hybridkv.simulator.engine_adapter import CoreConnector, to_core_meta, to_spec_output
from hybridkv.testbed.content import BlockTags
from spec.connector_api import RequestId
from spec.kinds import GroupKind
from spec.managers.group_spec import GroupSpec, cdiv
from spec.scheduler.config import SchedulerConfig
from spec.scheduler.request import Request
from spec.scheduler.scheduler import Scheduler
from spec.system.content import Content, Garbage, attention_holds, state_holds

UNKNOWN = Garbage("unknown bytes")  # what a block holds that no tag wrote

BS = 16
NUM_BLOCKS = 24
FULL, MAMBA = 0, 1


class Run:
    """The spec scheduler over the stack, one ``step()`` per scheduler step."""

    def __init__(self, stack: OffloadStack) -> None:
        self.stack = stack
        self.bytes = BlockTags(stack.caches)
        config = SchedulerConfig(
            groups=(GroupSpec(GroupKind.FULL, BS), GroupSpec(GroupKind.MAMBA, BS)),
            num_blocks=NUM_BLOCKS,
            max_num_batched_tokens=64,
            max_num_running=2,
            hash_block_size=BS,
        )
        self.scheduler = Scheduler(config, CoreConnector(stack.core))
        self.bad_reads: list[str] = []
        self.loaded_reads = 0

    def step(self) -> None:
        output = self.scheduler.schedule()
        worker = self.stack.worker
        worker.bind_connector_metadata(to_core_meta(output.meta))
        for s in output.scheduled:
            self._forward(s)
        worker.wait_for_save()
        kv_output = to_spec_output(worker.get_transfer_results(wait=True))
        sampled = {}
        for s in output.scheduled:
            end = s.num_computed_tokens + s.num_scheduled_tokens
            if end >= len(s.request.token_ids):
                sampled[s.request.request_id] = 500 + end
        self.scheduler.update_from_output(output, sampled, kv_output)

    def _forward(self, s: Any) -> None:
        tokens, start = s.request.token_ids, s.num_computed_tokens
        end = start + s.num_scheduled_tokens
        full, mamba = s.block_ids
        if start:
            for i in range(cdiv(start, BS)):
                value = self.bytes.read(FULL, full[i], UNKNOWN)
                need = min((i + 1) * BS, start)
                if not attention_holds(
                    value, FULL, tokens, block_index=i, block_size=BS, need_end=need
                ):
                    self.bad_reads.append(f"{s.request.request_id} full block {i}: {value}")
            state = self.bytes.read(MAMBA, mamba[cdiv(start, BS) - 1], UNKNOWN)
            if not state_holds(state, MAMBA, tokens, start):
                self.bad_reads.append(f"{s.request.request_id} state at {start}: {state}")
            self.loaded_reads += 1
        for i in range(start // BS, cdiv(end, BS)):
            self.bytes.write(FULL, full[i], Content(FULL, tokens[: min((i + 1) * BS, end)]))
        self.bytes.write(MAMBA, mamba[cdiv(end, BS) - 1], Content(MAMBA, tokens[:end]))

    def run(self, request: Request, max_steps: int = 200) -> None:
        self.scheduler.add_request(request)
        for _ in range(max_steps):
            if self.scheduler.requests[request.request_id].status.is_finished:
                return
            self.step()
        raise AssertionError(f"{request.request_id} did not finish in {max_steps} steps")


def _stack(**faults: Any) -> OffloadStack:
    case = hybrid_overlay_case(NUM_BLOCKS, torch.device("cpu"))
    return build_cpu_stack(
        case.groups,
        case.kv_caches,
        case.num_blocks,
        hash_block_size=BS,
        chunk_size=BS,
        max_model_len=4096,
        num_chunks=64,
        **faults,
    )


PROMPT = tuple(range(1, 97))  # 96 tokens: six blocks


def _conversation(run: Run) -> None:
    run.run(Request(RequestId("turn1"), PROMPT, 4))
    first = run.scheduler.requests[RequestId("turn1")]
    for i in range(3):  # other traffic evicts turn1's blocks from the GPU prefix cache
        run.run(
            Request(RequestId(f"other{i}"), tuple(range(1000 * (i + 1), 1000 * (i + 1) + 96)), 2)
        )
    follow = (*first.token_ids, *range(3000, 3020))
    run.run(Request(RequestId("turn2"), follow, 4))


def test_a_follow_up_turn_reads_loaded_bytes_that_are_true() -> None:
    stack = _stack()
    with stack.engine:
        run = Run(stack)
        _conversation(run)
        stats = stack.core.stats()
        assert stats.load_jobs > 0  # turn2 really loaded from the host
        assert stats.loaded_tokens >= 96
        assert stack.worker.stats().blocks_loaded > 0
        assert run.bad_reads == []
        assert run.loaded_reads > 0


def test_failed_loads_are_recovered_and_nothing_wrong_is_read() -> None:
    def fail_loads(job: TransferJob) -> bool:
        return job.kind is TransferKind.LOAD

    stack = _stack(fault_hook=fail_loads)
    with stack.engine:
        run = Run(stack)
        _conversation(run)
        assert stack.core.stats().load_jobs_failed > 0
        assert stack.worker.stats().faults_injected > 0
        assert run.bad_reads == []
        assert run.scheduler.counters["num_recoveries"] > 0
