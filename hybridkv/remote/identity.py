"""Whose KV a chunk holds: the model identity and the weights scoped into every chunk key.

A chunk key is content-addressed over its member keys (:func:`hybridkv.remote.chunk_key`), and
member keys come from vLLM's block hashes, which hash token ids (plus LoRA, multimodal inputs
and the cache salt) but nothing about the model. Two deployments of different models with the
same cache geometry would otherwise compute equal member keys for equal prompts and read each
other's KV off a shared server. So the namespace the connector passes to ``chunk_key`` is
scoped (:func:`scoped_namespace`): the configured ``remote_namespace``, then a digest of the
:class:`ModelIdentity`, the weights version and, after a reset, the engine's own epoch.
Engines share chunks only when all of them agree.

The weights, failing closed. An engine starts on the weights its model path and revision
name, so engines of one identity share from their start (weights version 0, no epoch). A
connector reset (vLLM's ``reset_prefix_cache`` with ``reset_connector=True``, sleep level 1 or 2,
``pause_generation(clear_cache=True)``, an operator's reset) may come with new weights or
not, and the connector cannot tell: one replica may reset for a sleep (old weights) while
another resets after a training step (new weights), so a count of resets says nothing about
which weights an engine holds. After its first reset an engine therefore moves to a
namespace of its own: the epoch is random bytes drawn once per engine, so no other engine, and
no later process of this one, ever reads or writes it. Engines share again after a restart.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from hybridkv.errors import HybridKVConfigError

__all__ = ["ModelIdentity", "scoped_namespace"]

_LEN = struct.Struct(">I")
_VERSION = struct.Struct(">Q")
EPOCH_BYTES = 16  # an engine's own epoch after a reset (module docstring)


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """What makes two engines' KV for the same tokens the same bytes.

    Attributes:
        model: the model's name or path, as served.
        revision: its revision ("" when none is named).
        dtype: the model's dtype and the KV cache's, e.g. ``"torch.bfloat16/auto"``.
        layout: a fingerprint of the KV cache layout (groups, block sizes, page bytes, layers).
        tp_size: tensor-parallel ranks.
        tp_rank: the rank whose shard the chunks hold.
        kv_replicas: consecutive ranks holding identical KV (vLLM's ``kv_tp_replicas``, e.g.
            an MLA model's latent cache), whose one shard ``tp_rank`` (the group's first rank)
            names; 1: every rank its own shard.
        config: a digest of everything else the engine's configuration says about the KV
            bytes: what vLLM folds into its own config hashes (quantization, KV-cache dtype,
            vLLM's version, ...) and the model's config after ``hf_overrides``
            (:func:`hybridkv.vllm.remote.model_identity`); "" when the caller has none.
    """

    model: str
    revision: str
    dtype: str
    layout: str
    tp_size: int
    tp_rank: int
    config: str = ""
    kv_replicas: int = 1

    def __post_init__(self) -> None:
        for name in ("model", "revision", "dtype", "layout", "config"):
            if not isinstance(getattr(self, name), str):
                raise HybridKVConfigError(name, getattr(self, name), "must be a str", "pass one")
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise HybridKVConfigError("tp_size", self.tp_size, "must be an int >= 1", "pass one")
        rank = self.tp_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.tp_size:
            raise HybridKVConfigError(
                "tp_rank", rank, f"must be an int in [0, {self.tp_size})", "pass the rank"
            )
        replicas = self.kv_replicas
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise HybridKVConfigError(
                "kv_replicas", replicas, "must be an int >= 1", "pass kv_tp_replicas"
            )

    def encoded(self) -> bytes:
        """Every field, length-prefixed (u32) in declaration order: unambiguous bytes.
        ``kv_replicas`` only when above 1, so unreplicated engines keep the keys they had
        before it existed."""
        fields: tuple[str, ...] = (
            self.model,
            self.revision,
            self.dtype,
            self.layout,
            str(self.tp_size),
            str(self.tp_rank),
            self.config,
        )
        if self.kv_replicas > 1:
            fields += (str(self.kv_replicas),)
        out = bytearray()
        for field in fields:
            data = field.encode()
            out += _LEN.pack(len(data)) + data
        return bytes(out)


def scoped_namespace(
    namespace: bytes, identity: ModelIdentity, weights_version: int, epoch: bytes = b""
) -> bytes:
    """``namespace``, ``/``, then the hex SHA-256 of the identity, the weights version and the
    engine's ``epoch`` (empty: none; after a reset, the engine's own random bytes).

    Pure: equal arguments give equal bytes on every engine; any field that differs gives
    another namespace, so other chunk keys. Pre: ``namespace`` and ``epoch`` bytes,
    ``weights_version`` an int >= 0 (fields of those names).
    """
    if not isinstance(namespace, bytes):
        raise HybridKVConfigError("namespace", namespace, "must be bytes", "encode it")
    if not isinstance(epoch, bytes):
        raise HybridKVConfigError("epoch", epoch, "must be bytes", "pass os.urandom(16)")
    version = weights_version
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise HybridKVConfigError("weights_version", version, "must be an int >= 0", "count")
    scoped = identity.encoded() + _VERSION.pack(version)
    if epoch:  # length-prefixed, so an epoch never runs into the version
        scoped += _LEN.pack(len(epoch)) + epoch
    digest = hashlib.sha256(scoped).hexdigest()
    return namespace + b"/" + digest.encode()
