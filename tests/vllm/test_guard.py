"""Guard: the two sides of the differential tests are different implementations.

- The vLLM side runs vLLM 0.33's own ``vllm.v1.core.sched.scheduler.Scheduler`` (the class from
  the installed wheel, not a copy), and every step goes through its ``schedule()`` and
  ``update_from_output()``; the connector is built by vLLM's connector factory.
- The spec side imports no vLLM (and no torch): in a fresh interpreter where importing either
  fails, it runs a trace to the same observations as in this process.
- The comparison has teeth: a spec with a divergence switched on, or a pool that frees in the
  wrong order, is caught.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM 0.33 (run `nox -s vllm`)")

import vllm
from diffharness.findings import failed_load_reclaimed
from diffharness.layouts import Layout
from diffharness.lockstep import Disagreement, run_alone, run_lockstep
from diffharness.spec_side import SpecSide
from diffharness.strategies import traces
from diffharness.trace import (
    ClaimMode,
    ClaimScript,
    EngineSettings,
    LoadScript,
    RequestScript,
    Trace,
)
from diffharness.vllm_side import TraceHMAConnector, VllmSide
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from spec.block_pool import BlockPool

pytestmark = pytest.mark.vllm

HERE = Path(__file__).parent


def _busy_trace() -> Trace:
    """Shared prefixes, a sync and an async claim, a failed load, an abort, a store hold."""
    prefix = tuple(range(1000, 1064))
    return Trace(
        Layout.SLIDING_FULL,
        EngineSettings(28, 64, 3),
        (
            RequestScript("a", 1, (*prefix, *range(5000, 5040)), 3, store_hold=2),
            RequestScript(
                "b",
                1,
                (*prefix, *range(6000, 6100)),
                2,
                claims=(ClaimScript(ClaimMode.ASYNC, 2), ClaimScript(ClaimMode.SYNC, 1)),
                loads=(LoadScript(1, fails=True),),
            ),
            RequestScript("c", 2, tuple(range(7000, 7200)), 2, cache_salt="s", abort_step=4),
        ),
    )


def test_vllm_side_runs_vllms_own_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = Path(vllm.__file__).parent
    assert Path(inspect.getfile(Scheduler)).is_relative_to(wheel)
    repo = HERE.parent.parent
    for ours in (repo / "tests", repo / "spec", repo / "hybridkv"):
        assert not Path(inspect.getfile(Scheduler)).is_relative_to(ours)
    calls = {"schedule": 0, "update_from_output": 0, "allocate_slots": 0}

    def counting(cls: type, name: str) -> None:
        original = getattr(cls, name)

        def wrapper(self: object, *args: object, **kwargs: object) -> object:
            calls[name] += 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    counting(Scheduler, "schedule")
    counting(Scheduler, "update_from_output")
    counting(KVCacheManager, "allocate_slots")
    trace = _busy_trace()
    side = VllmSide(trace)
    assert type(side.scheduler) is Scheduler
    assert isinstance(side.scheduler.kv_cache_manager, KVCacheManager)
    connector = side.scheduler.connector
    assert type(connector) is TraceHMAConnector  # built by vLLM's KVConnectorFactory
    assert isinstance(connector, KVConnectorBase_V1)
    assert isinstance(connector, SupportsHMA)
    result = run_lockstep(trace, SpecSide(trace), side)
    assert result.crash is None
    assert calls["schedule"] == calls["update_from_output"] == result.steps
    assert calls["allocate_slots"] >= 3
    assert all(type(r) is Request for r in side.requests.values())


_SPEC_ONLY = """
import json, sys
sys.modules["vllm"] = None  # importing vLLM (or torch) now fails
sys.modules["torch"] = None
sys.path.insert(0, sys.argv[1])
from diffharness.lockstep import run_alone
from diffharness.spec_side import SpecSide
from test_guard_traces import TRACE
run = run_alone(TRACE, SpecSide(TRACE))
heavy = sorted(m for m, mod in sys.modules.items()
               if mod is not None and m.split(".")[0] in ("vllm", "torch"))
print(json.dumps({"observations": repr(run.observations), "error": repr(run.error),
                  "heavy": heavy}))
"""


def test_spec_side_runs_without_vllm_or_torch(tmp_path: Path) -> None:
    """The spec side, in an interpreter where ``import vllm`` and ``import torch`` fail, gives
    the same observations as here."""
    trace = _busy_trace()
    (tmp_path / "test_guard_traces.py").write_text(
        "from diffharness.layouts import Layout\n"
        "from diffharness.trace import *\n"
        f"TRACE = {trace!r}\n"
    )
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", _SPEC_ONLY, str(HERE)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    here = run_alone(trace, SpecSide(trace))
    assert got["heavy"] == []
    assert got["error"] == repr(here.error) == "None"
    assert got["observations"] == repr(here.observations)
    assert len(here.observations) >= 10


def test_comparison_catches_a_spec_with_a_divergence_on() -> None:
    trace = failed_load_reclaimed(steps=8)
    with pytest.raises(Disagreement, match="r0"):
        run_lockstep(trace, SpecSide(trace, vllm_exact=False), VllmSide(trace))


def test_comparison_catches_a_pool_that_frees_in_the_wrong_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A spec pool that appends freed unhashed blocks (vLLM prepends them) is caught by the
    exact block ids (the patterns alone may still agree)."""
    original = BlockPool.free_blocks

    def backwards(self: BlockPool, ordered_blocks: object) -> None:
        original(self, list(reversed(list(ordered_blocks))))  # type: ignore[call-overload]

    monkeypatch.setattr(BlockPool, "free_blocks", backwards)
    trace = _busy_trace()
    with pytest.raises(Disagreement, match="tables"):
        run_lockstep(trace, SpecSide(trace), VllmSide(trace))


def test_trace_repr_round_trips() -> None:
    """The repr of a trace (shown in failures, written by the subprocess test) rebuilds it."""
    import diffharness.trace as trace_module
    from hypothesis import given, settings

    namespace = {**vars(trace_module), "Layout": Layout}

    @settings(max_examples=20)
    @given(traces(Layout.MAMBA_FULL))
    def check(trace: Trace) -> None:
        assert eval(repr(trace), namespace) == trace

    check()
