"""The GPU checks without a registry (docs/howto/gpu-offline.md), checked on a CPU machine.

``tools/pack_gpu_run.py`` packs into a temporary folder, from a stand-in vLLM 0.33.0 distribution
that carries a compiled kernel (the real one on this machine has its ``.so`` files deleted
already, so it could not show them left out), and the archive must hold what the page says.
``tools/gpu_checks.py`` and ``nox -s gpu_offline`` must stop with their one line on an
interpreter without CUDA.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType

import pytest
import torch

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib  # pytest itself needs tomli below 3.11

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "howto" / "gpu-offline.md"
NO_CUDA = "hybridkv GPU checks: cannot run here: no CUDA device visible to torch"


def _load(name: str) -> ModuleType:
    loaded = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert loaded is not None
    assert loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


pack_gpu_run = _load("pack_gpu_run")


def _stand_in_vllm(site: Path) -> None:
    """A vllm 0.33.0 distribution as pip lays it out: sources, a kernel, byte code, a script."""
    files = {
        "vllm/__init__.py": "__version__ = '0.33.0'\n",
        "vllm/v1/core/sched/scheduler.py": "class Scheduler: ...\n",
        "vllm/_C.abi3.so": "\x7fELF kernel",
        "vllm/__pycache__/__init__.cpython-311.pyc": "byte code",
    }
    for path, text in files.items():
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_text(text)
    info = site / "vllm-0.33.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
    record = [*files, "vllm-0.33.0.dist-info/METADATA", "../../../bin/vllm"]
    (info / "RECORD").write_text(
        "".join(f"{p},,\n" for p in [*record, "vllm-0.33.0.dist-info/RECORD"])
    )


def _doc_commands() -> list[str]:
    """The lines of the page's 'Run, on the GPU machine' block."""
    section = DOC.read_text().split("## 2. Run, on the GPU machine", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block is not None
    return block.group(1).strip().splitlines()


def test_the_archive_holds_what_the_page_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site-packages"
    _stand_in_vllm(site)
    monkeypatch.syspath_prepend(str(site))
    assert pack_gpu_run.main(["--out", str(tmp_path / "dist"), "--no-deps", "--level", "1"]) == 0
    with tarfile.open(tmp_path / "dist" / "hybridkv-gpu-run.tar.gz") as archive:
        names = set(archive.getnames())
        member = archive.extractfile("hybridkv-gpu-run/gpu-run.json")
        assert member is not None
        manifest = json.load(member)
    top = "hybridkv-gpu-run/"
    assert all(name.startswith(top) for name in names)
    # The project, as git lists it: the runner, the GPU tests, both packages, the config.
    for path in (
        "tools/gpu_checks.py",
        "tests/gpu/test_vllm_worker_cuda.py",
        "tests/conftest.py",
        "spec/explorer.py",
        "hybridkv/vllm/connector.py",
        "pyproject.toml",
        "noxfile.py",
    ):
        assert top + path in names, path
    # vLLM's sources and metadata, without its kernel, byte code or console script.
    assert top + "site/vllm/v1/core/sched/scheduler.py" in names
    assert top + "site/vllm-0.33.0.dist-info/METADATA" in names
    assert not [n for n in names if n.endswith((".so", ".pyc")) or "/bin/" in n]
    assert manifest["packages"] == {"vllm": "0.33.0"}
    assert manifest["python"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert manifest["commands"] == _doc_commands()


def test_the_full_pack_takes_vllm_deps_but_not_what_cuda_torch_brings() -> None:
    names = {pack_gpu_run.normalize(n) for n in pack_gpu_run.packed_names(with_deps=True)}
    assert {"vllm", "transformers", "pydantic", "xgrammar", "pytest", "hypothesis"} <= names
    assert not names & {"torch", "torchvision", "filelock", "sympy", "networkx", "jinja2"}
    assert pack_gpu_run.packed_names(with_deps=False) == ["vllm"]


def test_packing_without_vllm_0_33_says_what_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(pack_gpu_run, "packed_names", lambda with_deps: ["no-such-dist-here"])
    assert pack_gpu_run.main(["--out", str(tmp_path), "--no-deps"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pack_gpu_run: no-such-dist-here is not installed in")
    assert "nox -s vllm --install-only" in err
    assert not list(tmp_path.iterdir())  # nothing written


needs_cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the dry run is for an interpreter without CUDA"
)


@needs_cpu_only
@pytest.mark.parametrize("argv", [[], ["--probe"]])
def test_gpu_checks_stop_with_one_line_without_cuda(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "tools/gpu_checks.py", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 3
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(NO_CUDA)
    assert lines[0].endswith("Nothing was run.")


@needs_cpu_only
def test_nox_gpu_offline_installs_nothing_and_stops_without_cuda() -> None:
    pytest.importorskip("nox")
    done = subprocess.run(
        [sys.executable, "-m", "nox", "-s", "gpu_offline"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 1
    said = done.stdout + done.stderr  # nox passes the script's stderr through its stdout
    assert NO_CUDA in said
    assert "Session gpu_offline aborted: no CUDA here" in said
    assert "install" not in said  # neither pip nor uv was called
    assert not (ROOT / ".nox" / "gpu_offline").exists()  # no environment was made


def test_the_cuda_figure_covers_exactly_what_the_cpu_figure_omits(tmp_path: Path) -> None:
    pytest.importorskip("pytest_cov")
    gpu_checks = _load("gpu_checks")
    omitted = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["coverage"]["run"]
    assert sorted(gpu_checks.CUDA_FILES) == sorted(omitted["omit"])
    args = gpu_checks.cuda_coverage_args(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu/test_cuda_engine.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "COVERAGE_FILE": str(tmp_path / ".coverage.gpu")},
    )
    assert done.returncode == 0, done.stdout[-2000:]
    reported = set(re.findall(r"^(hybridkv/\S+\.py) ", done.stdout, re.MULTILINE))
    assert reported == {pattern.removeprefix("*/") for pattern in gpu_checks.CUDA_FILES}
    assert re.search(r"^TOTAL\s+\d+", done.stdout, re.MULTILINE)


def _fake_pip(
    monkeypatch: pytest.MonkeyPatch, calls: list[list[str]], *, fails: bool = False
) -> None:
    """pip, as ``fetch_for`` calls it, replaced by one that lays out each named package in
    ``--target`` with a compiled module for CPython 3.12 and a console script (git still runs)."""
    real_run = subprocess.run

    def run(command: list[str], **kwargs: object) -> object:
        if command[1:3] != ["-m", "pip"]:
            return real_run(command, **kwargs)  # type: ignore[call-overload]
        calls.append(command)
        if fails:
            return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution")
        target = Path(command[command.index("--target") + 1])
        for requirement in (c for c in command if "==" in c):
            name = requirement.split("==")[0]
            (target / name).mkdir(parents=True)
            (target / name / "__init__.py").write_text("")
            (target / name / "_speed.cpython-312-x86_64-linux-gnu.so").write_text("\x7fELF")
        (target / "bin").mkdir(exist_ok=True)
        (target / "bin" / "script").write_text("#!")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(pack_gpu_run.subprocess, "run", run)


def test_packing_for_another_python_fetches_the_dependencies_built_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site-packages"
    _stand_in_vllm(site)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(pack_gpu_run, "packed_names", lambda with_deps: ["vllm", "pluggy"])
    calls: list[list[str]] = []
    _fake_pip(monkeypatch, calls)
    argv = ["--out", str(tmp_path / "dist"), "--python", "3.12", "--level", "1"]
    assert pack_gpu_run.main(argv) == 0
    # One pip call: the dependency at the version installed here, as a CPython 3.12 wheel.
    (command,) = calls
    assert command[command.index("--python-version") + 1] == "3.12"
    assert command[command.index("--implementation") + 1] == "cp"
    assert {"--only-binary=:all:", "--no-deps", "--platform=manylinux2014_x86_64"} <= set(command)
    assert [c for c in command if "==" in c] == [
        f"pluggy=={pack_gpu_run.metadata.version('pluggy')}"
    ]
    with tarfile.open(tmp_path / "dist" / "hybridkv-gpu-run.tar.gz") as archive:
        names = set(archive.getnames())
        member = archive.extractfile("hybridkv-gpu-run/gpu-run.json")
        assert member is not None
        manifest = json.load(member)
    top = "hybridkv-gpu-run/site/"
    # What pip laid out for 3.12, without its scripts; vLLM copied from here, without kernels.
    assert top + "pluggy/_speed.cpython-312-x86_64-linux-gnu.so" in names
    assert not [n for n in names if n.startswith(top + "bin")]
    assert top + "vllm/v1/core/sched/scheduler.py" in names
    assert top + "vllm/_C.abi3.so" not in names
    assert manifest["python"] == "3.12"
    assert manifest["packages"]["pluggy"] == pack_gpu_run.metadata.version("pluggy")


def test_packing_for_another_python_without_its_wheels_writes_no_archive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    site = tmp_path / "site-packages"
    _stand_in_vllm(site)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(pack_gpu_run, "packed_names", lambda with_deps: ["vllm", "pluggy"])
    _fake_pip(monkeypatch, [], fails=True)
    assert pack_gpu_run.main(["--out", str(tmp_path / "dist"), "--python", "3.12"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pack_gpu_run: pip could not fetch the wheels for Python 3.12")
    assert "ERROR: No matching distribution" in err
    assert not (tmp_path / "dist" / "hybridkv-gpu-run.tar.gz").exists()


@pytest.mark.parametrize("python", ["3", "3.12.1", "python3.12", "12"])
def test_a_python_that_is_not_a_minor_version_is_refused(
    tmp_path: Path, python: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert pack_gpu_run.main(["--out", str(tmp_path), "--python", python]) == 2
    err = capsys.readouterr().err
    assert (
        err == f"pack_gpu_run: --python {python!r} is not a Python minor version: give it as 3.12\n"
    )
    assert not list(tmp_path.iterdir())
