"""`nox` keeps one session's environment on disk at a time.

A default `nox` builds seven virtualenvs (three with vLLM, about 11 GB in all); a CI machine
once ran out of disk in the fifth. noxfile.py's ``venv_session`` removes each one when its
session ends. These tests read noxfile.py without importing nox (the tests session does not
install it): the registration of every default session, and ``_discard_venv`` itself, run
against a stand-in session on a real folder.
"""

from __future__ import annotations

import ast
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

NOXFILE = Path(__file__).resolve().parents[1] / "noxfile.py"


def _module() -> ast.Module:
    return ast.parse(NOXFILE.read_text())


def _default_sessions(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "nox.options.sessions":
            sessions = ast.literal_eval(node.value)
            assert isinstance(sessions, list)
            return sessions
    raise AssertionError("noxfile.py assigns no nox.options.sessions")


def _discard_venv() -> Any:
    """noxfile.py's ``_discard_venv``, compiled alone with the modules it uses."""
    tree = _module()
    [func] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_discard_venv"]
    namespace: dict[str, Any] = {"os": os, "shutil": shutil}
    exec(compile(ast.Module(body=[func], type_ignores=[]), str(NOXFILE), "exec"), namespace)
    return namespace["_discard_venv"]


def test_every_default_session_removes_its_environment() -> None:
    tree = _module()
    decorators = {
        node.name: [ast.unparse(d) for d in node.decorator_list]
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
    }
    defaults = _default_sessions(tree)
    assert len(defaults) >= 7
    for name in defaults:
        assert decorators[name] == ["venv_session()"], (name, decorators[name])


def _session(location: Path, *, reuse: bool = False, install_only: bool = False) -> Any:
    logged: list[str] = []
    return SimpleNamespace(
        virtualenv=SimpleNamespace(location=str(location), reuse_existing=reuse),
        _runner=SimpleNamespace(global_config=SimpleNamespace(install_only=install_only)),
        log=logged.append,
        logged=logged,
    )


def _venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "big.bin").write_bytes(b"\0" * 4096)
    return venv


def test_an_ended_session_leaves_no_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HYBRIDKV_KEEP_NOX_VENVS", raising=False)
    venv = _venv(tmp_path)
    session = _session(venv)
    _discard_venv()(session)
    assert not venv.exists()
    # One line, naming what went and how to keep it next time.
    [line] = session.logged
    assert str(venv) in line
    assert "HYBRIDKV_KEEP_NOX_VENVS=1" in line


@pytest.mark.parametrize(
    ("reuse", "install_only", "keep_env"),
    [(True, False, None), (False, True, None), (False, False, "1")],
    ids=["nox -r", "--install-only", "HYBRIDKV_KEEP_NOX_VENVS=1"],
)
def test_what_asks_to_keep_the_environment_keeps_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    reuse: bool,
    install_only: bool,
    keep_env: str | None,
) -> None:
    if keep_env is None:
        monkeypatch.delenv("HYBRIDKV_KEEP_NOX_VENVS", raising=False)
    else:
        monkeypatch.setenv("HYBRIDKV_KEEP_NOX_VENVS", keep_env)
    venv = _venv(tmp_path)
    session = _session(venv, reuse=reuse, install_only=install_only)
    _discard_venv()(session)
    assert (venv / "lib" / "big.bin").stat().st_size == 4096
    assert session.logged == []
