"""The shared tier's model identity covers what vLLM's own configuration says about the KV bytes
(issue 28): before, ``model_identity`` named the model, revision, dtypes and layout only, so the
same checkpoint served in bf16 and with ``--quantization fp8``, or with ``hf_overrides``,
shared one namespace and read each other's KV. Now :func:`hybridkv.vllm.remote.config_digest`
folds in vLLM's model and cache config hashes, vLLM's version and the model config as vLLM
loaded it (which carries ``hf_overrides``, left out of vLLM's own hash), and every engine
built from equal arguments still agrees.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from diffharness.layouts import RECIPES, Layout  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402

from hybridkv.vllm.harness.engine_config import _config_dir, _process_setup  # noqa: E402
from hybridkv.vllm.remote import config_digest  # noqa: E402

MAX_LEN = 512


def _config(model: dict[str, Any] | None = None, cache: dict[str, Any] | None = None) -> Any:
    _process_setup()
    directory = _config_dir(RECIPES[Layout.SLIDING_FULL].config_json(), "identity")
    model_config = ModelConfig(
        model=directory,
        tokenizer=directory,
        skip_tokenizer_init=True,
        max_model_len=MAX_LEN,
        seed=0,
        enforce_eager=True,
        **(model or {}),
    )
    return VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(**(cache or {})),
        scheduler_config=SchedulerConfig(
            max_model_len=MAX_LEN, max_num_batched_tokens=MAX_LEN, is_encoder_decoder=False
        ),
    )


def test_engines_built_alike_agree() -> None:
    assert config_digest(_config()) == config_digest(_config())


@pytest.mark.parametrize(
    ("model", "cache"),
    [
        ({"quantization": "fp8"}, None),
        ({"hf_overrides": {"rope_theta": 12345.0}}, None),
        ({"dtype": "float16"}, None),
        (None, {"cache_dtype": "fp8"}),
    ],
    ids=["quantization", "hf-overrides", "dtype", "kv-cache-dtype"],
)
def test_anything_that_changes_the_kv_bytes_changes_the_identity(
    model: dict[str, Any] | None, cache: dict[str, Any] | None
) -> None:
    assert config_digest(_config(model, cache)) != config_digest(_config())


def test_the_connector_scopes_its_chunks_by_the_digest() -> None:
    """The identity the connector's shared tier is built with carries its engine's digest."""
    from vllm.config import KVTransferConfig

    from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU
    from hybridkv.vllm.harness.engine_config import EngineSettings
    from hybridkv.vllm.harness.inprocess import InProcessEngine

    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        # Nothing listens there: building the connector asks the server nothing.
        kv_connector_extra_config={
            "host_memory_bytes": 64 << 20,
            "remote_url": "redis://127.0.0.1:1",
        },
    )
    settings = EngineSettings(num_gpu_blocks=48, max_model_len=MAX_LEN, block_size=32)
    engine = InProcessEngine(
        RECIPES[Layout.SLIDING_FULL].config_json(), settings, transfer, HybridKVOnCPU()
    )
    try:
        remote = engine.scheduler.connector.remote
        assert remote.identity.config == config_digest(engine.vllm_config)
        assert len(remote.identity.config) == 64
    finally:
        engine.close()
