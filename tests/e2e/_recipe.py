"""The serve command of docs/howto/serve.md, read from the page itself.

The end-to-end tests run what the page tells a user to type, so the page and the tests cannot
drift apart: the ``--kv-transfer-config`` JSON (in process and served) and every flag of the
first ``vllm serve`` line (served; only the model path and the CPU entrypoint change).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

SERVE_DOC = Path(__file__).resolve().parents[2] / "docs" / "howto" / "serve.md"


def serve_line() -> list[str]:
    """The first ``vllm serve MODEL ...`` line of the page, split as a shell splits it."""
    for line in SERVE_DOC.read_text().splitlines():
        if line.startswith("vllm serve "):
            return shlex.split(line)
    raise AssertionError(f"{SERVE_DOC} has no line starting with `vllm serve `")


def serve_flags(kv_transfer_config: dict[str, Any] | None = None) -> list[str]:
    """The flags of that line, after ``vllm serve MODEL``; with ``kv_transfer_config``, that
    JSON in place of the page's (the negative control's connector)."""
    flags = serve_line()[3:]
    if kv_transfer_config is not None:
        flags[flags.index("--kv-transfer-config") + 1] = json.dumps(kv_transfer_config)
    return flags


def kv_transfer_config() -> dict[str, Any]:
    """The ``--kv-transfer-config`` JSON of that line."""
    flags = serve_flags()
    at = flags.index("--kv-transfer-config")
    config: dict[str, Any] = json.loads(flags[at + 1])
    return config


def control_config(zeros: bool = False) -> dict[str, Any]:
    """The page's JSON loading the negative control instead (tests/e2e/_corrupting_connector.py,
    found on the engine's ``sys.path``): every other key as written. Its loads read random
    bytes, or with ``zeros`` zeros (the bfloat16 models' control)."""
    return {
        **kv_transfer_config(),
        "kv_connector": "ZeroingHybridKVConnector" if zeros else "CorruptingHybridKVConnector",
        "kv_connector_module_path": "_corrupting_connector",
    }
