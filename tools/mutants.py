"""Mutation testing over whole modules with mutmut, one module at a time, with its own tests.

For each module of :data:`MODULES` the project's tracked files are copied to a scratch folder,
mutmut (pinned in ``noxfile.py``'s ``mutants`` session) is told to mutate that one file and to
run that module's tests, and its verdicts are counted. mutmut runs, for each mutant, only the
tests that executed the mutated function (it records that in a first, unmutated run), so a
module's test list can be wide without every mutant paying for all of it.

A surviving mutant is either a gap in the tests (a test is then added that kills it) or
*equivalent*: no test can tell it apart, because the program's behaviour does not change.
Equivalent mutants are listed, each with the line the mutant writes and why it is equivalent,
in ``tools/mutants_equivalent.json``; the listing is checked against the mutant mutmut
generates today (a listed name whose diff no longer writes the recorded line is stale, which
fails the run: mutmut numbers mutants per function, so an edit can shift the numbers).

Counted per module: mutants, killed (a test failed, or the run timed out, which mutmut counts
as a detection), equivalent, survivors (neither), and the kill rate: killed / (mutants -
equivalent). The run fails when a module's kill rate is below ``--floor`` (0.90), when a listed
equivalent is stale or was killed, or when mutmut could not run a module.

Usage: ``python tools/mutants.py [--module hybridkv/planner.py ...] [--max-children N]
[--json PATH] [--survivors]``; ``nox -s mutants`` installs what it needs. ``--survivors``
prints each survivor's diff (what to triage), and each timeout's (to check by hand).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT_FILE = ROOT / "tools" / "mutants_equivalent.json"

# module -> the tests that exercise it (the unit tests first; mutmut picks per mutant the ones
# that ran its function). The vllm modules' tests import vLLM 0.33 (``nox -s mutants``
# installs it as ``nox -s vllm`` does).
_STORE_TESTS = (
    "tests/store",
    "tests/differential/test_store_agreement.py",
    "tests/stateful/test_store_machine.py",
)
# The core's own tests (tests/connector: 213 tests in about 6 s, every refusal pinned whole in
# test_core_refusals.py) and the finished-load agreement (fast). Not the differential machines
# (tests/differential/test_connector_agreement.py, about 45 s a run, and
# test_connector_hooks_agreement.py, about 10 s alone and 36 s under mutmut's tracing on the
# loaded machine): every mutant of the core reaches them, so each survivor would pay them and
# each hanging mutant would wait 15 times their time (mutmut's limit) before it is counted.
# They stay in the tests session.
_CORE_TESTS = (
    "tests/connector",
    "tests/differential/test_connector_finished_load.py",
)

# The store manager's own tests (tests/store: every refusal whole, admission, entry states,
# the policies' contracts; well under a second) and the core's bookkeeping through the store.
# Not the store's state machine or its agreement with the spec (tests/stateful,
# tests/differential: about 30 s unmutated, and several minutes a mutant at the load the
# other rows ran under, since every manager mutant reaches them and a surviving one pays them
# whole). They stay in the tests session.
_MANAGER_TESTS = (
    "tests/store",
    "tests/connector/test_core_bookkeeping.py",
)

MODULES: dict[str, tuple[str, ...]] = {
    "hybridkv/planner.py": (
        "tests/test_planner_contract.py",
        "tests/differential/test_planner_agreement.py",
        "tests/connector/test_connector_errors.py",
        "tests/cli/test_plan_fuzz.py",
    ),
    "hybridkv/hashing.py": (
        "tests/differential/test_hashing_agreement.py",
        "tests/connector/test_engine_hashes.py",
        "tests/connector/test_hashing_contract.py",
    ),
    **{f"hybridkv/store/{name}.py": _STORE_TESTS for name in ("lru", "arc", "capacity", "values")},
    "hybridkv/store/manager.py": _MANAGER_TESTS,
    # The policy base, its factory and the MIN oracle: the store's own tests reach them all.
    **{f"hybridkv/store/{name}.py": ("tests/store",) for name in ("policy", "policies", "belady")},
    "hybridkv/connector/core.py": _CORE_TESTS,
    # The core's load path and its key lists: the core's tests, and the load path held to the
    # reference's item for item on drawn layouts, claims and tables (well under a second).
    **{
        f"hybridkv/connector/{name}.py": (
            *_CORE_TESTS,
            "tests/differential/test_loads_agreement.py",
        )
        for name in ("loads", "requests")
    },
    "hybridkv/connector/worker.py": (
        "tests/connector/test_worker_contract.py",
        "tests/connector/test_transfer_worker.py",
        "tests/connector/test_worker_abandon.py",
    ),
    # The claim search against the plain rule (fast); the differential machine that compares the
    # whole core with the spec's (tests/differential/test_connector_agreement.py) takes ~45 s a
    # run, paid by every survivor, so it is left to the tests session.
    "hybridkv/connector/claims.py": (
        "tests/connector/test_claim_search.py",
        "tests/connector/test_scheduler_side_fast_paths.py",
    ),
    "hybridkv/remote/codec.py": (
        "tests/remote/test_codec.py",
        "tests/remote/test_codec_refusals.py",
        "tests/remote/test_codec_keyed.py",
    ),
    "hybridkv/remote/security.py": ("tests/remote/test_codec_keyed.py",),
    # Not tests/vllm/test_hybridkv_tensor_parallel.py: a mutant it reaches often leaves its
    # two-rank engines waiting (0% CPU) until mutmut's wall-clock limit, minutes a mutant; it
    # stays in the vllm session.
    "hybridkv/vllm/ranks.py": ("tests/vllm/test_ranks_units.py",),
    "hybridkv/vllm/config.py": (
        "tests/vllm/test_extra_config_refusals.py",
        "tests/vllm/test_remote_secure.py",
        "tests/vllm/test_hybridkv_connector.py",
    ),
}

# mutmut's verdicts (its ``mutmut results --all true`` words) that count as a detection.
DETECTED = frozenset({"killed", "timeout", "caught by type check"})
UNDETECTED = frozenset({"survived", "no tests", "suspicious"})


class MutantsError(RuntimeError):
    """mutmut could not run a module, or its verdicts could not be read."""


@dataclass(frozen=True)
class ModuleResult:
    """One module's counts, as mutmut reported them."""

    module: str
    mutants: int
    killed: int
    equivalent: int
    survivors: tuple[str, ...]
    stale_equivalents: tuple[str, ...]
    seconds: float
    # Counted as killed, as mutmut does; listed so that each can be checked by hand (a mutant
    # that loops forever is a detection, a test run that hangs for another reason is not).
    timeouts: tuple[str, ...] = ()

    @property
    def kill_rate(self) -> float:
        judged = self.mutants - self.equivalent
        return self.killed / judged if judged else 1.0


def _copy_tree(destination: Path) -> None:
    """The tracked files (and untracked ones git does not ignore) as they are on disk now."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    for name in listed:
        source = ROOT / name
        if not source.is_file():
            continue  # deleted in the working tree but still in the index
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def _setup_cfg(module: str, tests: tuple[str, ...]) -> str:
    # mutmut reads [tool.mutmut] from pyproject.toml first: the project keeps none, so this file
    # is the whole configuration. ``source_paths`` is the package (so that every other module
    # is copied beside the mutated one); ``only_mutate`` narrows the mutations to one file.
    lines = [
        "[mutmut]",
        "source_paths=hybridkv",
        f"only_mutate={module}",
        "pytest_add_cli_args_test_selection=",
        *(f"  {test}" for test in tests),
        "also_copy=",
        "  spec",
        "  tools",
        "  docs",  # tests/vllm/test_hybridkv_connector.py reads docs/howto/serve.md's recipe
        "  conftest.py",
    ]
    return "\n".join(lines) + "\n"


def _verdicts(workdir: Path, env: dict[str, str]) -> dict[str, str]:
    shown = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        check=False,  # a failure is reported below, with mutmut's own words
    )
    verdicts: dict[str, str] = {}
    for line in shown.stdout.splitlines():
        found = re.match(r"\s*(\S+__mutmut_\d+): (.+)$", line)
        if found:
            verdicts[found.group(1)] = found.group(2).strip()
    if shown.returncode != 0 or not verdicts:
        raise MutantsError(f"`mutmut results` gave no verdicts:\n{shown.stdout}\n{shown.stderr}")
    return verdicts


def _diff(workdir: Path, env: dict[str, str], name: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "mutmut", "show", name],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def _written_lines(diff: str) -> list[str]:
    return [
        line[1:].strip()
        for line in diff.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]


def _has_mutants(mutated: Path) -> bool:
    """Whether mutmut wrote any mutant into its copy of the module (it names each
    ``x_<function>__mutmut_<n>``); a copy that is missing is read as having some, so that
    mutmut's own failure is reported."""
    return not mutated.is_file() or "__mutmut_" in mutated.read_text()


def run_module(
    module: str,
    tests: tuple[str, ...],
    equivalents: dict[str, dict[str, str]],
    *,
    max_children: int,
    show_survivors: bool,
) -> ModuleResult:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hybridkv-mutants-") as scratch:
        workdir = Path(scratch)
        _copy_tree(workdir)
        (workdir / "setup.cfg").write_text(_setup_cfg(module, tests))
        env = {
            **os.environ,
            "PYTHONPATH": "",  # the mutated copy, not an editable install, must be imported
            "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci"),
            # mutmut forks each mutant's run from a process that has already run the tests:
            # torch's OpenMP pool does not survive a fork, and a forked child that starts a
            # parallel kernel waits forever on the parent's threads (seen: torch.zeros in a
            # barrier, 0 CPU seconds), then counts as a timeout, which is a false kill. One
            # thread keeps every kernel in the calling thread.
            "OMP_NUM_THREADS": "1",
        }
        ran = subprocess.run(
            [sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children)],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            check=False,  # a failure is reported below, with mutmut's own words
        )
        if ran.returncode != 0 and not _has_mutants(workdir / "mutants" / module):
            # mutmut mutates code inside functions and methods only (its trampolines swap
            # whole functions): a module of enums, dataclasses and constants gets no mutant,
            # and mutmut then stops early, finding no test for any. Nothing to count.
            return ModuleResult(module, 0, 0, 0, (), (), round(time.monotonic() - started, 1))
        if ran.returncode != 0:
            tail = "\n".join(ran.stdout.replace("\r", "\n").splitlines()[-30:])
            raise MutantsError(
                f"mutmut failed on {module} (exit {ran.returncode}):\n{tail}\n{ran.stderr[-2000:]}"
            )
        verdicts = _verdicts(workdir, env)
        unknown = sorted(set(verdicts.values()) - DETECTED - UNDETECTED)
        if unknown:
            raise MutantsError(f"{module}: mutmut verdicts this tool does not know: {unknown}")
        killed = sum(1 for v in verdicts.values() if v in DETECTED)
        equivalent = 0
        stale: list[str] = []
        survivors: list[str] = []
        for name, verdict in sorted(verdicts.items()):
            listed = equivalents.get(name)
            if listed is not None:
                writes = _written_lines(_diff(workdir, env, name))
                if listed["writes"] not in writes:
                    stale.append(
                        f"{name}: listed as writing {listed['writes']!r}, now writes {writes!r}"
                    )
                elif verdict in DETECTED:
                    stale.append(f"{name}: listed as equivalent but a test now kills it")
                else:
                    equivalent += 1
                continue
            if verdict in UNDETECTED:
                survivors.append(name)
                if show_survivors:
                    print(f"--- survivor ({verdict})", _diff(workdir, env, name), sep="\n")
            elif verdict == "timeout" and show_survivors:
                # Counted as killed, but each is to be applied by hand (a hang or a slow
                # survivor): its diff is printed with the survivors', since the scratch folder
                # that could show it is gone when the run ends.
                print("--- timeout (counted as killed)", _diff(workdir, env, name), sep="\n")
        missing = sorted(set(equivalents) - set(verdicts))
        stale.extend(
            f"{name}: listed as equivalent but mutmut no longer generates it" for name in missing
        )
    return ModuleResult(
        module=module,
        mutants=len(verdicts),
        killed=killed,
        equivalent=equivalent,
        survivors=tuple(survivors),
        stale_equivalents=tuple(stale),
        seconds=round(time.monotonic() - started, 1),
        timeouts=tuple(name for name, v in sorted(verdicts.items()) if v == "timeout"),
    )


def _rate(result: ModuleResult) -> str:
    # A module with no mutant has no rate to show (mutmut found nothing to change in it).
    return f"{result.kill_rate:.1%}" if result.mutants else "none"


def _load_equivalents() -> dict[str, dict[str, dict[str, str]]]:
    data = json.loads(EQUIVALENT_FILE.read_text()) if EQUIVALENT_FILE.exists() else {}
    for module, entries in data.items():
        if module not in MODULES:
            raise MutantsError(f"{EQUIVALENT_FILE.name}: {module!r} is not a module of MODULES")
        for name, entry in entries.items():
            if set(entry) != {"writes", "why"} or not entry["why"].strip():
                raise MutantsError(
                    f"{EQUIVALENT_FILE.name}: {name} needs exactly 'writes' and a non-empty 'why'"
                )
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--module", action="append", choices=sorted(MODULES), help="default: every module"
    )
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--floor", type=float, default=0.90)
    parser.add_argument("--json", type=Path, help="write the per-module counts here")
    parser.add_argument("--survivors", action="store_true", help="print each survivor's diff")
    args = parser.parse_args(argv)
    equivalents = _load_equivalents()
    results: list[ModuleResult] = []
    failed = False
    print(f"{'module':32} {'mutants':>7} {'killed':>6} {'equiv':>5} {'surv':>4}", end="")
    print(f" {'rate':>6} {'secs':>6}")
    for module in args.module or sorted(MODULES):
        try:
            result = run_module(
                module,
                MODULES[module],
                equivalents.get(module, {}),
                max_children=args.max_children,
                show_survivors=args.survivors,
            )
        except MutantsError as error:
            print(f"{module}: {error}")
            failed = True
            continue
        results.append(result)
        print(
            f"{module:32} {result.mutants:7d} {result.killed:6d} {result.equivalent:5d} "
            f"{len(result.survivors):4d} {_rate(result):>6} {result.seconds:6.0f}",
            flush=True,
        )
        for name in result.survivors:
            print(f"  survivor: {name}")
        for name in result.timeouts:
            print(f"  timeout (counted as killed): {name}")
        for line in result.stale_equivalents:
            print(f"  stale equivalent: {line}")
        failed |= result.kill_rate < args.floor or bool(result.stale_equivalents)
    if args.json:
        rows = [{**asdict(r), "kill_rate": round(r.kill_rate, 4)} for r in results]
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
