"""``hybridkv simulate --plot FILE.png``: hits, loads and host occupancy over the run.

matplotlib is an optional dependency (``pip install hybridkv[plot]``); without it the flag is
refused with that fix, before the run starts (:func:`require_matplotlib`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridkv.errors import HybridKVConfigError

__all__ = ["plot", "require_matplotlib"]


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


def plot(report: Mapping[str, Any], path: str) -> None:
    """Draw the report's timeline into ``path`` (three panels sharing the step axis)."""
    require_matplotlib(path)
    import matplotlib

    matplotlib.use("Agg")  # no display: render to a file
    import matplotlib.pyplot as plt

    timeline = report["timeline"]
    steps = [s["step"] for s in timeline]
    gpu_hits, host_hits, hit_total, loaded_total = [], [], 0, 0
    for s in timeline:  # cumulative: a run's story reads better than per-step spikes
        hit_total += s["hit_tokens"]
        loaded_total += s["loaded_tokens"]
        gpu_hits.append((hit_total - loaded_total) / 1000)
        host_hits.append(loaded_total / 1000)
    moved = [s["bytes_loaded"] / 2**30 for s in timeline]  # already cumulative
    occupancy = [
        100 * s["host_used"] / s["host_capacity"] if s["host_capacity"] else 0 for s in timeline
    ]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    axes[0].plot(steps, host_hits, label="loaded from host")
    axes[0].plot(steps, gpu_hits, label="hit in the GPU prefix cache")
    axes[0].set_ylabel("prompt tokens hit (k)")
    axes[0].legend(loc="upper left")
    axes[1].plot(steps, moved, color="tab:green")
    axes[1].set_ylabel("GiB loaded")
    axes[2].plot(steps, occupancy, color="tab:red")
    axes[2].set_ylabel("host occupancy %")
    axes[2].set_ylim(0, 105)
    axes[2].set_xlabel("scheduler step")
    setup = report["setup"]
    fig.suptitle(f"hybridkv simulate: {setup['model']}, trace {setup['trace']}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
