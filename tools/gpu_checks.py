"""The GPU checks with the packages already in this interpreter: nothing is installed.

Runs ``pytest -m gpu tests/gpu`` (the CUDA transfer engine, and the connector's worker on CUDA
caches inside vLLM 0.33's real ``Scheduler``: tests/gpu/test_vllm_worker_cuda.py), then every
``tools/bench_gpu_*.py``. Where pytest-cov is installed, the tests also print the coverage of
the CUDA modules the CPU figure omits (their own figure, data in ``.coverage.gpu``).
``nox -s gpu`` runs it after installing vLLM and the project from the registry; ``nox -s
gpu_offline`` and an unpacked ``tools/pack_gpu_run.py`` archive run it as it is, for a GPU
machine with CUDA torch and no registry (docs/howto/gpu-offline.md).

Before running anything it checks what the run needs, and stops with one line saying what is
missing and how to get it: a CUDA device visible to torch; vLLM (the worker test would
otherwise skip, and that test is the point of the run); and, in an unpacked archive, the Python
version the archive's compiled packages were built for.

Usage: ``python tools/gpu_checks.py [--probe] [PYTEST ARGS...]``. ``--probe`` checks the
device only and runs nothing (``nox -s gpu`` asks it before downloading anything).

Exit codes: 0 every test and benchmark passed; 1 one failed; 3 this machine cannot run the
checks (the line on stderr says why).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "gpu-run.json"  # written by tools/pack_gpu_run.py into its archive
EXIT_CANNOT_RUN = 3

# vLLM plans with its CPU platform (tests/gpu/test_vllm_worker_cuda.py's docstring), offline.
VLLM_CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def cuda_problem() -> str | None:
    """Why this interpreter cannot run CUDA work (``None`` when it can)."""
    try:
        import torch  # probed here: a missing torch is one of the answers
    except ImportError:
        return f"torch does not import in {sys.executable}"
    if not torch.cuda.is_available():
        cuda = torch.version.cuda
        build = f"built for CUDA {cuda}" if cuda else "a CPU build"
        return f"no CUDA device visible to torch {torch.__version__} ({build})"
    return None


def setup_problem() -> str | None:
    """Why the packages here cannot run the vLLM worker test (``None`` when they can)."""
    if MANIFEST.exists():
        packed = json.loads(MANIFEST.read_text(encoding="utf-8"))["python"]
        running = f"{sys.version_info.major}.{sys.version_info.minor}"
        if packed != running:
            return (
                f"this archive's compiled packages are for Python {packed}, this is {running}: "
                f"run it with a python{packed}, or pack it with a Python {running} interpreter"
            )
    if importlib.util.find_spec("vllm") is None:
        return (
            "vLLM does not import here, so tests/gpu/test_vllm_worker_cuda.py would skip: "
            "put the site/ folder of tools/pack_gpu_run.py's archive on PYTHONPATH"
        )
    return None


# The files the CPU figure omits (pyproject.toml [tool.coverage.run]): only a GPU runs them.
CUDA_FILES = (
    "*/hybridkv/transfer/cuda_engine.py",
    "*/hybridkv/transfer/cuda_batch.py",
    "*/hybridkv/transfer/cuda_kernels.py",
    "*/hybridkv/cuda_driver.py",
)


def cuda_coverage_args(scratch: Path) -> list[str]:
    """pytest-cov arguments printing the CUDA files' own figure (statements and branches),
    or none where pytest-cov is not installed (the run is the same without it)."""
    if importlib.util.find_spec("pytest_cov") is None:
        return []
    config = scratch / "coveragerc"
    # The package is measured and the report narrowed to the files: naming the modules in
    # source_pkgs instead crashed coverage 7.17's tracer (a segfault) on the CPU dry run.
    files = "".join(f"    {pattern}\n" for pattern in CUDA_FILES)
    text = f"[run]\nbranch = True\nsource_pkgs = hybridkv\n[report]\ninclude =\n{files}"
    config.write_text(text, encoding="utf-8")
    return [
        "--cov",
        f"--cov-config={config}",
        "--cov-report=term-missing",
        "--cov-fail-under=0",
    ]


def main(argv: list[str]) -> int:
    """Check this machine, then run the tests and the benchmarks; returns the exit code."""
    probe_only = "--probe" in argv
    pytest_args = [a for a in argv if a != "--probe"]
    problem = cuda_problem()
    if problem is None and not probe_only:
        problem = setup_problem()
    if problem is not None:
        print(
            f"hybridkv GPU checks: cannot run here: {problem}. They need a GPU and a CUDA "
            "build of torch in this interpreter (docs/howto/gpu-offline.md); the CPU tests run "
            "in `nox -s tests`. Nothing was run.",
            file=sys.stderr,
        )
        return EXIT_CANNOT_RUN
    if probe_only:
        return 0
    env = {**os.environ, **VLLM_CPU_ENV, "COVERAGE_FILE": str(ROOT / ".coverage.gpu")}
    tests = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider"]
    with tempfile.TemporaryDirectory() as scratch:
        command = [*tests, *cuda_coverage_args(Path(scratch)), *pytest_args]
        failed = subprocess.run(command, cwd=ROOT, env=env, check=False).returncode
    for bench in sorted((ROOT / "tools").glob("bench_gpu_*.py")):
        failed |= subprocess.run([sys.executable, str(bench)], cwd=ROOT, check=False).returncode
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
