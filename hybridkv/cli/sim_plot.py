"""``hybridkv simulate --plot FILE.png``: tokens served, bytes loaded, host occupancy, failures.

matplotlib is an optional dependency (``pip install hybridkv[plot]``); without it the flag is
refused with that fix, before the run starts (:func:`require_matplotlib`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

from hybridkv.errors import HybridKVConfigError

__all__ = ["PlotSeries", "plot", "plot_series", "require_matplotlib"]


def require_matplotlib(path: str) -> None:
    """Refuse ``--plot`` early when matplotlib is missing or the file is not a .png."""
    if not path.lower().endswith(".png"):
        raise HybridKVConfigError("--plot", path, "is not a .png file name", "pass e.g. run.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise HybridKVConfigError(
            "--plot", path, "needs matplotlib, which is not installed", "pip install hybridkv[plot]"
        ) from None


@dataclass(frozen=True, slots=True)
class PlotSeries:
    """What ``--plot`` draws, as data (tests compare it with the table).

    Token series are cumulative prompt tokens first served by each source, so their last
    values are the table's ``computed``, ``loaded from host`` and ``hit on GPU``; a load
    counts when its job lands. ``*_failure_steps`` list the steps that reported failed
    jobs, a step once per failed job.
    """

    steps: tuple[int, ...]
    loaded: tuple[int, ...]
    gpu_hit: tuple[int, ...]
    computed: tuple[int, ...]
    bytes_loaded: tuple[int, ...]
    occupancy_pct: tuple[float, ...]
    load_failure_steps: tuple[int, ...]
    store_failure_steps: tuple[int, ...]


def plot_series(report: Mapping[str, Any]) -> PlotSeries:
    """The series :func:`plot` draws from the report's timeline. Pure."""
    timeline = report["timeline"]
    return PlotSeries(
        steps=tuple(s["step"] for s in timeline),
        loaded=_cumulative(s["loaded_tokens"] for s in timeline),
        gpu_hit=_cumulative(s["hit_tokens"] for s in timeline),
        computed=_cumulative(s["computed_tokens"] for s in timeline),
        bytes_loaded=tuple(s["bytes_loaded"] for s in timeline),  # already cumulative
        occupancy_pct=tuple(
            100 * s["host_used"] / s["host_capacity"] if s["host_capacity"] else 0.0
            for s in timeline
        ),
        load_failure_steps=tuple(s["step"] for s in timeline for _ in range(s["failed_loads"])),
        store_failure_steps=tuple(s["step"] for s in timeline for _ in range(s["failed_stores"])),
    )


def _cumulative(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(accumulate(values))


def plot(report: Mapping[str, Any], path: str) -> None:
    """Draw the report's timeline into ``path`` (three panels sharing the step axis; failed
    jobs marked on every panel)."""
    require_matplotlib(path)
    import matplotlib

    matplotlib.use("Agg")  # no display: render to a file
    import matplotlib.pyplot as plt

    series = plot_series(report)
    steps = series.steps
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    # Cumulative: a run's story reads better than per-step spikes.
    axes[0].plot(steps, [t / 1000 for t in series.loaded], label="loaded from host")
    axes[0].plot(steps, [t / 1000 for t in series.gpu_hit], label="hit in the GPU prefix cache")
    axes[0].plot(steps, [t / 1000 for t in series.computed], label="computed")
    axes[0].set_ylabel("prompt tokens, first time (k)")
    axes[1].plot(steps, [b / 2**30 for b in series.bytes_loaded], color="tab:green")
    axes[1].set_ylabel("GiB loaded")
    axes[2].plot(steps, series.occupancy_pct, color="tab:red")
    axes[2].set_ylabel("host occupancy %")
    axes[2].set_ylim(0, 105)
    axes[2].set_xlabel("scheduler step")
    _mark_failures(axes, series)
    axes[0].legend(loc="upper left")
    setup = report["setup"]
    fig.suptitle(
        f"hybridkv simulate: {setup['model']}, trace {setup['trace']}, faults {setup['faults']}"
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mark_failures(axes: Any, series: PlotSeries) -> None:
    """A vertical line per step that reported a failed load (solid) or store (dotted)."""
    marks = (
        (sorted(set(series.load_failure_steps)), "-", "tab:red", "failed load"),
        (sorted(set(series.store_failure_steps)), ":", "tab:orange", "failed store"),
    )
    for steps, style, colour, label in marks:
        for ax in axes:
            for i, step in enumerate(steps):
                first = ax is axes[0] and i == 0
                ax.axvline(
                    step,
                    color=colour,
                    linestyle=style,
                    linewidth=0.6,
                    alpha=0.7,
                    label=label if first else None,
                )
