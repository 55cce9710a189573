"""What a vLLM server imports of hybridkv: the connector package, never its test engine.

A fresh interpreter (no pytest, no test module imported before) does what ``vllm serve`` does
with the documented ``--kv-transfer-config``: ``import hybridkv.vllm``, then vLLM's own
``KVConnectorFactory.get_connector_class`` loads the class by module path, for each path the
docs give (``hybridkv.vllm.connector``, ``hybridkv.vllm``, and ``hybridkv.vllm.multi`` for
``WeightedMultiConnector``). Then ``sys.modules`` must hold:

- no module of ``hybridkv.vllm.harness`` (the in-process engine the tests and benchmarks run),
  nor of ``hybridkv.simulator``, ``hybridkv.cli`` or ``spec``;
- every module of hybridkv/vllm/ outside harness/: the package holds exactly what a server
  loads, so a connector author reads one folder and sees what ships.

The import-linter contract "The connector does not import the harness" (pyproject.toml) checks
the first rule on the static import graph; this test checks it on a live interpreter, where an
import done by name (``importlib``) or at class-build time shows too.

Guard: the same interpreter then imports ``hybridkv.vllm.harness.inprocess`` and the test asserts
it appears under the very prefix the check looks for, so a check that looked for a name no module
has could not pass.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

PACKAGE = Path(__file__).resolve().parents[2] / "hybridkv" / "vllm"
HARNESS = "hybridkv.vllm.harness"
# Packages a server must not load: the test engine, the simulator (it imports spec), the
# command line, and the spec itself.
NOT_IN_A_SERVER = (HARNESS, "hybridkv.simulator", "hybridkv.cli", "spec")
# (kv_connector, kv_connector_module_path) as docs/howto/serve.md and the package docstring give.
LOADS = (
    ("HybridKVConnector", "hybridkv.vllm.connector"),
    ("HybridKVConnector", "hybridkv.vllm"),
    ("WeightedMultiConnector", "hybridkv.vllm.multi"),
)

SERVER = f"""
import json, sys
import hybridkv.vllm
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

loaded = {{}}
for name, path in {LOADS!r}:
    config = KVTransferConfig(
        kv_connector=name, kv_connector_module_path=path, kv_role="kv_both"
    )
    cls = KVConnectorFactory.get_connector_class(config)
    loaded[path] = cls.__module__ + "." + cls.__qualname__
ours = ("hybridkv", "spec")
server_modules = sorted(m for m in sys.modules if m.split(".")[0] in ours)
try:
    import hybridkv.vllm.harness.inprocess
except ModuleNotFoundError:  # no harness package: the guard test fails, the others still run
    pass
guard = sorted(m for m in sys.modules if m.startswith({HARNESS!r}))
print(json.dumps({{"loaded": loaded, "modules": server_modules, "guard": guard}}))
"""


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _shipped_modules() -> set[str]:
    """Every module file of hybridkv/vllm/ outside harness/, as a dotted name."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[0] == "harness":
            continue
        names = parts[:-1] if parts[-1] == "__init__" else parts
        found.add(".".join(("hybridkv", "vllm", *names)))
    return found


@pytest.fixture(scope="module")
def server(vllm_subprocess_env: dict[str, str]) -> dict[str, Any]:
    """What the fresh interpreter loaded (its JSON line)."""
    done = subprocess.run(
        [sys.executable, "-c", SERVER],
        env=vllm_subprocess_env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_vllm_loads_each_documented_class_by_its_module_path(server: dict[str, Any]) -> None:
    assert server["loaded"] == {
        "hybridkv.vllm.connector": "hybridkv.vllm.connector.HybridKVConnector",
        "hybridkv.vllm": "hybridkv.vllm.connector.HybridKVConnector",
        "hybridkv.vllm.multi": "hybridkv.vllm.multi.WeightedMultiConnector",
    }


def test_a_server_imports_no_harness_simulator_cli_or_spec_module(server: dict[str, Any]) -> None:
    leaked = [m for m in server["modules"] if any(_under(m, p) for p in NOT_IN_A_SERVER)]
    assert leaked == [], f"a server would import {leaked}"


def test_the_server_package_holds_exactly_what_a_server_loads(server: dict[str, Any]) -> None:
    """hybridkv/vllm/ outside harness/ is what ships: a module there that a server never loads
    belongs in the harness (or nowhere); one a server loads elsewhere would be a surprise."""
    loaded = {m for m in server["modules"] if _under(m, "hybridkv.vllm")}
    assert loaded == _shipped_modules()


def test_guard_the_harness_check_names_real_modules(server: dict[str, Any]) -> None:
    """Importing the engine puts it under the prefix the checks above look for."""
    assert f"{HARNESS}.inprocess" in server["guard"]
    assert all(_under(m, HARNESS) for m in server["guard"])
