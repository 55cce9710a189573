"""Whose KV a chunk holds: the model identity and weights version scoped into every chunk key.

A chunk key is content-addressed over its member keys (:func:`hybridkv.remote.chunk_key`), and
member keys come from vLLM's block hashes, which hash token ids (plus LoRA, multimodal inputs
and the cache salt) but nothing about the model. Two deployments of different models with the
same cache geometry would otherwise compute equal member keys for equal prompts and read each
other's KV off a shared server. So the namespace the connector passes to ``chunk_key`` is
scoped (:func:`scoped_namespace`): the configured ``remote_namespace``, then a digest of the
:class:`ModelIdentity` and the weights version. Engines share chunks only when all three agree.

The weights version counts this engine's connector resets (vLLM's ``reset_prefix_cache`` with
``reset_connector=True``, e.g. after a weight update in an RL loop): chunks written before a
reset are never asked for after it. Replicas that update their weights together reset together
and keep sharing.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from hybridkv.errors import HybridKVConfigError

__all__ = ["ModelIdentity", "scoped_namespace"]

_LEN = struct.Struct(">I")
_VERSION = struct.Struct(">Q")


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
    """

    model: str
    revision: str
    dtype: str
    layout: str
    tp_size: int
    tp_rank: int

    def __post_init__(self) -> None:
        for name in ("model", "revision", "dtype", "layout"):
            if not isinstance(getattr(self, name), str):
                raise HybridKVConfigError(name, getattr(self, name), "must be a str", "pass one")
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise HybridKVConfigError("tp_size", self.tp_size, "must be an int >= 1", "pass one")
        rank = self.tp_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.tp_size:
            raise HybridKVConfigError(
                "tp_rank", rank, f"must be an int in [0, {self.tp_size})", "pass the rank"
            )

    def encoded(self) -> bytes:
        """Every field, length-prefixed (u32) in declaration order: unambiguous bytes."""
        fields = (
            self.model,
            self.revision,
            self.dtype,
            self.layout,
            str(self.tp_size),
            str(self.tp_rank),
        )
        out = bytearray()
        for field in fields:
            data = field.encode()
            out += _LEN.pack(len(data)) + data
        return bytes(out)


def scoped_namespace(namespace: bytes, identity: ModelIdentity, weights_version: int) -> bytes:
    """``namespace``, ``/``, then the hex SHA-256 of the identity and the weights version.

    Pure: equal arguments give equal bytes on every engine; any field that differs gives
    another namespace, so other chunk keys. Pre: ``namespace`` bytes, ``weights_version`` an
    int >= 0 (fields of those names).
    """
    if not isinstance(namespace, bytes):
        raise HybridKVConfigError("namespace", namespace, "must be bytes", "encode it")
    version = weights_version
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise HybridKVConfigError("weights_version", version, "must be an int >= 0", "count")
    digest = hashlib.sha256(identity.encoded() + _VERSION.pack(version)).hexdigest()
    return namespace + b"/" + digest.encode()
