"""Two in-process vLLM 0.33 engines sharing one Redis server through HybridKVConnector's remote
tier (:mod:`hybridkv.vllm.remote`), for tests/vllm/test_remote_two_engines.py.

Each engine is :class:`hybridkv.vllm.harness.inprocess.InProcessEngine`: vLLM's real ``Scheduler``,
its own scheduler-role and worker-role ``HybridKVConnector`` (separate host tiers), every KV
slot and mamba state the forward reads content-checked. The only thing the engines share is the
server. The server fixtures come from tests/remote (``_redis_server``: a real ``redis-server``
on 127.0.0.1, skipped without the binary unless ``HYBRIDKV_REQUIRE_REDIS=1``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "remote"))

from _redis_server import BINARIES, RedisServer, find_binary, found_or_skip
from diffharness.layouts import RECIPES, Layout
from vllm.config import KVTransferConfig

from hybridkv.vllm.harness.chat import ChatTrace
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU
from hybridkv.vllm.harness.engine_config import EngineSettings, WedgedError
from hybridkv.vllm.harness.inprocess import InProcessEngine
from hybridkv.vllm.harness.report import InProcessReport

__all__ = [
    "SHAPES",
    "Prompt",
    "Shape",
    "build",
    "chat_prompts",
    "config_json",
    "flush_writes",
    "redis_binary_or_skip",
    "run_prompts",
    "started_server",
]

HOST_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Shape:
    """A layout's engine settings, chunk (one block) and chat trace."""

    layout: Layout
    settings: EngineSettings
    chunk: int
    trace: ChatTrace


SHAPES = {
    # Mamba (align mode) + full attention: each chunk carries the mamba state at its end.
    Layout.MAMBA_FULL: Shape(
        Layout.MAMBA_FULL,
        EngineSettings(
            num_gpu_blocks=16, max_model_len=2560, max_num_seqs=2, max_num_batched_tokens=1280
        ),
        640,
        ChatTrace(convs=3, turns=2, system_len=1300, user_min=150, user_max=300),
    ),
    # Sliding window + full attention, 32-token chunks (many chunks per prompt).
    Layout.SLIDING_FULL: Shape(
        Layout.SLIDING_FULL,
        EngineSettings(
            num_gpu_blocks=30,
            max_model_len=512,
            block_size=32,
            max_num_seqs=3,
            max_num_batched_tokens=128,
        ),
        32,
        ChatTrace(convs=4, turns=2, system_len=128),
    ),
}


def redis_binary_or_skip() -> str:
    """The server binary; skip without one unless HYBRIDKV_REQUIRE_REDIS=1 (then fail)."""
    reason = f"none of {', '.join(BINARIES)} is on PATH (`nox -s remote` installs one)"
    return found_or_skip(find_binary(), reason)


def started_server(workdir: Path) -> Iterator[RedisServer]:
    server = RedisServer(redis_binary_or_skip(), workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def transfer(
    shape: Shape,
    port: int | str | None,
    *,
    namespace: str = "hybridkv",
    timeout_ms: int = 200,
    breaker_backoff_ms: int = 5000,
) -> Any:
    extra: dict[str, Any] = {"host_memory_bytes": HOST_BYTES, "chunk_size": shape.chunk}
    if port is not None:
        extra |= {
            "remote_url": port if isinstance(port, str) else f"redis://127.0.0.1:{port}/0",
            "remote_namespace": namespace,
            "remote_timeout_ms": timeout_ms,
            "remote_breaker_backoff_ms": breaker_backoff_ms,
        }
    return KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )


# vLLM 0.33's CPU MoE kernel takes an expert width per rank that is a multiple of this
# (``experts/cpu_moe.py``: ``intermediate_size_per_partition % 32``); with none that does,
# building the model fails ("No Unquantized MoE backend supports the deployment configuration").
_CPU_MOE_WIDTH = 32


def config_json(shape: Shape, tp: int) -> dict[str, Any]:
    """The layout's config.json, its experts widened where ``tp`` ranks would split them into
    widths vLLM's CPU MoE kernel refuses (gpt-oss's 2880 over 4 ranks: 720). The KV geometry
    (heads, head size, layers, windows) is untouched."""
    config = RECIPES[shape.layout].config_json()
    width = config.get("intermediate_size")
    step = _CPU_MOE_WIDTH * tp
    if isinstance(width, int) and width % step:
        config["intermediate_size"] = -(-width // step) * step
    return config


def build(
    shape: Shape,
    port: int | str | None,
    *,
    model: str = "model",
    tp: int = 1,
    replicated: bool = False,
    settled: bool = True,
    **kw: Any,
) -> InProcessEngine:
    """One engine (its own host tier) on the shared server at ``port`` (None: no remote; a
    str: the ``remote_url`` itself, e.g. a cluster's), serving the model named ``model``
    (another name: another model of the same geometry), on
    ``tp`` tensor-parallel ranks simulated in process (``replicated``: the ranks hold
    replicated KV, as an MLA model's; each rank reports its jobs a step apart from the last);
    ``settled``: its lookups are answered before each step (:func:`answer_within_a_step`)."""
    settings = dataclasses.replace(
        shape.settings, model_name=model, tensor_parallel_size=tp, replicated_kv=replicated
    )
    adapters = [HybridKVOnCPU(delay=1 + rank % 2) for rank in range(tp)]
    engine = InProcessEngine(
        config_json(shape, tp),
        settings,
        transfer(shape, port, **kw),
        adapters if tp > 1 else adapters[0],
    )
    remote = engine.scheduler.connector.remote
    if remote is not None:
        remote.record = True  # keep the (chunk, salt) logs the tenant checks read
        if settled:
            answer_within_a_step(engine)
    return engine


def answer_within_a_step(engine: InProcessEngine) -> None:
    """Before each engine step, wait until the scheduler side's remote lookups are answered.

    Lookups run off the scheduler thread (issue 30): a request whose lookup is not answered
    waits at most ``remote_lookup_wait_ms``, then goes on without the remote hit. These traces
    check what the remote tier loads, so they model a server that answers within one engine
    step (as a healthy one does: an EXISTS is well under a millisecond, a step is not):
    deferred at the step that asks, answered at the next. How a slow server's late answers
    play is tests/vllm/test_remote_stall.py's.
    """
    remote = engine.scheduler.connector.remote
    step = engine.step

    def answered_step() -> list[Any]:
        assert remote.settle_lookups(10.0)  # each EXISTS is bounded by remote_timeout_ms
        return step()

    engine.step = answered_step  # type: ignore[method-assign]


@dataclass(frozen=True, slots=True)
class Prompt:
    rid: str
    tokens: list[int]
    salt: str | None = None


def chat_prompts(trace: ChatTrace, prefix: str = "", salt: str | None = None) -> list[Prompt]:
    """The trace's prompts, each turn growing the last by fresh user tokens (outputs are not
    replayed: the two engines then serve identical prompts)."""
    system = trace.system()
    found = []
    for conv in range(trace.convs):
        prompt = list(system)
        for turn in range(trace.turns):
            prompt = prompt + trace.user(conv, turn)
            found.append(Prompt(f"{prefix}c{conv}-t{turn}", list(prompt), salt))
    return found


def run_prompts(
    engine: InProcessEngine,
    prompts: list[Prompt],
    *,
    output_len: int = 4,
    per_wave: int = 2,
    after_step: Callable[[], None] | None = None,
) -> InProcessReport:
    """Serve ``prompts`` in waves of ``per_wave`` (each wave runs to completion), then drain
    the connector; :class:`WedgedError` past ``max_steps``. ``after_step`` runs after every
    engine step (the random traces' invariant checker)."""
    finished = 0
    for at in range(0, len(prompts), per_wave):
        for p in prompts[at : at + per_wave]:
            engine.add(p.rid, p.tokens, output_len, cache_salt=p.salt)
        while engine.busy():
            if engine.tally.steps >= engine.settings.max_steps:
                raise WedgedError(f"{finished} of {len(engine.requests)} finished")
            finished += sum(1 for out in engine.step() if out.finish_reason is not None)
            if after_step is not None:
                after_step()
    if engine.pending():
        raise WedgedError(f"{engine.pending()} transfer jobs in flight at the end")
    return engine.report(finished)


def flush_writes(engine: InProcessEngine, timeout_s: float = 10.0) -> bool:
    """Wait until every rank's worker wrote every queued chunk (write-behind is async)."""
    remotes = [rank.worker.worker_remote for rank in engine.ranks]
    return all(remote is None or remote.flush(timeout_s) for remote in remotes)
