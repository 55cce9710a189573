"""tests/vllm/conftest.py: skip without vLLM, but fail with vLLM's import error when required.

``nox -s vllm`` sets ``HYBRIDKV_REQUIRE_VLLM=1``, so a broken vLLM install there must fail the
run, showing why vLLM did not import; a bare ``pytest`` on a machine without vLLM still skips
the tests that need it. Each case runs pytest in a subprocess on one vLLM test module, with a
fake ``vllm`` package first on PYTHONPATH whose import raises a known error: ImportError (an
install that is broken) or ModuleNotFoundError (one that is absent).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULE = ROOT / "tests" / "vllm" / "test_hashing_vs_vllm.py"
BROKEN = "fake vLLM broken on purpose by test_vllm_requirement"


def _fake_vllm(root: Path, error: str) -> Path:
    """A ``vllm`` package whose import raises ``error`` with the known message."""
    (root / "vllm").mkdir()
    (root / "vllm" / "__init__.py").write_text(f"raise {error}({BROKEN!r})\n")
    return root


@pytest.fixture(scope="module")
def broken_vllm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vLLM installed but broken: its import raises a plain ImportError."""
    return _fake_vllm(tmp_path_factory.mktemp("broken_vllm"), "ImportError")


@pytest.fixture(scope="module")
def missing_vllm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vLLM absent, whether or not this interpreter has it: ModuleNotFoundError on import."""
    return _fake_vllm(tmp_path_factory.mktemp("missing_vllm"), "ModuleNotFoundError")


def _pytest(path_first: Path, require: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDKV_REQUIRE_VLLM"}
    env["PYTHONPATH"] = os.pathsep.join([str(path_first), *filter(None, [env.get("PYTHONPATH")])])
    if require is not None:
        env["HYBRIDKV_REQUIRE_VLLM"] = require
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(MODULE), "-q", "-p", "no:cacheprovider", "-rs"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize("kind", ["broken_vllm", "missing_vllm"])
def test_required_vllm_that_does_not_import_fails_with_its_error(
    kind: str, request: pytest.FixtureRequest
) -> None:
    run = _pytest(request.getfixturevalue(kind), "1")
    out = run.stdout + run.stderr
    assert run.returncode not in (0, 5), out  # 5: no tests collected would also read as green
    assert BROKEN in out, out
    assert "HYBRIDKV_REQUIRE_VLLM=1" in out, out
    assert "passed" not in out, out
    assert "skipped" not in out, out


@pytest.mark.parametrize("require", [None, "0"])
def test_without_the_requirement_missing_vllm_skips(
    missing_vllm: Path, require: str | None
) -> None:
    """A bare pytest (or ``HYBRIDKV_REQUIRE_VLLM=0``) where vLLM is absent skips the module.

    (A vLLM that is present but raises a plain ImportError is pytest's business: from pytest 9.1
    ``importorskip`` reports it as an error, before that as a skip.)
    """
    run = _pytest(missing_vllm, require)
    out = run.stdout + run.stderr
    # The module is skipped whole at import, so pytest reports 5 (no test ran), not a failure.
    assert run.returncode == 5, out
    assert "1 skipped" in out, out
    assert "needs vLLM 0.33" in out, out
