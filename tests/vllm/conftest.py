"""Shared set-up of the tests that run vLLM 0.33's own code (``nox -s vllm``).

The PyPI torchvision that vLLM's Qwen3.5 module needs is built for CUDA torch; beside CPU torch
it imports only after ``_torchvision_shim`` declares two of its operators. This conftest does
that in the pytest process before anything imports vLLM, and the ``vllm_subprocess_env``
fixture puts the shim on PYTHONPATH for subprocesses (vLLM inspects models in a subprocess).

A bare ``pytest`` without vLLM skips these tests. ``nox -s vllm`` sets ``HYBRIDKV_REQUIRE_VLLM=1``:
then vLLM must import, or the run stops here with vLLM's own import error, so a broken vLLM
install cannot pass green as a suite of skips.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path

import pytest
from _inprocess import VLLM_CPU_ENV

TORCHVISION_SHIM = Path(__file__).parent / "_torchvision_shim"
# The subprocesses import hybridkv.vllm.harness.planning: from this checkout, like the pytest
# process.
REPO_ROOT = Path(__file__).resolve().parents[2]
REQUIRE_VLLM_ENV = "HYBRIDKV_REQUIRE_VLLM"
# Real submodules, not ``vllm``: with tests/ on sys.path, tests/vllm itself imports as a namespace
# package named vllm, so only these prove an installed vLLM (the modules the tests importorskip).
VLLM_PROBES = ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.sched.scheduler")

# vLLM reads these when it is first imported (platform detection, offline hub, log level); the
# nox session sets them too, a bare `pytest tests/vllm` gets them here.
for _key, _value in {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}.items():
    os.environ.setdefault(_key, _value)

# vLLM inspects a model's architecture in a subprocess of its own (ModelConfig -> the model
# registry), which inherits os.environ: with the shim on PYTHONPATH there, that subprocess imports
# torchvision too, whichever test builds the first ModelConfig of an architecture.
_paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
if str(TORCHVISION_SHIM) not in _paths:
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TORCHVISION_SHIM), *filter(None, _paths)])


def _install_torchvision_shim() -> object:
    spec = importlib.util.spec_from_file_location(
        "_hybridkv_torchvision_shim", TORCHVISION_SHIM / "sitecustomize.py"
    )
    if spec is None or spec.loader is None or importlib.util.find_spec("torch") is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Keep the shim module alive: the torch Library it holds un-declares the operators when it is
# garbage collected, and vLLM imports torchvision later, at collection of the test modules.
_SHIM = _install_torchvision_shim()


class VllmRequiredError(RuntimeError):
    """``HYBRIDKV_REQUIRE_VLLM`` is set and vLLM does not import (its error is the cause)."""


def require_vllm() -> None:
    """Import the probes; raise :class:`VllmRequiredError` from vLLM's own import error."""
    for name in VLLM_PROBES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # any import-time failure of vLLM, not only ImportError
            frames = traceback.extract_tb(exc.__traceback__)
            where = f" (raised at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
            if getattr(sys.modules.get("vllm"), "__file__", None) is None:
                where += "; no installed vllm package was found in this interpreter"
            raise VllmRequiredError(
                f"{REQUIRE_VLLM_ENV}=1 (set by `nox -s vllm`) but `import {name}` failed: "
                f"{type(exc).__name__}: {exc}{where}. Fix the vLLM install (tests/vllm/"
                "requirements-vllm.txt pins what it needs), or unset the variable to skip "
                "these tests"
            ) from exc


if os.environ.get(REQUIRE_VLLM_ENV) == "1":
    require_vllm()


@pytest.fixture(scope="session")
def vllm_subprocess_env() -> dict[str, str]:
    """The environment for a subprocess that imports vLLM on a CPU machine."""
    env = dict(os.environ)
    env.update(VLLM_CPU_ENV)
    paths = [
        str(TORCHVISION_SHIM),
        str(REPO_ROOT),
        *filter(None, env.get("PYTHONPATH", "").split(os.pathsep)),
    ]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


@pytest.fixture(scope="session")
def vllm_module() -> object:
    """vLLM itself, or a skip when it is not installed (``require_vllm`` ran if required)."""
    pytest.importorskip(VLLM_PROBES[0], reason="vLLM 0.33 is not installed (run `nox -s vllm`)")
    return sys.modules["vllm"]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print what the random lock-step traces covered (``diffharness.tally``), if any ran."""
    tally = sys.modules.get("diffharness.tally")
    lines = tally.summary() if tally is not None else []
    if lines:
        terminalreporter.section("spec vs vLLM 0.33: random traces")
        for line in lines:
            terminalreporter.write_line(line)
