"""``hybridkv simulate`` with the optimized core and with the spec's reference connector: the
same trace, faults and seed give the same report, count for count (only timing differs).

This is the end-to-end differential test of the optimized path: scheduler-side claims and jobs
(the core vs :class:`spec.connector.ReferenceConnector`), host stores (optimized vs spec), and
the bytes both planes move through the transfer engine, verified against recomputation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from hybridkv.simulator.run import SimOptions, simulate

TIMING = ("seconds", "load_gbps", "store_gbps")


def _counts(report: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in report.items() if k not in TIMING}
    out["setup"] = {k: v for k, v in report["setup"].items() if k != "connector"}
    return out


@pytest.mark.parametrize(
    "options",
    [
        SimOptions(requests=12),
        SimOptions(requests=12, faults=0.2, policy="arc", host_bytes=256 * 2**20),
        SimOptions(requests=10, trace="shared-prefix", faults=0.1, check=True),
        SimOptions(preset="gpt-oss-20b", requests=6, faults=0.1),
    ],
    ids=["multi-turn", "faults-arc-small-host", "shared-prefix-check", "gpt-oss-sliding"],
)
def test_optimized_and_reference_connectors_report_the_same(options: SimOptions) -> None:
    fast = simulate(options)
    ref = simulate(dataclasses.replace(options, connector="reference"))
    assert fast["setup"]["connector"] == "optimized"
    assert _counts(fast) == _counts(ref)
    assert fast["verdict"] == "pass"
    assert fast["wrong_content_loads"] == fast["wrong_content_reads"] == 0
    assert fast["blocks_verified"] > 0
    assert fast["prefill_tokens_loaded"] >= 0
