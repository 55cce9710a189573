"""Scheduler configuration, and the catalogue of where the model departs from vLLM 0.33.

Every departure is switched by configuration; ``vllm_exact=True`` turns all of them off (and
refuses the options that only exist as departures), so the same model replays vLLM 0.33.
References are ``file:line`` relative to ``vllm/`` in the 0.33.0 wheel.

Divergences (each: what vLLM 0.33 does, what the spec does, the switch):

- **D1 mamba count clamp.** ``v1/core/single_type_kv_cache_manager.py:1743-1795`` returns a
  negative align-mode block count after a truncation; the spec clamps it at 0
  (:mod:`spec.managers.mamba`). Switch: ``vllm_exact`` swaps in an unclamped manager.
- **D2 claim alignment.** ``v1/core/sched/scheduler.py:1131-1184`` passes the connector an
  aligned count but accepts any answer (it only asserts ``<= num_tokens`` at 1217-1220, and a
  sync claim of every token trips ``assert num_new_tokens > 0`` at 1331). The spec floors a claim
  so that it ends on a scheduler block (the claim unit, ``SC-1``) and caps a sync claim at
  ``num_tokens - 1``. Switch: ``align_claims`` (off under ``vllm_exact``).
- **D3 load deadline.** ``scheduler.py:3519-3533`` (``_handle_blocked_waiting_request``) waits
  for ``finished_recving`` forever (vLLM #49829). The spec abandons a load pending for
  ``load_deadline_steps`` steps: its blocks are parked until the transfer reports, the request
  restarts from 0 computed tokens. Switch: ``load_deadline_steps`` (``None`` = vLLM).
- **D4 reserve for every admission.** ``scheduler.py:1420-1430`` subtracts the in-flight
  prefills' remaining blocks only when admitting an ASYNC load, so sync admissions may eat the
  reserve (vLLM #48433). The spec subtracts it for every NEW admission (nothing computed yet):
  a request resuming with its computed KV is one of the prefills the reserve protects and is
  never gated, and a new admission refused by the reserve alone keeps its place without
  stopping the step, so such resumptions behind it still run (both found as deadlocks of a
  first cut, tests/regressions/test_wedges.py). Switch: ``reserve_for_async_loads`` (vLLM 0.33
  behaviour under ``vllm_exact``; ``False`` = no reserve, the pre-#44560 behaviour).
- **D5 delayed free waits for every holder.** ``scheduler.py:3016-3025`` and ``3565-3581`` free a
  finished request's blocks at the FIRST of its load report and its ``finished_sending``; the
  spec frees them when the last holder reports. Switch: ``vllm_exact``.
- **D6 shared truncation.** ``scheduler.py:3688-3701`` recovers a failed load per request only
  (recompute from 0, or fail), and ``3703-3721`` raises ``RuntimeError`` on block-level reports
  with several groups. ``RecoveryMode.SHARED_TRUNCATION`` truncates every group at the first
  invalid block, aligned down to where every group is valid (:mod:`spec.scheduler.recovery`).
- **D7 no re-claim while a load is parked.** Consequence of D3: a request with an abandoned load
  still outstanding recomputes instead of asking the connector, so a late report always matches
  the abandoned load (one outstanding load per request id).
- **D8 the external mamba state block is reserved.** ``v1/core/single_type_kv_cache_manager.py
  :1742-1795`` counts ``cdiv(n, bs) - hit - held`` capped at one new block, but a first
  allocation that adopts external tokens and schedules new tokens past their block takes two per
  mamba group (the external state, 327-368, and the new state, 1797-1923), so a sync claim
  under-reserves one block per mamba group and ``get_new_blocks`` raises ``ValueError`` when the
  pool has no slack (a finding of ``tests/vllm``). The spec reserves the external block on its
  own (:meth:`spec.managers.MambaManager._adopts_external`). Switch: ``vllm_exact``.
- **D9 an admission is not gated by its own reservation.** ``scheduler.py:1420-1430`` gates an
  async admission on ``free - _inflight_prefill_reserved_blocks()``, the remaining blocks of
  every request in ``_inflight_prefills`` (3432-3436). A request whose async load failed stays in
  that set (added at 1542, discarded only at 1820, 1871 and 3038), so when it claims async again
  after the recompute its own full sequence is reserved against it, contrary to the comment at
  1420-1425 ("other in-flight reservations"): a request needing more than half the pool is
  never admitted while the connector keeps claiming (a wedge, ``SC-3``; a finding of
  ``tests/vllm``). The spec reserves for the OTHER in-flight prefills only. Switch:
  ``vllm_exact``.

Configuration mirrored from vLLM (not divergences): ``retention_interval`` is vLLM's
``prefix_cache_retention_interval`` (``config/cache.py:275``; vLLM's default 0 keeps sliding-window
and mamba cache entries only at resume boundaries, ``None`` keeps them densely);
``full_sequence_must_fit`` is ``scheduler_reserve_full_isl`` (default True in vLLM) and
``max_model_len`` bounds reservations.

Not modelled: async scheduling and deferred frees, pipeline parallelism, speculative decoding and
lookahead slots, the priority policy, encoder inputs, ``long_prefill_token_threshold``,
``has_pending_block_frees``, partial (sub-block) hits (so the local hit never has a partial tail,
``scheduler.py:1167-1184``), streaming sessions, LoRA, structured output.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from spec.errors import ConfigError
from spec.kinds import GroupKind
from spec.managers.group_spec import GroupSpec

__all__ = ["RecoveryMode", "SchedulerConfig"]


class RecoveryMode(Enum):
    """How a failed load is recovered.

    - ``VLLM_RECOMPUTE``: vLLM 0.33 ``kv_load_failure_policy="recompute"``: the request restarts
      from 0 computed tokens, every group freed, the connector asked again.
    - ``VLLM_FAIL``: vLLM 0.33's default ``"fail"``: the request ends FINISHED_ERROR.
    - ``SHARED_TRUNCATION``: every group truncated at one shared, valid boundary.
    """

    VLLM_RECOMPUTE = "vllm_recompute"
    VLLM_FAIL = "vllm_fail"
    SHARED_TRUNCATION = "shared_truncation"


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """What the scheduler model is run with.

    Attributes:
        groups: the KV cache groups (at least one).
        num_blocks: pool size including the null block (>= 2).
        max_num_batched_tokens: the token budget of one step (>= 1).
        max_num_running: the most requests in the running queue (>= 1).
        hash_block_size: tokens per block hash; must divide every group's block size.
        recovery: how failed loads are recovered.
        load_deadline_steps: steps a load may stay pending before it is abandoned (D3).
        reserve_for_async_loads: reserve blocks for in-flight prefills (D4).
        vllm_exact: model vLLM 0.33 exactly (every divergence off).
        liveness_bound_steps: ``SC-3``'s bound on the age of an unfinished request (``None``:
            only the explorer's wedge check applies).
        retention_interval: vLLM's ``prefix_cache_retention_interval`` for sliding-window and
            mamba groups: ``None`` dense (the default here), 0 sparse (vLLM's default).
        max_model_len: vLLM's ``max_model_len`` (``None``: unbounded); it bounds the blocks
            reserved for an in-flight prefill (``scheduler.py:3404-3420``).
        full_sequence_must_fit: vLLM's ``scheduler_reserve_full_isl`` (``config/scheduler.py
            :190``, vLLM's default True; False here, as before): a waiting request is admitted
            only if its whole sequence fits the free blocks (``scheduler.py:1448``,
            ``kv_cache_manager.py:535-552``).
    """

    groups: tuple[GroupSpec, ...]
    num_blocks: int
    max_num_batched_tokens: int
    max_num_running: int
    hash_block_size: int
    recovery: RecoveryMode = RecoveryMode.VLLM_RECOMPUTE
    load_deadline_steps: int | None = None
    reserve_for_async_loads: bool = True
    vllm_exact: bool = False
    liveness_bound_steps: int | None = None
    retention_interval: int | None = None
    max_model_len: int | None = None
    full_sequence_must_fit: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.groups, tuple) or not self.groups:
            raise ConfigError("groups", self.groups, "need a non-empty tuple", "list the groups")
        for field in ("num_blocks", "max_num_batched_tokens", "max_num_running"):
            _positive(field, getattr(self, field))
        _positive("hash_block_size", self.hash_block_size)
        for group in self.groups:
            if group.block_size % self.hash_block_size:
                raise ConfigError(
                    "hash_block_size",
                    self.hash_block_size,
                    f"does not divide block_size {group.block_size}",
                    "use the gcd of the group block sizes",
                )
        for field in ("load_deadline_steps", "liveness_bound_steps", "max_model_len"):
            if getattr(self, field) is not None:
                _positive(field, getattr(self, field))
        if self.retention_interval not in (None, 0) or isinstance(self.retention_interval, bool):
            raise ConfigError(
                "retention_interval",
                self.retention_interval,
                "only dense (None) and sparse (0) retention are modelled",
                "pass None or 0",
            )
        if not isinstance(self.recovery, RecoveryMode):
            raise ConfigError("recovery", self.recovery, "not a RecoveryMode", _FIX_MODE)
        self._check_exact()

    def _check_exact(self) -> None:
        if not self.vllm_exact:
            return
        if self.load_deadline_steps is not None:
            raise ConfigError(
                "load_deadline_steps",
                self.load_deadline_steps,
                "vLLM 0.33 has no load deadline",
                "leave it None with vllm_exact=True",
            )
        if self.recovery is RecoveryMode.SHARED_TRUNCATION:
            raise ConfigError(
                "recovery", self.recovery, "vLLM 0.33 has no shared truncation", _FIX_MODE
            )

    # ------------------------------------------------------------ derived switches
    @property
    def align_claims(self) -> bool:
        """D2: floor claims to the claim unit and cap sync claims below the last token."""
        return not self.vllm_exact

    @property
    def reserve_every_admission(self) -> bool:
        """D4: whether every admission (not only async ones) leaves the reserve alone."""
        return self.reserve_for_async_loads and not self.vllm_exact

    @property
    def reserve_excludes_admitting(self) -> bool:
        """D9: whether an admission leaves its own in-flight reservation out of the gate."""
        return not self.vllm_exact

    def admission_cap(self, group: GroupSpec) -> int | None:
        """vLLM's ``max_admission_blocks_per_request`` for a group (``None``: no cap).

        A sliding window holds at most its window, the tokens of one step still in flight, and
        one block of misalignment (``v1/kv_cache_interface.py:918-944``; with no async
        scheduling or pipeline parallelism the in-flight tokens are one step's budget,
        ``config/vllm.py:601-609``); vLLM caps a reservation for an in-flight prefill there.

        Pure.
        """
        if group.kind is not GroupKind.SLIDING:
            return None
        tokens = group.sliding_window - 1 + group.extra_retained_tokens
        tokens += self.max_num_batched_tokens
        if self.max_model_len is not None:
            tokens = min(tokens, self.max_model_len)
        return -(-tokens // group.block_size) + 1

    @property
    def needs_mamba_split(self) -> bool:
        """vLLM's ``need_mamba_block_aligned_split`` (``scheduler.py:432-434``)."""
        return any(g.kind is GroupKind.MAMBA for g in self.groups)

    @property
    def mamba_block_size(self) -> int:
        """``cache_config.block_size`` as the split reads it: the first mamba group's block."""
        sizes = [g.block_size for g in self.groups if g.kind is GroupKind.MAMBA]
        return sizes[0] if sizes else self.groups[0].block_size


_FIX_MODE = "pick RecoveryMode.VLLM_RECOMPUTE or VLLM_FAIL"


def _positive(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(field, value, "must be an int > 0", "pass a positive int")
