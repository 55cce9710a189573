"""The copy-time model of a ``hybridkv simulate`` run and its part of the report.

The model (:class:`hybridkv.testbed.copy_time.CopyTimeModel`) comes from the flags
``--transfer-gbps``, ``--transfer-latency-us`` and ``--step-ms``, and scales the bytes the
simulation copies up to the model's (the simulation keeps ``--layers-per-group`` of the model's
layers per group). The report's ``transfers`` section gives the model and what its timing made
happen (:class:`hybridkv.simulator.transfers.TransferCounts`); :func:`rows` renders it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from hybridkv.simulator.setup import SimSetup
from hybridkv.simulator.transfers import TransferCounts
from hybridkv.testbed.copy_time import CopyTimeModel

__all__ = ["copy_time_model", "rows", "transfer_report"]


class _TimingOptions(Protocol):
    """The flags of :class:`hybridkv.simulator.run.SimOptions` this module reads."""

    @property
    def transfer_gbps(self) -> float: ...

    @property
    def transfer_latency_us(self) -> float: ...

    @property
    def step_ms(self) -> float: ...

    @property
    def aborts(self) -> float: ...


def copy_time_model(options: _TimingOptions, setup: SimSetup) -> CopyTimeModel:
    """The run's model. Refusal: a flag out of range raises HybridKVConfigError naming it."""
    return CopyTimeModel(
        options.transfer_gbps,
        options.transfer_latency_us,
        options.step_ms,
        setup.layout_layers / setup.layers_per_group,
    )


def transfer_report(
    model: CopyTimeModel, options: _TimingOptions, counts: TransferCounts
) -> dict[str, Any]:
    """The report's ``transfers`` section: the model, the abort rate, the counts."""
    return {
        "gbps": model.gbps,
        "latency_us": model.latency_us,
        "step_ms": model.step_ms,
        "byte_scale": round(model.byte_scale, 6),
        "aborts_rate": options.aborts,
        **counts.as_dict(),
    }


def rows(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(label, value)`` rows of the summary table for the ``transfers`` section."""
    t = report["transfers"]
    return [
        (
            "copy-time model",
            f"{t['gbps']:g} GB/s, {t['latency_us']:g} us/job, {t['step_ms']:g} ms/step, "
            f"x{t['byte_scale']:g} bytes",
        ),
        (
            "loads that spanned steps",
            f"{t['load_jobs_spanning_steps']} jobs (longest {t['longest_load_steps']} steps)",
        ),
        ("load deadlines fired", str(t["deadlines_fired"])),
        (
            "preemptions during loads",
            f"{t['preemptions_during_loads']} "
            f"({t['preemptions_of_loading_requests']} of a request with its own load)",
        ),
        ("aborts during load", f"{t['aborts_during_load']} of {t['aborts']} aborts"),
        (
            "wrong-content stores",
            f"{t['wrong_content_stores']} of {t['store_blocks_verified']:,} source blocks",
        ),
    ]
