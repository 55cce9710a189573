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


def serve_flags() -> list[str]:
    """The flags of that line, after ``vllm serve MODEL``."""
    return serve_line()[3:]


def kv_transfer_config() -> dict[str, Any]:
    """The ``--kv-transfer-config`` JSON of that line."""
    flags = serve_flags()
    at = flags.index("--kv-transfer-config")
    config: dict[str, Any] = json.loads(flags[at + 1])
    return config
