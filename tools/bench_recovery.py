"""Recovery comparison: vLLM 0.33's whole-request recompute against shared truncation.

    python tools/bench_recovery.py          # the table and the totals
    python tools/bench_recovery.py --json   # the same numbers as JSON

Every case is one failure scenario run on the whole formal engine (``spec.system.engine``:
scheduler, reference connector, worker, host store, content model) three times, side by side
in one run: without the failure (the baseline), under ``RecoveryMode.VLLM_RECOMPUTE`` (vLLM
0.33's ``kv_load_failure_policy="recompute"``: the failed request restarts from 0 computed
tokens and asks the connector again) and under ``RecoveryMode.SHARED_TRUNCATION`` (every group
truncated at one point before the first invalid block; the worker's block-level report says
which blocks). A case's requests arrive together; the engine then steps, and after each step
every transfer job completes, except the load jobs a case names, which fail once.

Columns, summed over the case's requests:

- ``claimed``: tokens the failed loads claimed (the host hits before the failure);
- ``kept``: tokens recovery kept in place (claimed - discarded);
- ``discarded``: valid KV thrown away (the scheduler's ``tokens_discarded_by_recovery``);
- ``reloaded``: tokens claimed again after the failure (the re-ask of a request restarted
  from 0), transferred a second time;
- ``recomputed``: prefill and decode tokens computed on the GPU beyond the baseline run;
- ``steps``: engine steps until every request finished;
- ``broken``: invariant ids broken after any event (checked after every one; must be none).

The reference connector remembers failed keys (its failure memory), so a request restarted
from 0 re-claims the prefix before the failed segment when the host still has it: then the
two models recompute the same tokens and recompute pays a second transfer and more steps.
Shared truncation recomputes fewer tokens when the host no longer has the prefix at the
re-ask. With a mamba group neither keeps anything: an external claim has one recurrent state,
at its end, so no earlier point has every group valid (docs/explanation/recovery.md).

``nox -s bench`` runs this file with the other CPU benchmarks; it measures counts, not time.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from spec.connector_api import JobId, RequestId, TransferKind
from spec.kinds import GroupKind
from spec.managers.group_spec import GroupSpec
from spec.scheduler.config import RecoveryMode, SchedulerConfig
from spec.system import parts
from spec.system.engine import Engine, EngineConfig, RequestSpec
from spec.system.model import EngineModel

FULL = GroupSpec(GroupKind.FULL, 2)
MAMBA = GroupSpec(GroupKind.MAMBA, 2)
WIDE = GroupSpec(GroupKind.SLIDING, 2, sliding_window=8)  # reads 7 tokens back
NARROW = GroupSpec(GroupKind.SLIDING, 2, sliding_window=4)  # reads 3 tokens back

P9 = tuple(range(1, 10))  # 9 prompt tokens: the host holds 8, claimed in 4 segments of 2
OTHER = tuple(range(30, 70))  # 40 unrelated tokens


@dataclass(frozen=True, slots=True)
class Case:
    """One failure scenario.

    Attributes:
        name: a short label.
        groups: the KV cache groups.
        requests: ``(request id, prompt, max_tokens)``, arriving together before step 1.
        seeds: ``(request id, tokens)``: the host holds that prompt's first tokens.
        fail: request id -> index (0 = the first segment) of the load job that fails once.
        salvageable: derived by hand: shared truncation keeps some claimed tokens.
        host_lost: derived by hand: the prefix before the failed segment is gone from the host
            when the restarted request asks again, so recompute cannot reload it.
        max_running: the scheduler's running cap.
        store_capacity: host store entries.
    """

    name: str
    groups: tuple[GroupSpec, ...]
    requests: tuple[tuple[str, tuple[int, ...], int], ...]
    seeds: tuple[tuple[str, int], ...]
    fail: Mapping[str, int]
    salvageable: bool
    host_lost: bool = False
    max_running: int = 4
    store_capacity: int = 64


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one run of a case measured (module docstring)."""

    claimed: int = 0
    kept: int = 0
    discarded: int = 0
    reloaded: int = 0
    computed: int = 0
    steps: int = 0
    broken: tuple[str, ...] = ()
    recomputed: int = field(default=0)


def _layout_name(groups: Sequence[GroupSpec]) -> str:
    names = []
    for g in groups:
        if g.kind is GroupKind.SLIDING:
            names.append(f"sliding{g.sliding_window}")
        else:
            names.append(g.kind.value)
    return "+".join(names)


def _one(rid: str, fail: int, groups: tuple[GroupSpec, ...], name: str, salvage: bool) -> Case:
    return Case(
        f"{_layout_name(groups)}, segment {fail + 1} of 4 fails ({name})",
        groups,
        ((rid, P9, 2),),
        ((rid, 8),),
        {rid: fail},
        salvage,
    )


def cases() -> list[Case]:
    """The failure scenarios; ``salvageable`` and ``host_lost`` are derived in the comments."""
    found = [
        # full + mamba: the claim's one state is at 8; attention is invalid from the failed
        # segment on, so no point above 0 has both: nothing is salvageable.
        _one("r0", 0, (FULL, MAMBA), "first", salvage=False),
        _one("r0", 2, (FULL, MAMBA), "third", salvage=False),
        _one("r0", 3, (FULL, MAMBA), "last, with the state", salvage=False),
        # full + sliding window 8: the window at any point p <= 8 reads blocks from
        # max(0, p - 7) // 2 = 0, all real: the prefix before the failed segment is kept
        # (segment k fails: 2k tokens kept; the first segment keeps nothing).
        _one("r0", 0, (FULL, WIDE), "first", salvage=False),
        _one("r0", 2, (FULL, WIDE), "third", salvage=True),
        _one("r0", 3, (FULL, WIDE), "last", salvage=True),
        # full + sliding window 4: at 8 the window holds blocks 2, 3 only (0, 1 are null), so
        # a point p needs blocks from (p - 3) // 2: at 6 block 1 (null), at 4 block 0 (null):
        # nothing above 0 is valid.
        _one("r0", 3, (FULL, NARROW), "last", salvage=False),
        # Three groups: the mamba group decides, as above.
        _one("r0", 2, (FULL, WIDE, MAMBA), "third", salvage=False),
        # Two requests with the same prompt load the same host entries in the same step and
        # the same segment fails for both (a bad host entry read twice): 4 kept each.
        Case(
            "full+sliding8, two requests share the failing segment 3",
            (FULL, WIDE),
            (("r0", P9, 2), ("r1", P9, 2)),
            (("r0", 8),),
            {"r0": 2, "r1": 2},
            salvageable=True,
        ),
        # A busy engine: one running slot. r0's load fails; r1 (40 unrelated prompt tokens, 16
        # a step) is running, so r0 waits for the slot while r1's prompt stores fill the
        # 8-entry host store and evict r0's 8 entries (least recent first) once the failed load
        # unpinned them. Prompt stores are NORMAL, so they may evict r0's prefix; decode stores
        # are LOW and may not (hybridkv.store admission), which is why r1's prompt, not its
        # answer, does the evicting. Restarted from 0, r0 finds nothing in the host and
        # recomputes everything; truncated, it keeps its first 6 tokens.
        Case(
            "full+sliding8, last segment fails, host evicts before the retry",
            (FULL, WIDE),
            (("r0", P9, 2), ("r1", OTHER, 2)),
            (("r0", 8),),
            {"r0": 3},
            salvageable=True,
            host_lost=True,
            max_running=1,
            store_capacity=8,
        ),
    ]
    return found


def _config(case: Case, mode: RecoveryMode) -> EngineConfig:
    return EngineConfig(
        SchedulerConfig(
            groups=case.groups,
            num_blocks=64,
            max_num_batched_tokens=16,
            max_num_running=case.max_running,
            hash_block_size=2,
            recovery=mode,
        ),
        tuple(RequestSpec(RequestId(rid), p, n) for rid, p, n in case.requests),
        chunk_size=2,
        store_capacity=case.store_capacity,
        max_model_len=64,
    )


def run(case: Case, mode: RecoveryMode, *, fail: bool = True, max_steps: int = 60) -> Outcome:
    """One run of ``case`` (module docstring); ``fail=False`` is the baseline."""
    engine = Engine.create(_config(case, mode))
    model = EngineModel(())
    broken: set[str] = set()

    def check() -> None:
        broken.update(model.violations(engine))

    for rid, tokens in case.seeds:
        engine.seed_host(RequestId(rid), tokens)
    for rid, _, _ in case.requests:
        engine.arrive(RequestId(rid))
    first_loads: dict[str, list[JobId]] = {}
    claims: dict[str, list[int]] = {}
    computed = steps = 0
    while not _done(engine):
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"{case.name} / {mode.value}: not done after {max_steps} steps")
        engine.step()
        check()
        out = engine.last_output
        computed += out.total_num_scheduled_tokens
        for claim in out.claims:
            if claim.accepted and claim.outcome.value == "waiting_for_remote_kvs":
                claims.setdefault(claim.request_id, []).append(claim.accepted)
        for job_id in sorted(engine.in_flight):
            job = engine.in_flight[job_id].job
            if job.kind is TransferKind.LOAD and len(claims.get(job.request_id, ())) == 1:
                first_loads.setdefault(job.request_id, []).append(job_id)
        for job_id in sorted(engine.in_flight):
            job = engine.in_flight[job_id].job
            index = case.fail.get(job.request_id)
            mine = first_loads.get(job.request_id, [])
            bad = fail and index is not None and index < len(mine) and mine[index] == job_id
            engine.complete(job_id, not bad)
            check()
    failed = [rid for rid in case.fail if fail]
    claimed = sum(claims[rid][0] for rid in failed)
    discarded = engine.scheduler.counters["tokens_discarded_by_recovery"]
    reloaded = sum(sum(claims[rid][1:]) for rid in claims)
    return Outcome(
        claimed, claimed - discarded, discarded, reloaded, computed, steps, tuple(sorted(broken))
    )


def _done(engine: Engine) -> bool:
    quiet = not engine.in_flight and not engine.pending
    return quiet and not parts.has_work(engine.scheduler)


@dataclass(frozen=True, slots=True)
class Row:
    """One case: its baseline and the two recovery models."""

    case: Case
    baseline: Outcome
    recompute: Outcome
    shared: Outcome


def compare(selected: Sequence[Case] | None = None) -> list[Row]:
    """Every case run three times (baseline, recompute, shared), side by side."""
    rows = []
    for case in selected if selected is not None else cases():
        base = run(case, RecoveryMode.SHARED_TRUNCATION, fail=False)
        outcomes = []
        for mode in (RecoveryMode.VLLM_RECOMPUTE, RecoveryMode.SHARED_TRUNCATION):
            o = run(case, mode)
            outcomes.append(_with_recomputed(o, o.computed - base.computed))
        rows.append(Row(case, base, outcomes[0], outcomes[1]))
    return rows


def _with_recomputed(o: Outcome, recomputed: int) -> Outcome:
    return Outcome(
        o.claimed, o.kept, o.discarded, o.reloaded, o.computed, o.steps, o.broken, recomputed
    )


def totals(rows: Sequence[Row]) -> dict[str, dict[str, int]]:
    """Column sums per recovery model."""
    keys = ("claimed", "kept", "discarded", "reloaded", "recomputed", "steps")
    return {
        name: {k: sum(getattr(getattr(r, name), k) for r in rows) for k in keys}
        for name in ("recompute", "shared")
    }


def render(rows: Sequence[Row]) -> str:
    """The table: one line per case, recompute | shared for each measure, then the totals."""
    head = (
        f"{'case':<64} {'claimed':>7}  {'kept':>9}  {'discarded':>9}  {'reloaded':>9}  "
        f"{'recomputed':>10}  {'steps':>7}"
    )
    lines = [head, "-" * len(head)]

    def cell(a: int, b: int, width: int) -> str:
        return f"{f'{a} | {b}':>{width}}"

    for r in rows:
        rc, sh = r.recompute, r.shared
        lines.append(
            f"{r.case.name:<64} {rc.claimed:>7}  {cell(rc.kept, sh.kept, 9)}  "
            f"{cell(rc.discarded, sh.discarded, 9)}  {cell(rc.reloaded, sh.reloaded, 9)}  "
            f"{cell(rc.recomputed, sh.recomputed, 10)}  {cell(rc.steps, sh.steps, 7)}"
        )
    t = totals(rows)
    rc, sh = t["recompute"], t["shared"]
    lines.append("-" * len(head))
    lines.append(
        f"{'total':<64} {rc['claimed']:>7}  {cell(rc['kept'], sh['kept'], 9)}  "
        f"{cell(rc['discarded'], sh['discarded'], 9)}  "
        f"{cell(rc['reloaded'], sh['reloaded'], 9)}  "
        f"{cell(rc['recomputed'], sh['recomputed'], 10)}  {cell(rc['steps'], sh['steps'], 7)}"
    )
    broken = sorted({b for r in rows for o in (r.recompute, r.shared) for b in o.broken})
    lines.append("each cell: vLLM 0.33 recompute | shared truncation")
    lines.append(f"invariants broken in any run: {', '.join(broken) or 'none'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    parser.add_argument("--quick", action="store_true", help="accepted for nox -s bench")
    args = parser.parse_args(argv)
    rows = compare()
    if args.json:
        payload = {
            "cases": [
                {
                    "case": r.case.name,
                    "recompute": asdict(r.recompute),
                    "shared": asdict(r.shared),
                    "baseline_computed": r.baseline.computed,
                }
                for r in rows
            ],
            "totals": totals(rows),
        }
        print(json.dumps(payload, indent=2))
    else:
        print(render(rows))
    broken = any(o.broken for r in rows for o in (r.recompute, r.shared, r.baseline))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
