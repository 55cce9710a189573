"""What the benchmarks that drive vLLM's real scheduler do before importing it.

- :func:`torchvision_shim`: tests/vllm's shim. PyPI torchvision imports beside CPU torch only
  once it has declared two operators (tests/vllm/conftest.py); the caller keeps the returned
  module alive, or the operators go again.
- :func:`require_vllm`: vLLM 0.33 must import, else the tool exits 2 with one line naming the
  nox sessions that install it.

A module of the tools, not a benchmark (``nox -s bench`` runs ``bench_*.py`` only).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

SHIM = Path(__file__).resolve().parents[1] / "tests" / "vllm" / "_torchvision_shim"


def torchvision_shim(tool: str) -> object:
    """Load the shim under a name of ``tool``'s own; None where torch is missing."""
    found = importlib.util.spec_from_file_location(
        f"_{tool}_torchvision_shim", SHIM / "sitecustomize.py"
    )
    if found is None or found.loader is None or importlib.util.find_spec("torch") is None:
        return None
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


def require_vllm(tool: str) -> None:
    """Exit 2 with one line if vLLM 0.33's config module does not import."""
    try:
        importlib.import_module("vllm.config")
    except ImportError as missing:
        print(
            f"{tool}: vLLM 0.33 is not importable here ({missing}); run it under "
            "`nox -s bench` or `nox -s vllm`, which install vLLM "
            "(tests/vllm/requirements-vllm.txt, then vllm==0.33.0 --no-deps), "
            "with VLLM_TARGET_DEVICE=cpu",
            file=sys.stderr,
        )
        sys.exit(2)
