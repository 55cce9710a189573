"""What the tests that run vLLM's own code build in-process, shared by the pytest process
(``diffharness``) and the geometry subprocess (``_geometry_oracle.py``). The planning itself lives
in :mod:`hybridkv.vllm.harness.planning` (the in-process engine uses it too) and is re-exported
here.

- :data:`VLLM_CPU_ENV`: the environment that lets vLLM 0.33 import on a CPU-only machine;
- :func:`init_distributed`: vLLM's one-rank distributed state (the model constructors and the
  scheduler read it);
- :class:`InProcessExecutor`: a stand-in for the model executor that reports one in-process
  worker's KV-cache specs to ``EngineCore._initialize_kv_caches``;
- :func:`load_tool`: a benchmark of ``tools/`` imported as a module, for the tests that assert
  its figures.

Importing this module imports no vLLM: the conftest reads :data:`VLLM_CPU_ENV` before it has
installed the torchvision shim and before it knows whether vLLM imports at all, and
``hybridkv.vllm`` imports vLLM (it registers the connector), so the three planning names are
resolved on first use (PEP 562).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridkv.vllm.harness.planning import InProcessExecutor, init_distributed, plan_kv_caches

__all__ = [
    "VLLM_CPU_ENV",
    "InProcessExecutor",
    "init_distributed",
    "load_tool",
    "plan_kv_caches",
    "set_cpu_env",
]

VLLM_CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as the module ``name`` (registered in ``sys.modules`` first: its
    dataclasses resolve their annotations through it)."""
    path = Path(__file__).resolve().parents[2] / "tools" / f"{name}.py"
    found = importlib.util.spec_from_file_location(name, path)
    assert found is not None, path
    assert found.loader is not None, path
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = module
    found.loader.exec_module(module)
    return module


def set_cpu_env() -> None:
    """Put :data:`VLLM_CPU_ENV` into the environment (values already set are kept)."""
    for key, value in VLLM_CPU_ENV.items():
        os.environ.setdefault(key, value)


_PLANNING = frozenset({"InProcessExecutor", "init_distributed", "plan_kv_caches"})


def __getattr__(name: str) -> Any:
    if name in _PLANNING:
        from hybridkv.vllm.harness import planning

        return getattr(planning, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
