"""A shared tier keyed by block hashes that no other process computes is refused (issue 28).

vLLM seeds its non-cryptographic block hashes (``xxhash``, ``xxhash_cbor``) with fresh random
bytes per process unless PYTHONHASHSEED is set (``resolve_none_hash_seed``,
``v1/core/kv_cache_utils.py:117-130``). The shared tier is keyed by those hashes, so two engines,
or one engine after a restart, would never find each other's chunks, and nothing said so. The
connector now refuses that configuration when it is built, naming the fix; sha256 (vLLM's
default, seeded with a fixed value) and a set PYTHONHASHSEED are accepted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from diffharness.layouts import RECIPES, Layout  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.errors import HybridKVConfigError  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.remote import refuse_unshared_hashes  # noqa: E402

# Nothing listens there: the refusal comes before any connection, and the accepted engines
# never ask the server anything in these tests (no request is added).
UNREACHABLE = "redis://127.0.0.1:1"


def _engine(hash_algo: str, remote: bool) -> InProcessEngine:
    extra: dict[str, object] = {"host_memory_bytes": 64 << 20}
    if remote:
        extra["remote_url"] = UNREACHABLE
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    settings = EngineSettings(
        num_gpu_blocks=40, max_model_len=512, block_size=32, hash_algo=hash_algo
    )
    return InProcessEngine(
        RECIPES[Layout.SLIDING_FULL].config_json(), settings, transfer, HybridKVOnCPU()
    )


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_a_per_process_hash_seed_with_a_shared_tier_is_refused(
    algo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(HybridKVConfigError) as caught:
        _engine(algo, remote=True)
    refused = caught.value
    assert refused.field == "kv_connector_extra_config.remote_url"
    assert algo in str(refused.value)
    assert "PYTHONHASHSEED" in refused.fix
    assert "sha256" in refused.fix


@pytest.mark.parametrize(
    ("algo", "seed", "remote"),
    [
        ("xxhash", "0", True),  # a seed every engine shares
        ("sha256", None, True),  # vLLM's fixed default seed
        ("sha256_cbor", None, True),
        ("xxhash", None, False),  # the host tier lives and dies with its process
    ],
)
def test_hashes_every_engine_computes_alike_are_accepted(
    algo: str, seed: str | None, remote: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    engine = _engine(algo, remote=remote)
    try:
        assert (engine.scheduler.connector.remote is not None) is remote
    finally:
        engine.close()


def test_the_refusal_reads_vllms_list_of_per_process_seeds() -> None:
    """The algorithms refused are exactly those vLLM seeds per process."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import _NON_CRYPTO_HASH_FUNCTIONS

    for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        if get_hash_fn_by_name(algo) in _NON_CRYPTO_HASH_FUNCTIONS:
            with pytest.raises(HybridKVConfigError):
                refuse_unshared_hashes(algo, {})
        else:
            refuse_unshared_hashes(algo, {})  # vLLM's fixed seed: shared by every engine
        refuse_unshared_hashes(algo, {"PYTHONHASHSEED": "1"})


def test_a_per_process_hash_seed_with_a_disk_tier_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk tier outlives its process (issue 31): a restart with per-process block hashes
    would never hit its own files, so the refusal names disk_dir."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"disk_dir": str(tmp_path), "disk_bytes": 1 << 20},
    )
    settings = EngineSettings(
        num_gpu_blocks=40, max_model_len=512, block_size=32, hash_algo="xxhash"
    )
    with pytest.raises(HybridKVConfigError) as caught:
        InProcessEngine(
            RECIPES[Layout.SLIDING_FULL].config_json(), settings, transfer, HybridKVOnCPU()
        )
    assert caught.value.field == "kv_connector_extra_config.disk_dir"
    assert caught.value.fix.endswith("or drop disk_dir")
