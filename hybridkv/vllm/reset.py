"""vLLM's prefix-cache reset through :class:`~hybridkv.vllm.connector.HybridKVConnector` (issue 17).

vLLM 0.33 resets on ``reset_prefix_cache(reset_running_requests, reset_connector)`` (the
``/reset_prefix_cache`` endpoint, ``LLM.reset_prefix_cache``, and ``pause_generation`` with
``clear_cache`` after a weight update in RL loops, which passes ``reset_connector=True``).
``Scheduler.reset_prefix_cache`` (``v1/core/sched/scheduler.py:3184``) runs, in order:

1. with ``reset_running_requests``, preempts every running request (their blocks are freed);
2. ``KVCacheManager.reset_prefix_cache()``: each ``BlockPool.reset_prefix_cache()`` refuses
   (returns False) while any block but the null block is referenced, and the scheduler then
   *raises* ``RuntimeError`` if running requests were preempted;
3. with ``reset_connector``, ``Scheduler.reset_connector_cache()`` calls the connector's
   ``reset_cache()``: ``False`` fails the reset, anything else (the base class's ``None``)
   counts as success.

Step 3 is :func:`reset_connector_cache`: the host tier forgets everything from before the reset
(:meth:`hybridkv.connector.ConnectorCore.reset_cache`: READY entries evicted now; entries a load
pins unclaimable and evicted when the load reports; stores and promotions in flight dropped when
they report), and the remote tier moves to the next weights version, so every chunk key it
asks or writes from then on differs from those before (:mod:`hybridkv.vllm.remote`).

Step 2 would fail on the connector's own references: the core holds a pool reference on every
block an in-flight store reads (TR-1), and it delays the free of a finished request while its
stores run (``request_finished_all_groups`` answers True), and vLLM asks the connector only after
its pool check. ``pause_generation(mode="abort", clear_cache=True)``, the RL loop's path, aborts
every request first, so each one storing at that moment is such a delayed free. So
:func:`guard_pool_reset` wraps the bound pool's ``reset_prefix_cache`` (on that one instance):
when the store pins and the blocks of the delayed frees are the only references left, it frees
those requests' blocks (``coordinator.free``; vLLM's own free at ``finished_sending`` then finds
nothing left to free) and gives the pins back
(:meth:`~hybridkv.connector.ConnectorCore.release_store_pins`), and those stores are dropped
when they report (a released block may be reused and overwritten while the copy still reads it,
so what they read is never trusted). When anything else still holds a block (a request waiting
for its load), the reset fails anyway: nothing is released and the stores go on.

A request aborted while its load is in flight keeps its blocks until the load lands
(``finish_requests``, ``scheduler.py:3016-3025``): its copy may still be writing them. vLLM's
served engine waits for that before a pause's reset (``EngineCoreProc.pause_scheduler`` finishes
the pause once the engine is idle), but the in-process engine's ``pause_scheduler`` (``LLM``,
offline RL loops) resets at once, and vLLM raises ``RuntimeError`` at step 2. The connector's
reset (step 3) has not run then: the host tier and the remote tier are untouched (issue 28,
tests/vllm/test_pause_with_loads.py). The guard logs which requests still load and what to do,
so the operator reads more than vLLM's generic message.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from hybridkv.connector import ConnectorCore

__all__ = ["guard_pool_reset", "only_ours_left", "reset_connector_cache"]

logger = logging.getLogger("vllm.hybridkv")  # under vLLM's logger: its handlers print it


def reset_connector_cache(core: ConnectorCore, remote: Any) -> bool:
    """The connector's ``reset_cache``: the host tier forgets, the remote tier moves to the
    next weights version (``remote``: a :class:`~hybridkv.vllm.remote.SchedulerRemote` or
    None). Always True: nothing in flight can make the reset fail, it is only dropped later."""
    core.reset_cache()
    if remote is not None:
        remote.reset()
    return True


def only_ours_left(pool: Any, held: Iterable[int], tables: Iterable[Iterable[int]]) -> bool:
    """Whether ``held`` (one id per pin the core holds) and ``tables`` (the block ids of the
    requests whose free the connector delayed) are every reference in vLLM's ``pool`` but the
    null block's: releasing them leaves the pool resettable."""
    null = pool.null_block.block_id
    refs = Counter(held)
    for table in tables:
        refs.update(block for block in table if block != null)
    if not refs:
        return False
    used = pool.num_gpu_blocks - pool.get_num_free_blocks() - 1  # the null block is always used
    if used != len(refs):
        return False
    return all(pool.blocks[block].ref_cnt == n for block, n in refs.items())


def guard_pool_reset(pool: Any, core: ConnectorCore, manager: Any = None) -> None:
    """Make ``pool.reset_prefix_cache`` release the core's store pins, and the blocks of the
    frees it delayed (``manager``: vLLM's ``KVCacheManager`` over ``pool``; None: pins only),
    when they are all that stands in its way (module docstring). Idempotent per pool."""
    original: Callable[[], bool] = pool.reset_prefix_cache
    if getattr(original, "_hybridkv_guard", False):
        return

    def reset_prefix_cache() -> bool:
        delayed = sorted(core.delayed_requests()) if manager is not None else []
        tables = [[block for ids in manager.get_block_ids(rid) for block in ids] for rid in delayed]
        if only_ours_left(pool, core.held_blocks(), tables):
            for rid in delayed:
                manager.coordinator.free(rid)
            core.release_store_pins()
        reset = original()
        loading = core.loading_requests() if not reset else frozenset()
        if loading:
            logger.warning(
                "hybridkv: the prefix-cache reset cannot run while %d request(s) wait for "
                "their host-tier loads (%s): vLLM keeps their blocks until the loads land. "
                "The host and remote tiers are untouched. Let the engine step until the loads "
                "land (vLLM's served engine waits for that before a pause's reset), then reset "
                "or pause with clear_cache again.",
                len(loading),
                ", ".join(sorted(loading)[:8]),
            )
        return reset

    reset_prefix_cache._hybridkv_guard = True  # type: ignore[attr-defined]
    pool.reset_prefix_cache = reset_prefix_cache
