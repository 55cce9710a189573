"""Offload keys inside vLLM 0.33's real scheduler: two requests with equal token ids but a
different cache salt, LoRA adapter or image never share a host chunk; equal ones do.

``HybridKVConnector`` reads its keys off vLLM's ``request.block_hashes``, which vLLM's block
hasher folds the request's extra keys into (``kv_cache_utils.generate_block_hash_extra_keys``:
the LoRA name and path on every block, ``("mm", identifier, offset)`` on the blocks an image
covers, the salt on the first block, and so on down the chain). Each case runs a first request,
drops vLLM's GPU prefix cache (``Scheduler.reset_prefix_cache``: only the host tier can serve
the prompt again), then sends the same token ids with another, then with the same, extra key.
The forward tags content by token ids alone, so the verdict here is the host hit itself:
vLLM's ``num_external_cached_tokens`` (0 across different keys, the host chunks' worth across
equal ones), and the claims the connector made.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from diffharness.layouts import RECIPES, Layout  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.engine_config import EngineSettings  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402

CHUNK = 32
PROMPT = [random.Random(5).randint(3, 999) for _ in range(200)]


def _engine(max_loras: int = 0) -> InProcessEngine:
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"host_memory_bytes": 64 << 20, "chunk_size": CHUNK},
    )
    settings = EngineSettings(
        num_gpu_blocks=40,
        max_model_len=512,
        block_size=32,
        max_num_seqs=2,
        max_num_batched_tokens=256,
        max_loras=max_loras,
    )
    recipe = RECIPES[Layout.SLIDING_FULL]
    return InProcessEngine(recipe.config_json(), settings, transfer, HybridKVOnCPU(delay=0))


def _serve(engine: InProcessEngine, rid: str, **extra: Any) -> int:
    """Run one request to the end; vLLM's external (host) hit tokens for it."""
    before = engine.tally.external_hits
    engine.add(rid, list(PROMPT), 2, **extra)
    while engine.busy():
        engine.step()
    assert engine.requests[rid].is_finished()
    assert engine.scheduler.reset_prefix_cache()
    return engine.tally.external_hits - before


def _check(engine: InProcessEngine, first: dict[str, Any], other: dict[str, Any]) -> None:
    host_chunks = (len(PROMPT) - 1) // CHUNK * CHUNK
    assert _serve(engine, "first", **first) == 0
    assert _serve(engine, "other", **other) == 0, "a different extra key hit the host"
    assert _serve(engine, "again", **first) == host_chunks
    assert engine.tally.wrong == 0
    assert engine.leaked_blocks() == 0


def test_cache_salt_separates_host_chunks() -> None:
    _check(_engine(), {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"})


def test_no_salt_and_a_salt_do_not_share() -> None:
    _check(_engine(), {}, {"cache_salt": "tenant-a"})


def _lora(name: str, int_id: int, path: str) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=path)


def test_lora_adapter_separates_host_chunks() -> None:
    engine = _engine(max_loras=2)
    assert engine.vllm_config.lora_config is not None
    a, b = _lora("adapter-a", 1, "/adapters/a"), _lora("adapter-b", 2, "/adapters/b")
    _check(engine, {"lora_request": a}, {"lora_request": b})


def test_base_model_and_an_adapter_do_not_share() -> None:
    engine = _engine(max_loras=1)
    _check(engine, {}, {"lora_request": _lora("adapter-a", 1, "/adapters/a")})


def test_lora_same_name_other_path_does_not_share() -> None:
    engine = _engine(max_loras=2)
    a, moved = _lora("adapter-a", 1, "/adapters/a-v1"), _lora("adapter-a", 1, "/adapters/a-v2")
    _check(engine, {"lora_request": a}, {"lora_request": moved})


def _image(identifier: str, offset: int = 0, length: int = 64) -> list[Any]:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    position = PlaceholderRange(offset=offset, length=length)
    return [MultiModalFeatureSpec(None, "image", identifier, position)]


def _view(request: Any) -> Any:
    from hybridkv.connector import RequestId, RequestView

    return RequestView(
        RequestId(request.request_id),
        tuple(request.all_token_ids),
        request.num_prompt_tokens,
        request.cache_salt,
        tuple(request.block_hashes),
    )


@pytest.mark.parametrize("offset", [0, 40], ids=["image-first", "image-at-40"])
def test_image_separates_host_chunks(offset: int) -> None:
    """Images cannot run here: the recipes are text-only models, so vLLM gives them no encoder
    budget (``mm_budget`` None: ``max_num_encoder_input_tokens`` 0) and a request whose image
    must be computed never gets scheduled. What runs is everything up to that point: vLLM's
    block hasher over the image's ``mm_features``, and the real scheduler's lookup. The host is
    seeded with image A's chunks (:meth:`ConnectorCore.seed`: keys only, no data), then the
    scheduler asks the connector about the same token ids with image A, image B and no image;
    each is aborted before it could read a block. Chunks before the image's block are shared
    (their KV does not depend on the image); from that block on, only image A hits.
    """
    engine = _engine()
    connector = engine.scheduler.connector
    seeded = engine.make_request("seed", list(PROMPT), 2, mm_features=_image("img-a", offset))
    host_chunks = (len(PROMPT) - 1) // CHUNK * CHUNK
    assert connector.core.seed(_view(seeded), host_chunks) > 0
    answers: dict[str, Any] = {}
    ask = connector.get_num_new_matched_tokens

    def recorded(request: Any, num_computed_tokens: int) -> Any:
        answers[request.request_id] = answer = ask(request, num_computed_tokens)
        return answer

    connector.get_num_new_matched_tokens = recorded
    before_image = offset // CHUNK * CHUNK
    for rid, features in (
        ("b", _image("img-b", offset)),
        ("text", None),
        ("a", _image("img-a", offset)),
    ):
        engine.add(rid, list(PROMPT), 2, mm_features=features)
        engine.step()
        engine.abort(rid)
    assert answers["b"] == (before_image or 0, bool(before_image)), answers
    assert answers["text"] == answers["b"], answers
    assert answers["a"] == (host_chunks, True), answers
    while engine.busy():
        engine.step()
    assert engine.leaked_blocks() == 0
    assert engine.tally.wrong == 0
