"""``hybridkv simulate``: the report, its stability, faults, replayed traces, bad input, and
proof that content verification catches wrong data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridkv.cli.main import main
from hybridkv.simulator import reference as sim_reference
from hybridkv.simulator.run import SimOptions, simulate
from hybridkv.testbed.trace import TraceRequest, dump_trace
from hybridkv.transfer import Direction, TransferPair

REQUIRED_KEYS = {
    "wrong_content_loads",
    "invariant_violations",
    "prefill_tokens_computed",
    "prefill_tokens_loaded",
    "bytes_loaded",
    "bytes_stored",
    "failures_injected",
    "failures_recovered",
}
TIMING = {"seconds", "load_gbps", "store_gbps"}
SMALL = ["simulate", "--requests", "8"]


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_default_workload_report(capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _json(capsys, *SMALL)
    assert code == 0
    assert set(report) >= REQUIRED_KEYS | TIMING | {"setup", "finished", "verdict", "hit_rate"}
    assert report["verdict"] == "pass"
    assert report["finished"] == {"finished_length": 8}
    assert report["wrong_content_loads"] == report["wrong_content_reads"] == 0
    # Every prompt token is computed, hit on the GPU or loaded from the host.
    total = (
        report["prefill_tokens_computed"]
        + report["local_hit_tokens"]
        + report["prefill_tokens_loaded"]
    )
    assert total == report["prompt_tokens"]
    # Turns 2..4 of each conversation reuse the turn before: something is reused.
    assert report["local_hit_tokens"] + report["prefill_tokens_loaded"] > 0
    assert report["bytes_stored"] > 0
    assert report["blocks_verified"] > 0
    assert report["setup"]["groups"] == ["mamba", "mamba", "mamba", "full"]


def test_runs_are_deterministic(capsys: pytest.CaptureFixture[str]) -> None:
    first = _json(capsys, *SMALL, "--faults", "0.1")[1]
    second = _json(capsys, *SMALL, "--faults", "0.1")[1]
    for report in (first, second):
        for key in TIMING:
            report.pop(key)
    assert first == second


def test_faults_are_injected_and_recovered_with_no_wrong_data(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, report = _json(capsys, *SMALL, "--faults", "0.3", "--check")
    assert code == 0
    assert report["failures_injected"] > 0
    assert report["failures_recovered"] > 0
    assert report["wrong_content_loads"] == 0
    assert report["invariant_checks"] > 0
    assert report["invariant_violations"] == 0
    assert set(report["finished"]) <= {"finished_length"}


def test_offload_under_gpu_pressure_loads_from_the_host() -> None:
    report = simulate(SimOptions(requests=12))
    assert report["prefill_tokens_loaded"] > 0
    assert report["bytes_loaded"] > 0
    assert report["wrong_content_loads"] == 0


def test_a_jsonl_trace_replays_conversations(tmp_path: Path) -> None:
    system = tuple(range(1, 1700))  # two 832-token chunks and a tail
    trace = [
        TraceRequest(0, (*system, 5, 6, 7), 40, conversation="a"),
        TraceRequest(0, (8, 9, 10), 40, conversation="a"),
        TraceRequest(1, (*system, 11), 8),
    ]
    path = tmp_path / "t.jsonl"
    path.write_text(dump_trace(trace))
    report = simulate(SimOptions(trace=str(path)))
    assert report["requests"] == 3
    assert report["finished"] == {"finished_length": 3}
    # The second turn's prompt is the first turn's prompt and answer plus its message.
    assert report["prompt_tokens"] == (1702 + (1702 + 40 + 3) + 1700)
    assert report["continuation_turns"] == 1
    assert report["verdict"] == "pass"


def test_human_output_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "run.png"
    assert main([*SMALL, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    for phrase in (
        "computed (first time)",
        "(holds)",
        "wrong-content loads",
        "GB/s",
        "verdict: pass",
    ):
        assert phrase in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--host-bytes", "lots"], "--host-bytes"),
        (["--host-bytes", "100"], "--host-bytes"),
        (["--faults", "2"], "--faults"),
        (["--trace", "chat"], "--trace"),
        (["--trace", "missing.jsonl"], "--trace"),
        (["--requests", "0"], "--requests"),
        (["--gpu-blocks", "4"], "--gpu-blocks"),
        (["--max-model-len", "1000"], "--max-model-len"),
        (["--plot", "run.jpg"], "--plot"),
        (["--layers-per-group", "0"], "--layers-per-group"),
        (["--preset", "llama"], "preset"),
    ],
)
def test_bad_input_exits_2_naming_the_field(
    capsys: pytest.CaptureFixture[str], argv: list[str], field: str
) -> None:
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridkv simulate: error:")
    assert field in err
    assert len(err.strip().splitlines()) == 1


def test_cuda_without_a_gpu_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the refusal cannot be shown here")
    assert main(["simulate", "--device", "cuda"]) == 2
    assert "--device" in capsys.readouterr().err


class _SwappedLoads(sim_reference.ReferencePlane):
    """A data plane that copies each load's pairs into each other's blocks (a mapping bug)."""

    def start_load_kv(self) -> None:
        for job in self._meta.load_jobs:
            pairs = [TransferPair(i.group_idx, i.block_id, self._slot(i.key)) for i in job.items]
            if len(pairs) > 1:
                blocks = [p.block for p in pairs]
                pairs = [p._replace(block=b) for p, b in zip(pairs, blocks[::-1], strict=True)]
            self._submit(job, Direction.LOAD, pairs)


def test_verification_catches_a_plane_that_loads_into_the_wrong_blocks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sim_reference, "ReferencePlane", _SwappedLoads)
    code, report = _json(capsys, "simulate", "--connector", "reference", "--requests", "12")
    assert report["prefill_tokens_loaded"] > 0
    assert report["wrong_content_loads"] > 0
    assert report["verdict"] == "fail"
    assert code == 1


def _swap_pairs(original: Any) -> Any:
    def swapped(self: Any, job: Any) -> list[TransferPair]:
        pairs: list[TransferPair] = original(self, job)
        if job.kind.value == "load" and len(pairs) > 1:
            blocks = [p.block for p in pairs][::-1]
            pairs = [p._replace(block=b) for p, b in zip(pairs, blocks, strict=True)]
        return pairs

    return swapped


def test_verification_catches_the_optimized_worker_loading_into_the_wrong_blocks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hybridkv.connector.worker import TransferWorker

    monkeypatch.setattr(TransferWorker, "_pairs", _swap_pairs(TransferWorker._pairs))
    code, report = _json(capsys, "simulate", "--requests", "12")
    assert report["setup"]["connector"] == "optimized"
    assert report["wrong_content_loads"] > 0
    assert (code, report["verdict"]) == (1, "fail")
