"""``hybridkv simulate --engine vllm`` without vLLM: the one-line errors, the flags it refuses,
the model it would build, and the report's rows and verdict (the run itself: tests/vllm).

vLLM is made missing by patching ``importlib.import_module`` (the only way the CLI imports it),
so these tests mean the same whether or not this Python has vLLM.
"""

from __future__ import annotations

import importlib
import io
import json
import types
from contextlib import redirect_stdout
from enum import Enum
from pathlib import Path
from typing import Any

import pytest

from hybridkv.cli.main import main
from hybridkv.cli.sim_vllm_report import render, rows
from hybridkv.simulator import on_vllm as sim_vllm
from hybridkv.simulator.run import SimOptions
from hybridkv.simulator.vllm_report import NOT_OBSERVED, build_report


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _without(monkeypatch: pytest.MonkeyPatch, missing: str, found: Any = None) -> None:
    real = importlib.import_module

    def import_module(name: str, package: str | None = None) -> Any:
        if name == missing:
            if found is None:
                raise ImportError(f"No module named {name!r}")
            return found
        if name == "vllm":  # vLLM present but beside it something fails
            return types.SimpleNamespace(__version__="0.33.0")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", import_module)


def test_without_vllm_one_line_names_nox_and_the_install(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _without(monkeypatch, "vllm")
    err = _error(capsys, ["simulate", "--engine", "vllm"])
    assert err.startswith("hybridkv simulate: error: --engine='vllm'")
    assert "vLLM 0.33 is not installed" in err
    assert "nox -s vllm" in err
    assert sim_vllm.VLLM_INSTALL in err


def test_another_vllm_version_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _without(monkeypatch, "vllm", types.SimpleNamespace(__version__="0.10.1"))
    err = _error(capsys, ["simulate", "--engine", "vllm"])
    assert "needs vLLM 0.33, this Python has 0.10.1" in err
    assert "nox -s vllm" in err


def test_a_torchvision_that_cannot_import_is_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.import_module

    def import_module(name: str, package: str | None = None) -> Any:
        if name == "vllm":
            return types.SimpleNamespace(__version__="0.33.0")
        if name == "torchvision":
            raise RuntimeError("operator torchvision::nms does not exist")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", import_module)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    err = _error(capsys, ["simulate", "--engine", "vllm"])
    assert "torchvision" in err
    assert "tests/vllm/_torchvision_shim" in err


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--connector", "reference"], "--connector='reference'"),
        (["--device", "cuda"], "--device='cuda'"),
        (["--check"], "--check=True"),
        (["--aborts", "0.1"], "--aborts=0.1"),
        (["--transfer-gbps", "3"], "--transfer-gbps=3.0"),
        (["--transfer-latency-us", "1"], "--transfer-latency-us=1.0"),
        (["--step-ms", "1"], "--step-ms=1.0"),
        (["--plot", "x.png"], "--plot='x.png'"),
        (["--faults", "2"], "--faults=2.0"),
    ],
)
def test_flags_the_vllm_engine_cannot_honour(
    capsys: pytest.CaptureFixture[str], flags: list[str], field: str
) -> None:
    err = _error(capsys, ["simulate", "--engine", "vllm", *flags])
    assert f"error: {field}:" in err


def test_pool_and_length_are_checked_before_vllm_is_needed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _without(monkeypatch, "vllm")
    err = _error(capsys, ["simulate", "--engine", "vllm", "--gpu-blocks", "3"])
    assert "--gpu-blocks=3: cannot hold the trace's longest sequence" in err
    assert "(5389 tokens needs 13 blocks besides vLLM's null block)" in err  # 3 x 2 + 7 of 896
    assert "pass --gpu-blocks 14 or more" in err
    err = _error(capsys, ["simulate", "--engine", "vllm", "--gpu-blocks", "1000000000"])
    assert "--gpu-blocks=1000000000: the run would allocate" in err
    err = _error(capsys, ["simulate", "--engine", "vllm", "--max-model-len", "1000"])
    assert "--max-model-len=1000: is shorter than the trace's longest sequence" in err


def test_the_default_preset_becomes_its_tiny_text_model() -> None:
    source, cfg, changed = sim_vllm.vllm_model(None, None, 1)
    assert source == "preset:qwen3.5-27b"
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"]
    assert cfg["num_hidden_layers"] == 4
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert changed == "4 of its 64 layers (same groups, blocks and pages), its text model"
    _, cfg, changed = sim_vllm.vllm_model("gpt-oss-20b", None, 2)
    assert cfg["num_hidden_layers"] == 8
    assert changed.startswith("8 of its 24 layers")


def test_a_config_file_is_used_as_given(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"architectures": ["X"], "num_hidden_layers": 2}')
    source, cfg, changed = sim_vllm.vllm_model(None, str(path), 1)
    assert (source, cfg, changed) == (
        str(path),
        {"architectures": ["X"], "num_hidden_layers": 2},
        "as given",
    )


# ------------------------------------------------------------------ the report


class _Source(Enum):
    COMPUTED = "computed"
    LOADED = "loaded"
    HIT = "hit"


class _Cause(Enum):
    FAILURE = "failure"
    PREEMPTION = "preemption"
    REPLAY = "replay"


def _run(**changes: Any) -> types.SimpleNamespace:
    """A run's observations in the shape of :class:`hybridkv.vllm.harness.workload.WorkloadRun`."""
    run = types.SimpleNamespace(
        requests=2,
        finished={"finished_length_capped": 2},
        steps=40,
        prompt_tokens=3000,
        first={_Source.COMPUTED: 1200, _Source.LOADED: 896, _Source.HIT: 904},
        again={(_Cause.PREEMPTION, _Source.HIT): 5},
        unaccounted_reads=0,
        tokens_discarded_by_recovery=0,
        continuation_turns=1,
        continuation_hits=1,
        continuation_hit_tokens=64,
        preemptions=0,
        failed_load_requests=0,
        failed_load_requests_finished=0,
        vllm_local_hits=904,
        vllm_external_hits=896,
        external_tokens_handed=896,
    )
    for name, value in changes.items():
        setattr(run, name, value)
    return run


_OBSERVED = {
    "block_size": 896,
    "chunk_size": 896,
    "host_entries": 10,
    "slot_bytes": 1000,
    "load_jobs": 1,
    "store_jobs": 2,
    "load_jobs_failed": 0,
    "store_jobs_failed": 0,
    "jobs_in_flight": 0,
    "held_blocks": 0,
    "bytes_loaded": 2048,
    "bytes_stored": 3 << 20,
    "load_faults": 0,
    "store_faults": 0,
    "slots_checked": 12345,
    "wrong_reads": 0,
    "wrong_reads_by_request": {},
    "ended_requests": [],
    "watched_failed_loads": 0,
    "watched_failed_stores": 0,
    "recovered_loads": 0,
    "recovered_stores": 0,
    "failures_ended": 0,
    "leaked_blocks": 0,
    "schedule_us": 900.0,
    "connector_us": 250.0,
}
# Two loads and a store failed (all injected), each seen to recover.
_FAILED = {
    "load_faults": 2,
    "store_faults": 1,
    "load_jobs_failed": 2,
    "store_jobs_failed": 1,
    "watched_failed_loads": 2,
    "watched_failed_stores": 1,
    "recovered_loads": 2,
    "recovered_stores": 1,
}
_SETUP = {
    "model": "preset:qwen3.5-27b",
    "model_changed": "4 of its 64 layers",
    "groups": ["mamba", "full"],
    "gpu_blocks": 36,
    "max_model_len": 4694,
    "build_seconds": 2.0,
}


def _report(run: Any, **observed: Any) -> dict[str, Any]:
    return build_report(SimOptions(), _SETUP, run, {**_OBSERVED, **observed}, 1.5)


def test_report_identity_stats_and_verdict() -> None:
    report = _report(_run())
    assert report["identity_holds"]
    assert report["vllm"]["prefill_stats_agree"] is True
    assert report["served_again"]["preemption"] == {"computed": 0, "loaded": 0, "hit": 5}
    assert report["hit_rate"] == round(1800 / 3000, 4)
    assert report["verdict"] == "pass"
    assert report["load_gbps"] is None
    assert report["wrong_content_loads"] is None
    table = dict(rows(report))
    assert table["identity (below)"] == "holds"
    assert table["vLLM PrefillStats vs the ledger"] == "agree (local 904, external 896)"
    assert table["loaded (host -> GPU)"] == "2.00 KiB in 1 jobs"
    assert table["stored (GPU -> host)"] == "3.00 MiB in 2 jobs"
    assert table["invariant checks run"].startswith(NOT_OBSERVED)
    out = io.StringIO()
    with redirect_stdout(out):
        render(report)
    text = out.getvalue()
    assert "prompt = computed + loaded + GPU hit: 3,000 = 1,200 + 896 + 904 (holds)" in text
    assert "verdict: pass" in text


@pytest.mark.parametrize(
    ("run", "observed"),
    [
        (_run(prompt_tokens=3001), {}),  # identity broken
        (_run(vllm_local_hits=903), {}),  # disagrees with vLLM's PrefillStats
        (_run(), {"wrong_reads": 1}),
        (_run(unaccounted_reads=2), {}),
        (_run(), {"leaked_blocks": 1}),
        (_run(), {"jobs_in_flight": 1}),
        (_run(failed_load_requests=1), {}),  # its request did not finish after recompute
        (_run(finished={"finished_aborted": 2}), {}),
        (_run(), {**_FAILED, "recovered_loads": 1}),  # a failed load not seen to recover
        (_run(), {**_FAILED, "recovered_stores": 0}),  # a failed store not seen to recover
        (_run(), {**_FAILED, "load_jobs_failed": 1}),  # vLLM's reports and the core disagree
        (_run(), {**_FAILED, "store_faults": 2}),  # an injected fault no report showed
    ],
)
def test_report_fails_on_each_broken_check(run: Any, observed: dict[str, Any]) -> None:
    assert _report(run, **observed)["verdict"] == "fail"


def test_failures_recovered_are_counted_and_shown() -> None:
    report = _report(_run(), **_FAILED)
    assert report["verdict"] == "pass"
    assert (report["failures_injected"], report["failures_recovered"]) == (3, 3)
    table = dict(rows(report))
    assert table["failures injected / recovered"] == "3 / 3"
    assert table["failed jobs reported: loads / stores"] == "2 / 1"
    assert table["recovered: loads / stores"] == "2 / 1"
    assert table["failures ended with their request"] == "0"


def test_tokens_served_again_in_place_get_their_own_row() -> None:
    """The spec engine's rule: the in-place row shows only when something was served again
    with neither a failure nor a preemption observed before it."""
    plain = dict(rows(_report(_run())))
    assert "recomputed/reloaded/hit while in place" not in plain
    report = _report(_run(again={(_Cause.REPLAY, _Source.HIT): 3}))
    assert dict(rows(report))["recomputed/reloaded/hit while in place"] == "0 / 0 / 3"


def test_stats_not_comparable_after_preemption() -> None:
    report = _report(_run(preemptions=1, vllm_local_hits=0))
    assert report["vllm"]["prefill_stats_agree"] is None
    assert report["verdict"] == "pass"
    assert dict(rows(report))["vLLM PrefillStats vs the ledger"].startswith("not comparable")


def test_the_flags_reach_vllms_engine_and_its_observations_the_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wiring after the vLLM check, with :mod:`hybridkv.vllm.harness.workload` replaced by a
    recorder (the real run: tests/vllm/test_simulate_vllm.py)."""
    seen: dict[str, Any] = {}

    class Engine:
        def __init__(self, **kwargs: Any) -> None:
            seen["engine"] = kwargs

        def build(self, cfg: dict[str, Any]) -> str:
            seen["cfg"] = cfg
            return "engine"

    def play_workload(engine: str, trace: Any, *, max_ticks: int, watch: Any) -> Any:
        seen["played"] = (engine, len(trace), max_ticks)
        return _run(requests=len(trace))

    stand_in = types.SimpleNamespace(
        WorkloadEngine=Engine, play_workload=play_workload, end_state=lambda e: _OBSERVED
    )
    real = importlib.import_module
    monkeypatch.setattr(sim_vllm, "require_vllm", lambda: None)
    monkeypatch.setattr(
        importlib,
        "import_module",
        lambda name, package=None: (
            stand_in if name == "hybridkv.vllm.harness.workload" else real(name, package)
        ),
    )
    options = SimOptions(engine="vllm", policy="arc", faults=0.25, seed=7, host_bytes=1 << 28)
    report = sim_vllm.simulate_vllm(options)
    assert seen["engine"] == {
        "num_gpu_blocks": 39,  # three of the longest sequence's 13 blocks
        "max_model_len": 5389,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 2048,
        "host_bytes": 1 << 28,
        "policy": "arc",
        "fault_rate": 0.25,
        "seed": 7,
    }
    assert seen["cfg"]["architectures"] == ["Qwen3_5ForCausalLM"]
    trace = _default_trace()
    assert seen["played"] == ("engine", 48, 1_000_000 + max(r.arrival_step for r in trace))
    assert report["setup"]["gpu_blocks"] == 39
    assert report["setup"]["groups"] == ["mamba", "mamba", "mamba", "full"]
    assert report["requests"] == 48
    assert report["failures_recovered"] == 0  # the watch saw no failed job


def _default_trace() -> Any:
    from hybridkv.testbed.workloads import builtin_workload

    return builtin_workload("multi-turn", sim_vllm.DEFAULT_REQUESTS)


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_main_prints_the_vllm_report_and_exits_by_its_verdict(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, as_json: bool
) -> None:
    for run, code in ((_run(), 0), (_run(unaccounted_reads=1), 1)):
        report = _report(run)
        monkeypatch.setattr(sim_vllm, "simulate_vllm", lambda options, plot, r=report: r)
        argv = ["simulate", "--engine", "vllm", *(["--json"] if as_json else [])]
        assert main(argv) == code
        out = capsys.readouterr().out
        if as_json:
            assert json.loads(out) == report
        else:
            assert f"verdict: {report['verdict']}" in out
