"""The small configurations ``hybridkv check`` explores, and their two starts.

Sizes are chosen so every event kind and status is reachable within the depths ``hybridkv
check`` documents (10 seeded, 12 empty): prompts of 3 tokens over 1-token blocks (mamba and
sliding included), a token budget of 4, a load deadline of one step, and pools of three blocks
per group plus the null block, so two requests cannot both hold a whole sequence and
preemption happens (:func:`default_num_blocks`).

- ``empty``: nothing has arrived, the host store is empty. A load needs the first request to
  store its prefix AND the GPU prefix cache to have lost it (otherwise the local hit covers
  everything the host could offer): the small pool makes the first request's own decode reuse
  its earlier mamba state and window blocks. Chunks are 2 tokens, so a claim of the shared
  2-token prefix is one alignment segment and one load job, and a failed load is recovered
  within the depth bound (with 1-token chunks the claim takes two jobs and one action more).
- ``seeded``: every request has arrived and the host store already holds READY chunks for the
  shared prefix: the first chunk in every group, the second one in the attention groups only
  (its mamba state missing), so a claim must stop where the state is. Chunks are 1 token, so
  the claim rule has a chunk boundary to stop at.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from spec.connector_api import RequestId
from spec.errors import ConfigError
from spec.hashing import chunk_keys, request_block_hashes
from spec.kinds import GroupKind
from spec.managers.group_spec import GroupSpec
from spec.scheduler.config import RecoveryMode, SchedulerConfig
from spec.system import parts
from spec.system.content import Content
from spec.system.engine import Engine, EngineConfig, RequestSpec

__all__ = [
    "GROUP_CHOICES",
    "PROMPTS",
    "Recovery",
    "Scenario",
    "Start",
    "build_engines",
    "default_num_blocks",
    "parse_groups",
]

PROMPTS: tuple[tuple[int, ...], ...] = ((1, 2, 3), (1, 2, 4), (1, 5, 6))
"""Prompts of requests r0, r1, r2: r0 and r1 share a two-token prefix; r2 shares one token."""

GROUP_CHOICES = ("full,mamba", "full,sliding", "full,sliding,mamba", "full")

_GROUPS = {
    "full": GroupSpec(GroupKind.FULL, 1),
    "sliding": GroupSpec(GroupKind.SLIDING, 1, sliding_window=2),
    "mamba": GroupSpec(GroupKind.MAMBA, 1),
}


class Start(Enum):
    """Where the search starts (module docstring)."""

    EMPTY = "empty"
    SEEDED = "seeded"


class Recovery(Enum):
    """Which failed-load recovery to explore: vLLM 0.33's two policies, or shared truncation."""

    VLLM = "vllm"
    SHARED = "shared"

    def modes(self) -> tuple[RecoveryMode, ...]:
        """The scheduler modes explored: vLLM's recompute and fail policies, or truncation.

        Pure.
        """
        if self is Recovery.VLLM:
            return (RecoveryMode.VLLM_RECOMPUTE, RecoveryMode.VLLM_FAIL)
        return (RecoveryMode.SHARED_TRUNCATION,)


@dataclass(frozen=True, slots=True)
class Scenario:
    """One configuration to explore.

    Attributes:
        num_requests: 1 to 3.
        groups: the group kinds, e.g. ``(FULL, MAMBA)``.
        start: empty or seeded.
        recovery: the recovery model.
        num_blocks: pool size including the null block (``None``: :func:`default_num_blocks`).
        load_deadline_steps: steps a load may pend before it is abandoned.
        max_tokens: output tokens of each request.
        chunk_size: the offload chunk in tokens (``None``: 2 from empty, 1 seeded).
    """

    num_requests: int = 2
    groups: tuple[GroupKind, ...] = (GroupKind.FULL, GroupKind.MAMBA)
    start: Start = Start.SEEDED
    recovery: Recovery = Recovery.VLLM
    num_blocks: int | None = None
    load_deadline_steps: int = 1
    max_tokens: int = 2
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        n = self.num_requests
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(PROMPTS):
            raise ConfigError("requests", n, "must be 1, 2 or 3", "pass --requests 1..3")
        if not self.groups or self.groups[0] is not GroupKind.FULL:
            raise ConfigError(
                "groups", self.groups, "the first group must be full", "e.g. full,mamba"
            )

    def requests(self) -> tuple[RequestSpec, ...]:
        """r0..r{n-1} with the fixed prompts.

        Pure. Post: ``PROMPTS[i]`` and ``max_tokens`` each, no salt; r1 and r2 stop on 101.
        """
        return tuple(
            # r1 and r2 stop on token 101 (their first output), r0 runs to its length.
            RequestSpec(
                RequestId(f"r{i}"),
                PROMPTS[i],
                self.max_tokens,
                stop_token_ids=frozenset({101}) if i else frozenset(),
            )
            for i in range(self.num_requests)
        )

    def configs(self) -> tuple[EngineConfig, ...]:
        """One engine configuration per explored recovery mode.

        Pure. Refusal: the scheduler configuration's :class:`ConfigError` naming the field
        (e.g. a ``num_blocks`` too small).
        """
        groups = tuple(_GROUPS[kind.value] for kind in self.groups)
        num_blocks = self.num_blocks or default_num_blocks(self.groups, self.start)
        chunk_size = self.chunk_size or (2 if self.start is Start.EMPTY else 1)
        return tuple(
            EngineConfig(
                SchedulerConfig(
                    groups=groups,
                    num_blocks=num_blocks,
                    max_num_batched_tokens=4,
                    max_num_running=self.num_requests,
                    hash_block_size=1,
                    recovery=mode,
                    load_deadline_steps=self.load_deadline_steps,
                ),
                self.requests(),
                chunk_size=chunk_size,
                store_capacity=8,
                max_model_len=16,
            )
            for mode in self.recovery.modes()
        )


def default_num_blocks(groups: Sequence[GroupKind], start: Start) -> int:
    """Three blocks per group plus the null block; one more for a seeded sliding window.

    Three per group is the smallest pool in which a request's decode reuses blocks it freed
    (the GPU prefix cache loses them, so the empty start reaches a load) while one request's
    whole sequence still fits. A seeded sliding layout needs one more block so the second
    request is admitted while the first runs, and preemption is reachable. A lone group gets
    at least the four blocks a whole sequence (3 prompt tokens and one decode) needs. Pure.
    """
    extra = 1 if start is Start.SEEDED and GroupKind.SLIDING in groups else 0
    return max(3 * len(groups) + 1 + extra, 5)


def parse_groups(text: str) -> tuple[GroupKind, ...]:
    """``"full,mamba"`` -> ``(FULL, MAMBA)``. Refuses unknown kinds and a non-full first group.

    Pure. Refusal: :class:`ConfigError` (field ``groups``) for an unknown or repeated kind or
    a first group that is not full.
    """
    names = tuple(part.strip() for part in text.split(","))
    if not names or any(name not in _GROUPS for name in names) or len(set(names)) != len(names):
        raise ConfigError(
            "groups", text, "is not a list of distinct full/sliding/mamba", "e.g. full,mamba"
        )
    kinds = tuple(GroupKind(name) for name in names)
    if kinds[0] is not GroupKind.FULL:
        raise ConfigError("groups", text, "the first group must be full", "e.g. full,mamba")
    return kinds


def build_engines(
    scenario: Scenario,
    *,
    connector_cls: type[Any] | None = None,
    scheduler_cls: type[Any] | None = None,
    configure: Callable[[EngineConfig], EngineConfig] | None = None,
) -> list[Engine]:
    """The initial engines of ``scenario``: one per recovery mode.

    For tests: ``connector_cls`` / ``scheduler_cls`` swap in a subclass of the reference
    connector or scheduler (a deliberately broken variant, :meth:`Engine.create`), and
    ``configure`` maps each configuration to the one built (a liveness bound, a smaller host
    store); ``None`` keeps the scenario as it is.

    Pure: fresh engines sharing nothing mutable. Post: a seeded start has every request
    arrived and the shared prefixes READY in the host store, their content recorded. Refusal:
    :class:`ConfigError` naming the field (from :meth:`Scenario.configs`).
    """
    engines = []
    for config in scenario.configs():
        built = configure(config) if configure is not None else config
        engine = Engine.create(built, connector_cls=connector_cls, scheduler_cls=scheduler_cls)
        if scenario.start is Start.SEEDED:
            _seed(engine)
        engines.append(engine)
    return engines


def _seed(engine: Engine) -> None:
    """Arrive every request; store READY chunks of the shared prefixes (module docstring)."""
    for spec in engine.config.requests:
        engine.arrive(spec.request_id)
    prompts = {spec.prompt[:2] for spec in engine.config.requests}
    for prefix in sorted(prompts):
        _seed_prefix(engine, prefix)


def _seed_prefix(engine: Engine, prefix: Sequence[int]) -> None:
    groups = engine.config.groups
    units = tuple(g.block_size for g in groups)
    hashes = request_block_hashes(tuple(prefix), 1)
    for chunk in range(len(prefix)):
        keys = chunk_keys(hashes, 1, engine.config.chunk_size, units, chunk)
        end = chunk + 1
        wanted = [
            (g, key)
            for g, key in keys
            if end == 1 or groups[g].kind is not GroupKind.MAMBA  # chunk 2 lacks the state
        ]
        parts.seed_store(engine.scheduler, [key for _, key in wanted])
        for g, key in wanted:
            engine.host[key] = Content(g, tuple(prefix[:end]))
