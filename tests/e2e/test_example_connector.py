"""examples/hma_offload in vLLM's real model runner (vLLM's CPU build), in this process.

The tiny Gemma-3-like model (sliding window + full attention, float32) serves the chats of
``_workload`` with the example connector configured by the JSON of the tutorial
(docs/tutorial/build-a-connector.md, read from the page), and every greedy answer must equal the
no-connector baseline's while vLLM counts tokens supplied by the connector. The control runs the
same connector with loads that copy nothing: it must change an answer, so equal answers are not
an accident of recomputation.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import _baselines
import _counters
import _llm
import _verdict
import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorial" / "build-a-connector.md"
MODEL = "gemma3"  # sliding window + full attention: two KV cache groups

# examples/ is not in the wheel: it is found in the checkout, after the installed hybridkv.
if str(ROOT) not in sys.path:  # appended: a regular package there wins over a namespace one
    sys.path.append(str(ROOT))


def tutorial_config() -> dict[str, Any]:
    """The ``--kv-transfer-config`` JSON of the tutorial's ``vllm serve`` line."""
    for line in TUTORIAL.read_text().splitlines():
        if line.startswith("vllm serve "):
            flags = shlex.split(line)
            config: dict[str, Any] = json.loads(flags[flags.index("--kv-transfer-config") + 1])
            return config
    raise AssertionError(f"{TUTORIAL} has no line starting with `vllm serve `")


def test_example_connector_answers_match_baseline(
    model_root: Path, e2e_report: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from examples.hma_offload import worker

    assert Path(worker.__file__).resolve().is_relative_to(ROOT), "another `examples` package"
    model = _baselines.model(MODEL, model_root)
    base = _baselines.baseline(MODEL, model_root)
    config = tutorial_config()
    assert config["kv_connector_module_path"] == "examples.hma_offload"

    run = _llm.run(model, config, base.transcript)
    held = _verdict.answers_hold(MODEL, model_root, run)
    hits = run.counters[_counters.EXTERNAL_HITS]
    assert hits > 0, "vLLM took no token from the example connector"

    real = worker.OffloadWorker.run

    def loads_copy_nothing(self: worker.OffloadWorker, jobs: Any) -> None:
        if jobs and jobs[0].kind is worker.JobKind.LOAD:
            self._results.extend((job.job_id, True) for job in jobs)
            return
        real(self, jobs)

    monkeypatch.setattr(worker.OffloadWorker, "run", loads_copy_nothing)
    control = _llm.run(model, config, base.transcript)
    assert control.counters[_counters.EXTERNAL_HITS] > 0, "the control loaded nothing"
    failed = _verdict.control_fails(MODEL, model_root, control)
    e2e_report.append(f"example    {MODEL:8} {held}; loaded {hits:.0f} tokens; {failed}")
