"""Two engines, one server: the prefill engine B saves through the remote tier (issue 12).

Used by tools/bench_remote.py on the server it started, in the same run as its GB/s figures.
For each layout of tools/bench_vs_native.py (vLLM 0.33's real ``Scheduler`` in-process, both
connector roles on CPU tensors, every KV read content-checked), the same chat prompts are
served by three fresh engines, each with its own host tier:

- A, with the remote tier: serves the prompts and writes its chunks behind;
- B, with the remote tier on the same server: serves the same prompts and promotes A's chunks;
- B alone, without the remote tier: the same prompts, what B would compute on its own.

Printed per layout: prompt tokens, prefill computed by B alone and by B, the tokens saved and
their share, what B's connector loaded, the chunks A wrote and B promoted (with bytes), the
promotion outcomes, and wrong reads (every slot the forward reads is checked). Every figure is
read off the engines' own reports and counters. Prompts are served in waves of two, each run to
completion, so B's requests never overlap A's (B runs after A has drained and flushed).

A module of the tools, not a benchmark (``nox -s bench`` runs ``bench_*.py`` only).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_vs_native, _vllm_tool

OUTCOMES = ("promoted", "missing", "fault", "timeout", "corrupt")


@dataclass(frozen=True, slots=True)
class Saved:
    """One layout's two-engine run."""

    layout: str
    prompts: int
    prompt_tokens: int
    alone_computed: int
    b_computed: int
    b_loaded: int
    chunks_written: int
    bytes_written: int
    chunks_promoted: int
    bytes_fetched: int
    outcomes: dict[str, int]
    wrong_reads: int

    @property
    def saved(self) -> int:
        """Prompt tokens B did not compute that B alone did."""
        return self.alone_computed - self.b_computed


def _prompts(trace: Any) -> list[tuple[str, list[int]]]:
    """Each conversation's turns as prompts growing by fresh user tokens (no replayed answers:
    every engine then serves exactly the same token lists)."""
    system = trace.system()
    found = []
    for conv in range(trace.convs):
        prompt = list(system)
        for turn in range(trace.turns):
            prompt = prompt + trace.user(conv, turn)
            found.append((f"c{conv}-t{turn}", list(prompt)))
    return found


def _serve(engine: Any, prompts: list[tuple[str, list[int]]], prefix: str) -> Any:
    finished = 0
    for at in range(0, len(prompts), 2):
        for rid, tokens in prompts[at : at + 2]:
            engine.add(prefix + rid, tokens, 4)
        while engine.busy():
            if engine.tally.steps >= engine.settings.max_steps:
                raise RuntimeError(f"{prefix}engine wedged: {finished} requests finished")
            finished += sum(1 for out in engine.step() if out.finish_reason is not None)
    if engine.pending():
        raise RuntimeError(f"{prefix}engine: {engine.pending()} transfer jobs left in flight")
    return engine.report(finished)


def run_layout(case: Any, port: int | None, namespace: str) -> Saved:
    """A, B and B alone on ``case``; ``port`` None is refused (the point is the server)."""
    import bench_vs_native as bench  # vLLM imports here, only when engines run
    from vllm.config import KVTransferConfig

    from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU
    from hybridkv.vllm.harness.inprocess import InProcessEngine

    if port is None:
        raise ValueError("port: the two-engine run needs a server; start one first")
    probe = InProcessEngine(case.config_json, case.settings)
    probe.close()
    block, chunk_bytes = probe.block_size, bench.block_bytes(probe)
    host_bytes = 2 * bench.working_set_blocks(case.trace, block) * chunk_bytes

    def engine(remote: bool) -> Any:
        extra: dict[str, Any] = {"chunk_size": block}
        if remote:
            extra |= {
                "remote_url": f"redis://127.0.0.1:{port}/0",
                "remote_namespace": namespace,
                "remote_timeout_ms": 1000,
            }
        transfer = KVTransferConfig(
            kv_connector="HybridKVConnector",
            kv_connector_module_path="hybridkv.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        )
        return InProcessEngine(
            case.config_json,
            case.settings,
            transfer,
            HybridKVOnCPU(host_bytes=host_bytes, delay=1),
        )

    prompts = _prompts(case.trace)
    a, b, alone = engine(True), engine(True), engine(False)
    try:
        ra = _serve(a, prompts, "a-")
        if not a.worker.worker_remote.flush(30.0):
            raise RuntimeError("engine A's writes did not reach the server within 30 s")
        rb = _serve(b, prompts, "b-")
        r_alone = _serve(alone, prompts, "alone-")
        written = a.worker.worker_remote.counters()
        fetched = b.worker.worker_remote.counters()
        count = b.scheduler.connector.remote.count
        return Saved(
            layout=case.name,
            prompts=len(prompts),
            prompt_tokens=rb.prompt_tokens,
            alone_computed=r_alone.prefill_computed,
            b_computed=rb.prefill_computed,
            b_loaded=rb.external_loaded,
            chunks_written=written["remote_written"],
            bytes_written=written["remote_written_bytes"],
            chunks_promoted=count["promoted"],
            bytes_fetched=fetched["remote_fetched_bytes"],
            outcomes={name: count[name] for name in OUTCOMES},
            wrong_reads=ra.wrong_reads + rb.wrong_reads + r_alone.wrong_reads,
        )
    finally:
        for each in (a, b, alone):
            each.close()


def run(port: int, quick: bool = True) -> list[Saved]:
    """The mamba + full and sliding + full cases of bench_vs_native on the server at ``port``."""
    import bench_vs_native as bench

    cases = [c for c in bench._cases(quick) if c.name in ("mamba+full", "sliding+full")]
    return [run_layout(case, port, f"bench-{case.name}") for case in cases]


def format_saved(row: Saved) -> str:
    """One printed line per layout."""
    share = row.saved / row.alone_computed if row.alone_computed else 0.0
    outcomes = " ".join(f"{k} {v}" for k, v in row.outcomes.items() if v)
    return (
        f"{row.layout:<13} {row.prompts:3d} prompts {row.prompt_tokens:6d} tokens; "
        f"computed alone {row.alone_computed:6d}, B {row.b_computed:6d}: saved {row.saved:6d} "
        f"({share:.0%}); B loaded {row.b_loaded}; A wrote {row.chunks_written} chunks "
        f"({row.bytes_written} B), B promoted {row.chunks_promoted} ({row.bytes_fetched} B; "
        f"{outcomes or 'no promotion'}); wrong reads {row.wrong_reads}"
    )
