"""The hybrid layouts of the differential tests, each built from a project preset: the four
the random traces run on (:data:`RANDOM_TRACE_LAYOUTS`) and two for the regression replay.

A recipe names a preset of :mod:`spec.presets`, how many of its layers to keep
(:func:`spec.presets.tiny_config`), an optional ``layer_types`` override, the user's
``--block-size`` and ``max_model_len``. The vLLM side writes the config.json and lets vLLM's own
code derive the KV cache groups (:mod:`diffharness.vllm_side`); the spec side derives them with
:func:`spec.layout.derive_layout` for the same platform; the harness checks the two agree before
any trace runs.

The platform is vLLM's real ``CpuPlatform`` (the machine the tests run on), with the host ISA
answer pinned (no AVX-512 BF16) so the mamba state dtype, and with it the block size, does not
depend on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from spec.kinds import GroupKind
from spec.layout import Layout as SpecLayout
from spec.layout import LayoutSettings, derive_layout, model_from_config
from spec.managers import GroupSpec
from spec.presets import tiny_config

__all__ = ["PLATFORM", "RANDOM_TRACE_LAYOUTS", "RECIPES", "Layout", "LayoutRecipe"]

PLATFORM = "cpu"
"""The platform both sides derive geometry for (vLLM's CpuPlatform, no AVX-512 BF16)."""


class Layout(Enum):
    """The layouts the issue asks for: (a) mamba align + full, (b) sliding + full, (c) three
    groups (two windows + full), (d) one full-attention group as the control; and two that
    replay ``tests/regressions`` scenarios with their group structure (one mamba group and one
    full-attention group; a window of two blocks), see :data:`RANDOM_TRACE_LAYOUTS`."""

    def __repr__(self) -> str:
        return f"Layout.{self.name}"

    MAMBA_FULL = "mamba+full"
    SLIDING_FULL = "sliding+full"
    THREE_GROUPS = "2sliding+full"
    FULL_ONLY = "full"
    ONE_MAMBA_FULL = "1mamba+full"
    SHORT_SLIDING_FULL = "sliding64+full"


@dataclass(frozen=True, slots=True)
class LayoutRecipe:
    """How a layout is made from a preset.

    Attributes:
        layout: which layout this is.
        preset: the :data:`spec.presets.PRESETS` name.
        num_layers: layers kept (:func:`spec.presets.tiny_config`).
        layer_types: a ``layer_types`` override (``None``: the preset's own pattern).
        block_size: the user's ``--block-size`` (``None``: the platform's choice).
        max_model_len: ``--max-model-len``; small, so a handful of blocks serves a request.
        min_num_blocks: the smallest pool vLLM accepts for it with any budget up to 4 claim
            units (see :meth:`min_blocks`).
        description: one line for reports.
    """

    layout: Layout
    preset: str
    num_layers: int
    layer_types: tuple[str, ...] | None
    block_size: int | None
    max_model_len: int
    min_num_blocks: int
    description: str

    def config_json(self) -> dict[str, Any]:
        """The config.json both sides build the model from (no weights, no hub)."""
        cfg = tiny_config(self.preset, self.num_layers)
        if self.layer_types is not None:
            cfg["layer_types"] = list(self.layer_types)
        return cfg

    def spec_layout(self) -> SpecLayout:
        """The geometry :mod:`spec.layout` derives for it."""
        settings = LayoutSettings(
            max_model_len=self.max_model_len, block_size=self.block_size, platform=PLATFORM
        )
        return derive_layout(model_from_config(self.config_json()), settings)

    def spec_groups(self) -> tuple[GroupSpec, ...]:
        """The groups as the scheduler model takes them (kind, block size, window)."""
        groups = []
        for g in self.spec_layout().groups:
            window = g.sliding_window if g.kind is GroupKind.SLIDING else 0
            extra = g.extra_retained_tokens if g.kind is GroupKind.SLIDING else 0
            groups.append(
                GroupSpec(
                    g.kind,
                    g.block_size,
                    sliding_window=window or 0,
                    extra_retained_tokens=extra or 0,
                )
            )
        return tuple(groups)

    def min_blocks(self, max_num_batched_tokens: int, max_model_len: int | None = None) -> int:
        """The smallest pool vLLM's start-up check accepts with this budget.

        ``_check_enough_kv_cache_memory`` (``v1/core/kv_cache_planning.py:60-80``) asks for one
        ``max_model_len`` request's worth of every group (``max_memory_usage_bytes``,
        ``v1/kv_cache_interface.py``): full attention ``cdiv(max_model_len, block)``; a sliding
        window its admission cap ``cdiv(min(window - 1 + budget, max_model_len), block) + 1``
        (918-944; the in-flight tokens are one step's budget); a mamba group in align mode two
        states (1135-1153); plus the null block. ``max_model_len``: a trace's own
        (``EngineSettings.max_model_len``), else the recipe's.
        """
        longest = self.max_model_len if max_model_len is None else max_model_len
        total = 1
        for g in self.spec_groups():
            if g.kind is GroupKind.FULL:
                total += -(-longest // g.block_size)
            elif g.kind is GroupKind.SLIDING:
                tokens = min(g.sliding_window - 1 + max_num_batched_tokens, longest)
                total += -(-tokens // g.block_size) + 1
            else:
                total += 2
        return total

    @property
    def unit(self) -> int:
        """The claim unit: the scheduler block size (lcm of the group block sizes)."""
        return self.spec_layout().scheduler_block_size


RECIPES: dict[Layout, LayoutRecipe] = {
    r.layout: r
    for r in (
        LayoutRecipe(
            Layout.MAMBA_FULL,
            "qwen3-next-80b-a3b",
            4,
            None,
            None,
            2560,
            11,
            "Qwen3-Next, 4 layers: 3 gated-delta-net groups (align) + 1 full attention, block 640",
        ),
        LayoutRecipe(
            Layout.SLIDING_FULL,
            "gpt-oss-20b",
            2,
            None,
            32,
            512,
            26,
            "gpt-oss-20b, 2 layers: sliding window 128 + full attention, block 32",
        ),
        LayoutRecipe(
            Layout.THREE_GROUPS,
            "gpt-oss-20b",
            3,
            None,
            32,
            512,
            35,
            "gpt-oss-20b, 3 layers: two sliding-window groups (128) + full attention, block 32",
        ),
        LayoutRecipe(
            Layout.FULL_ONLY,
            "gemma-3-1b",
            2,
            ("full_attention", "full_attention"),
            32,
            512,
            17,
            "Gemma-3-1B, 2 layers made full attention: one full-attention group (control)",
        ),
        LayoutRecipe(
            Layout.ONE_MAMBA_FULL,
            "qwen3-next-80b-a3b",
            2,
            ("linear_attention", "full_attention"),
            None,
            3200,
            8,
            "Qwen3-Next, 2 layers: 1 gated-delta-net group (align) + 1 full attention, block 640 "
            "(the regression scenarios' full + mamba)",
        ),
        LayoutRecipe(
            Layout.SHORT_SLIDING_FULL,
            "gpt-oss-20b",
            2,
            None,
            64,
            512,
            16,
            "gpt-oss-20b, 2 layers, block 64: sliding window 128 (two blocks) + full attention "
            "(the regression scenarios' window of 4 tokens on blocks of 2)",
        ),
    )
}

RANDOM_TRACE_LAYOUTS: tuple[Layout, ...] = (
    Layout.MAMBA_FULL,
    Layout.SLIDING_FULL,
    Layout.THREE_GROUPS,
    Layout.FULL_ONLY,
)
"""The layouts the random traces, the narrated scenarios and the divergence tests run on; the
other two serve the regression replay (``tests/vllm/test_regressions_vs_vllm.py``)."""
