"""``hybridkv check``: explore every interleaving of a small engine and check every invariant.

The model is the formal one (:mod:`spec.system`: scheduler, reference connector, worker, host
store and content); the search is :func:`spec.explorer.explore`. The command draws a progress
line (states, depth, states/s, memory) on a terminal's stderr, then prints the states explored,
states per second, the depth reached, whether the search was exhaustive, the coverage and the
verdict. Exit codes: 0 when no invariant broke, every required event kind and status was
reached and no budget cut the search; 1 for a violation or an uncovered label; 2 for bad
arguments; 3 when a budget (``--max-states``, ``--max-memory``, defaults in
:mod:`hybridkv.cli.check_budget`) stopped the search, which then ends with one line naming the
flag, what was explored and that the result is not exhaustive.

"Exhaustive" here is the bounded form: every state reachable within ``--depth`` actions was
checked (no budget cut). ``complete`` additionally says that no state at the last depth could
act, i.e. the whole reachable space fits within the depth.

JSON (``--json``) keys: ``scenario``, ``exhaustive``, ``complete``, ``states``,
``transitions``, ``states_per_second``, ``seconds``, ``depth``, ``max_depth``, ``violations``
(each ``{"invariant", "messages", "trace"}``, the trace as readable steps), ``coverage``
(``events``, ``statuses``, ``recovery``, ``claims``: label -> count), ``uncovered`` (required
labels never reached), ``verdict`` (``pass``, ``violation``, ``uncovered`` or ``cut``),
``budget`` (``max_states``, ``max_memory_mib``), ``memory_mib`` (the largest resident memory
sampled) and ``bound``: ``null``, or for a cut search ``{"cut_by", "flag", "checked_depth",
"message"}`` (``message`` is the line the human output ends with).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from hybridkv.cli.check_budget import (
    DEFAULT_MAX_STATES,
    EXIT_CUT,
    bound_message,
    default_max_memory_mib,
)
from spec.errors import ConfigError
from spec.explorer import Cut, ExploreResult, Progress, Snapshot, explore

if TYPE_CHECKING:
    from spec.system.scenarios import Scenario

__all__ = ["add_parser", "required_labels", "run", "run_check"]

_REQUIRED_EVENTS = (
    "step",
    "load_ok",
    "load_fail",
    "load_timeout",
    "store_ok",
    "store_fail",
    "abort",
    "abort_during_transfer",
    "preempt",
    "preempt_during_transfer",
    "finish",
)


def add_parser(sub: Any) -> None:
    """Register ``check`` on the subcommand set of the top-level parser."""
    p = sub.add_parser(
        "check",
        help="exhaustively explore a small engine and check every invariant",
        description="Bounded exhaustive exploration of the formal model (spec.system).",
        epilog=_EPILOG,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=2, help="requests in the scenario (1-3)")
    p.add_argument(
        "--groups",
        default="full,mamba",
        help="KV cache group kinds, one of: full,mamba | full,sliding | full,sliding,mamba | full",
    )
    p.add_argument("--depth", type=int, default=10, help="actions per explored path (the bound)")
    p.add_argument(
        "--start",
        choices=["empty", "seeded"],
        default="seeded",
        help="empty: nothing arrived, host store empty; seeded: every request arrived and the "
        "host store already holds the shared prefix (its second chunk without the mamba state)",
    )
    p.add_argument(
        "--recovery",
        choices=["vllm", "shared"],
        default="vllm",
        help="failed-load recovery explored: vllm = vLLM 0.33's recompute and fail policies; "
        "shared = shared truncation",
    )
    p.add_argument(
        "--max-states",
        type=int,
        default=DEFAULT_MAX_STATES,
        help="the state budget: stop adding states past this many (the search is then cut, "
        "not exhaustive: exit 3); the default takes about 1 GB",
    )
    p.add_argument(
        "--max-memory",
        type=_memory_mib,
        default="auto",
        metavar="MIB",
        help="the memory budget: stop adding states once this process holds this many MiB "
        "(cut, exit 3); auto = half the memory available when the command starts",
    )
    p.add_argument(
        "--progress",
        action="store_true",
        help="draw the progress (states, depth, states/s, memory) on stderr even when it is not "
        "a terminal, one line per update (on a terminal it is always drawn, in place)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run)


def _memory_mib(text: str) -> int | str:
    """``--max-memory``: ``auto`` or a whole number of MiB (checked in :func:`run`)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: pass a whole number of MiB or auto") from None


_EPILOG = (
    "The result: 'exhaustive: yes' = every state within --depth actions was checked; "
    "'complete: yes' = besides, no state at the last depth could act, so the whole reachable "
    "space was seen ('complete: no' only says a larger --depth would reach more states). "
    "Verdict: pass (exit 0) = no invariant broke, every required event and status was reached "
    "and nothing was cut; violation and uncovered (raise --depth or change --start) exit 1; "
    "bad arguments exit 2; cut (--max-states or --max-memory stopped the search: the output "
    "ends with one line naming the flag to raise) exits 3."
)


def run(args: argparse.Namespace) -> int:
    """Execute ``hybridkv check``; returns the exit code (config errors propagate to main)."""
    # The model loads on use, so ``hybridkv plan`` never pays for importing it.
    from spec.system.scenarios import Recovery, Scenario, Start, parse_groups

    scenario = Scenario(
        num_requests=args.requests,
        groups=parse_groups(args.groups),
        start=Start(args.start),
        recovery=Recovery(args.recovery),
    )
    if isinstance(args.depth, bool) or args.depth < 0:
        raise ConfigError("depth", args.depth, "must be an int >= 0", "pass --depth 10")
    if args.max_states < 1:
        raise ConfigError("max_states", args.max_states, "must be >= 1", "omit it or pass >= 1")
    max_memory = default_max_memory_mib() if args.max_memory == "auto" else args.max_memory
    if max_memory < 1:
        raise ConfigError("max_memory", max_memory, "must be >= 1 (MiB)", "omit it or pass >= 1")
    with _progress_line(args.progress, args.depth, args.max_states, max_memory) as advance:
        report = run_check(scenario, args.depth, args.max_states, advance, max_memory)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _render(report)
    if report["verdict"] == "cut":
        return EXIT_CUT
    return 0 if report["verdict"] == "pass" else 1


def run_check(
    scenario: Scenario,
    depth: int,
    max_states: int | None = None,
    progress: Progress | None = None,
    max_memory_mib: int | None = None,
) -> dict[str, Any]:
    """Explore ``scenario`` to ``depth`` and return the JSON-ready report (module docstring).

    ``max_states`` and ``max_memory_mib`` are the budgets (``None``: no limit of that kind).
    """
    from spec.system.model import EngineModel
    from spec.system.scenarios import build_engines

    engines = build_engines(scenario)
    model = EngineModel(engines)
    max_rss = None if max_memory_mib is None else max_memory_mib * _MIB
    result = explore(
        model,
        depth,
        max_states=max_states,
        max_rss_bytes=max_rss,
        stop_at_first=True,
        progress=progress,
    )
    coverage: dict[str, int] = dict(result.coverage)
    for engine in engines:
        for status in engine.statuses().values():
            coverage[f"status:{status}"] = coverage.get(f"status:{status}", 0) + 1
    uncovered = [label for label in required_labels(scenario) if not coverage.get(label)]
    report = _report(scenario, depth, result, coverage, uncovered)
    report["budget"] = {"max_states": max_states, "max_memory_mib": max_memory_mib}
    report["memory_mib"] = None if result.rss_bytes is None else result.rss_bytes // _MIB
    report["bound"] = None
    if result.cut is not Cut.NONE:
        report["bound"] = {
            "cut_by": result.cut.value,
            "flag": "--max-states" if result.cut is Cut.MAX_STATES else "--max-memory",
            "checked_depth": result.checked_depth,
        }
        report["bound"]["message"] = bound_message(report)
    return report


_MIB = 1 << 20


def required_labels(scenario: Scenario) -> list[str]:
    """The labels a check of ``scenario`` must reach, or it proves nothing about them."""
    from spec.system.scenarios import Start

    events = list(_REQUIRED_EVENTS)
    if scenario.start is Start.EMPTY:
        events.insert(0, "arrive")
    statuses = ["WAITING", "WAITING_FOR_REMOTE_KVS", "RUNNING", "PREEMPTED", "FINISHED_LENGTH"]
    statuses.append("FINISHED_ABORTED")
    if scenario.num_requests >= 2:
        statuses.append("FINISHED_STOPPED")
    modes = scenario.recovery.modes()
    if any(m.value == "vllm_fail" for m in modes):
        statuses.append("FINISHED_ERROR")
    labels = [f"event:{e}" for e in events] + [f"status:{s}" for s in statuses]
    return labels + [f"recovery:{m.value}" for m in modes]


def _report(
    scenario: Scenario,
    depth: int,
    result: ExploreResult[Any],
    coverage: Mapping[str, int],
    uncovered: list[str],
) -> dict[str, Any]:
    violations = [
        {
            "invariant": v.invariant_id,
            "messages": list(v.messages),
            "trace": [str(action) for action in v.trace],
        }
        for v in result.violations
    ]
    if violations:
        verdict = "violation"
    elif result.budget_cut:
        verdict = "cut"
    elif uncovered:
        verdict = "uncovered"
    else:
        verdict = "pass"
    return {
        "scenario": {
            "requests": scenario.num_requests,
            "groups": ",".join(kind.value for kind in scenario.groups),
            "start": scenario.start.value,
            "recovery": scenario.recovery.value,
        },
        "exhaustive": not result.budget_cut and not violations,
        "complete": result.exhaustive,
        "states": result.states,
        "transitions": result.transitions,
        "states_per_second": round(result.states_per_second, 1),
        "seconds": round(result.seconds, 3),
        "depth": result.depth_reached,
        "max_depth": depth,
        "violations": violations,
        "coverage": _grouped(coverage),
        "uncovered": uncovered,
        "verdict": verdict,
    }


def _grouped(coverage: Mapping[str, int]) -> dict[str, dict[str, int]]:
    groups: dict[str, dict[str, int]] = {"events": {}, "statuses": {}, "recovery": {}, "claims": {}}
    names = {"event": "events", "status": "statuses", "recovery": "recovery", "claim": "claims"}
    for label in sorted(coverage):
        family, _, name = label.partition(":")
        groups.setdefault(names.get(family, family), {})[name] = coverage[label]
    return groups


@contextmanager
def _progress_line(
    forced: bool, depth: int, max_states: int, max_memory_mib: int
) -> Iterator[Progress]:
    """A progress callback drawing on stderr: in place on a terminal, one line per update when
    ``forced`` (``--progress``) on anything else, nothing otherwise; erased at the end."""
    from hybridkv.cli.progress_line import ProgressLine

    with ProgressLine(force=forced) as line:

        def advance(now: Snapshot) -> None:
            held = "?" if now.rss_bytes is None else f"{now.rss_bytes // _MIB:,}"
            line.update(
                f"hybridkv check: {now.states:,}/{max_states:,} states, depth {now.depth}/"
                f"{depth}, {now.states_per_second:,.0f} states/s, {held}/{max_memory_mib:,} MiB, "
                f"{line.elapsed():.0f}s"
            )

        yield advance


_VERDICTS = {
    "pass": "no invariant broke, every required event and status was reached, nothing was cut",
    "violation": "an invariant broke; its shortest trace is above",
    "uncovered": "no invariant broke, but the labels listed as uncovered were never reached, so "
    "the search proves nothing about them: raise --depth or change --start",
}


def explain_bounds(report: Mapping[str, Any]) -> list[str]:
    """What ``exhaustive`` and ``complete`` mean for this report, in words (one line each)."""
    bound = report["max_depth"]
    if report["exhaustive"]:
        exhaustive = f"exhaustive: yes = every state reachable within {bound} actions was checked"
    elif report["violations"]:
        exhaustive = "exhaustive: no = the search stopped at the first depth with a violation"
    else:
        flag = report["bound"]["flag"]
        exhaustive = f"exhaustive: no = {flag} cut the search before the depth bound"
    if report["complete"]:
        complete = "complete: yes = no state could act further: the whole reachable space was seen"
    elif not report["exhaustive"]:
        complete = "complete: no = the search stopped early, so the rest of the space is unseen"
    else:
        complete = (
            f"complete: no = some states at depth {report['depth']} can still act; a larger "
            "--depth reaches more (the bound, not a failure)"
        )
    return [exhaustive, complete]


def _render(report: Mapping[str, Any]) -> None:
    from rich.console import Console

    console = Console()
    sc = report["scenario"]
    console.print(
        f"[bold]hybridkv check[/]: {sc['requests']} request(s), groups {sc['groups']}, "
        f"start {sc['start']}, recovery {sc['recovery']}"
    )
    console.print(
        f"states explored: {report['states']}  transitions: {report['transitions']}  "
        f"states/s: {report['states_per_second']:.0f}  time: {report['seconds']:.2f}s"
    )
    console.print(
        f"depth reached: {report['depth']} of {report['max_depth']}  "
        f"exhaustive: {'yes' if report['exhaustive'] else 'no'}  "
        f"complete: {'yes' if report['complete'] else 'no'}"
    )
    for line in explain_bounds(report):
        console.print(f"  {line}", highlight=False)
    for family, counts in report["coverage"].items():
        listed = ", ".join(f"{name} {n}" for name, n in counts.items())
        console.print(f"coverage {family}: {listed or '-'}")
    if report["uncovered"]:
        console.print(f"[yellow]uncovered:[/] {', '.join(report['uncovered'])}")
    for v in report["violations"]:
        console.print(f"[red]violation {v['invariant']}[/]: {'; '.join(v['messages'])}")
        for i, step in enumerate(v["trace"], 1):
            console.print(f"  {i:2}. {step}")
    if report["verdict"] == "cut":
        # The last line a cut search prints: which flag to raise, and that nothing past what
        # it counts was checked. (A violation found before the cut keeps its verdict line.)
        console.print(report["bound"]["message"], highlight=False, soft_wrap=True)
    else:
        colour = "green" if report["verdict"] == "pass" else "red"
        verdict = report["verdict"]
        console.print(f"verdict: [{colour}]{verdict}[/] ({_VERDICTS[verdict]})")
    sys.stdout.flush()
