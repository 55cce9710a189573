"""Who may talk to the shared server, and which values an engine trusts: credentials, TLS and
the fleet key (issue 30, item 1; the threat model is docs/howto/share-prefix-cache.md's).

Two guards, each for its own attacker:

- :class:`Credentials` and :class:`TlsFiles` decide who reaches the server at all: a password
  (``requirepass``) or an ACL user and password, and a TLS connection whose server certificate
  is checked against a CA (optionally with a client certificate). They stop whoever can reach
  the network but holds no password, and whoever watches the wire.
- :class:`FleetKey` decides which values an engine loads. Every value it writes carries a keyed
  MAC (HMAC-SHA256) over the chunk key and every other byte of the value, and it loads only
  values whose MAC verifies under the same secret. Someone who holds the server's password but
  not the fleet secret (another team's job, a leaked read-write token, the server's operator)
  can still delete or withhold chunks (a miss: the engine recomputes), but cannot plant KV
  that loads. With ``encrypt`` the payloads are also AES-256-GCM ciphertext, so such a reader
  sees no KV; the GCM tag is then the value's keyed MAC (it covers the same bytes: a second
  HMAC over the ciphertext would cost a pass over every byte and add no integrity).

Secrets never come from the config itself, which vLLM prints in its start-up log and which
often sits on a command line: :func:`read_secret` takes them from an environment variable or a
file, and the dataclasses below keep them out of their ``repr``.

Keys: the fleet secret is never used directly. Each purpose gets its own key, HMAC-SHA256 of
the secret over a label (``hybridkv/remote/mac/v1``, ``.../aes-gcm/v1``, ``.../key-id/v1``), so
no two uses share a key. Each encrypted value gets its own AES key, HMAC-SHA256 of the AEAD key
over 32 random bytes the value carries, and is encrypted under it once with a zero nonce: one
key, one message, so GCM's nonce never repeats and there is no limit of 2**32 messages per key
as there is with random 96-bit nonces under one key.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import logging
import os
import ssl
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from hybridkv.errors import HybridKVConfigError
from hybridkv.remote.values import AUTH_REFUSALS, Corruption

__all__ = [
    "MIN_SECRET_BYTES",
    "SALT_BYTES",
    "TAG_BYTES",
    "Credentials",
    "FleetKey",
    "Refusals",
    "TlsFiles",
    "read_secret",
    "require_cryptography",
]

MIN_SECRET_BYTES = 32
"""The shortest fleet secret accepted (``openssl rand -base64 32`` gives 44 characters)."""
SALT_BYTES = 32
"""Random bytes an encrypted value carries; its own AES key is derived from them."""
TAG_BYTES = 16
"""AES-GCM's tag, after the ciphertext."""
logger = logging.getLogger("hybridkv.remote")
_ZERO_NONCE = bytes(12)  # one key, one message (module docstring)
_INSTALL_CRYPTO = "install it: pip install 'hybridkv[remote-crypto]' (or pip install cryptography)"


def read_secret(
    field_name: str, env: str | None, path: str | None, environ: Mapping[str, str] = os.environ
) -> bytes | None:
    """The secret named by ``env`` (an environment variable) or ``path`` (a file), or None when
    neither is given. A file's one trailing newline is dropped (``echo`` and editors add one).

    Errors (HybridKVConfigError, field ``{field_name}_env`` or ``{field_name}_file``, the value
    being the variable's name or the path, never the secret): both given, the variable unset or
    empty, the file unreadable or empty.
    """
    if env is not None and path is not None:
        raise HybridKVConfigError(
            f"{field_name}_file", path, f"is given with {field_name}_env too", "give only one"
        )
    if env is not None:
        value = environ.get(env)
        if not value:
            raise HybridKVConfigError(
                f"{field_name}_env",
                env,
                "names an environment variable that is unset or empty in this process",
                f"export {env} in the engine's environment (every vLLM process inherits it)",
            )
        return value.encode()
    if path is None:
        return None
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as error:
        raise HybridKVConfigError(
            f"{field_name}_file", path, f"cannot be read ({error.strerror})", "fix the path"
        ) from error
    data = data.removesuffix(b"\n").removesuffix(b"\r")
    if not data:
        raise HybridKVConfigError(f"{field_name}_file", path, "is empty", "write the secret in it")
    return data


@dataclass(frozen=True, slots=True)
class Credentials:
    """What the client says to AUTH: a password (``requirepass``), or an ACL user and its
    password. ``password`` stays out of the repr. Both None: no AUTH."""

    username: str | None = None
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.username is not None and (not isinstance(self.username, str) or not self.username):
            raise HybridKVConfigError(
                "remote_username", self.username, "must be a non-empty str", "pass one"
            )
        if self.password is not None and (not isinstance(self.password, str) or not self.password):
            # The value is never echoed: it may be most of a real password.
            raise HybridKVConfigError(
                "remote_password", "<hidden>", "must be a non-empty str", "pass one"
            )
        if self.username is not None and self.password is None:
            raise HybridKVConfigError(
                "remote_username",
                self.username,
                "is set without a password",
                "give the user's password through remote_password_env or remote_password_file",
            )


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A TLS connection's files: the CA that signs the server's certificate (None: the
    system's trust store) and, for servers that ask for one, the client's certificate and key.
    Each must load (PEM) when the config is built, so a wrong file is refused at start-up
    under its own name rather than as a failed handshake."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if path is not None and not (isinstance(path, str) and os.access(path, os.R_OK)):
                raise HybridKVConfigError(
                    f"remote_tls_{name}", path, "is not a readable file", "fix the path"
                )
        if (self.cert_file is None) != (self.key_file is None):
            raise HybridKVConfigError(
                "remote_tls_cert_file",
                self.cert_file,
                "and remote_tls_key_file come together (a client certificate needs its key)",
                "give both, or neither",
            )
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
        except ssl.SSLError as error:
            raise HybridKVConfigError(
                "remote_tls_ca_file", self.ca_file, f"holds no PEM certificate ({error})",
                "give the CA certificate (PEM) that signed the server's",
            ) from None  # fmt: skip
        try:
            if self.cert_file is not None:
                context.load_cert_chain(self.cert_file, self.key_file)
        except ssl.SSLError as error:
            raise HybridKVConfigError(
                "remote_tls_cert_file", self.cert_file,
                f"and remote_tls_key_file do not load as a certificate and its key ({error})",
                "give the client certificate and its unencrypted private key (PEM)",
            ) from None  # fmt: skip


@dataclass(frozen=True, slots=True)
class FleetKey:
    """The fleet secret every engine sharing a namespace holds, and whether values are
    encrypted. The secret and the keys derived from it stay out of the repr; ``key_id`` (4
    bytes of a derived key, hex) tells operators whether two engines hold the same secret
    without showing it.

    Errors: a secret shorter than :data:`MIN_SECRET_BYTES`; ``encrypt`` without the
    ``cryptography`` package (HybridKVConfigError naming the extra to install).
    """

    secret: bytes = field(repr=False)
    encrypt: bool = False
    mac_key: bytes = field(init=False, repr=False, compare=False)
    aead_key: bytes = field(init=False, repr=False, compare=False)
    key_id: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) < MIN_SECRET_BYTES:
            size = len(self.secret) if isinstance(self.secret, bytes) else type(self.secret)
            raise HybridKVConfigError(
                "remote_secret",
                f"<{size} bytes>" if isinstance(size, int) else f"<{size.__name__}>",
                f"must be at least {MIN_SECRET_BYTES} bytes",
                "make one: openssl rand -base64 32 > fleet.secret",
            )
        if not isinstance(self.encrypt, bool):
            raise HybridKVConfigError("remote_encrypt", self.encrypt, "must be a bool", "pass one")
        if self.encrypt:
            require_cryptography()
        object.__setattr__(self, "mac_key", _derive(self.secret, b"mac"))
        object.__setattr__(self, "aead_key", _derive(self.secret, b"aes-gcm"))
        object.__setattr__(self, "key_id", _derive(self.secret, b"key-id")[:4].hex())

    def mac(self, chunk_key: bytes, parts: Sequence[bytes | memoryview]) -> bytes:
        """HMAC-SHA256 over ``chunk_key`` (length-prefixed) then ``parts``, 32 bytes."""
        mac = hmac.new(self.mac_key, len(chunk_key).to_bytes(4, "big"), "sha256")
        mac.update(chunk_key)
        for part in parts:
            mac.update(part)
        return mac.digest()

    def seal(self, salt: bytes, aad: bytes, plaintext: bytes) -> bytes:
        """AES-256-GCM of ``plaintext`` under the key of ``salt``: ciphertext then the tag."""
        sealed: bytes = self._aead(salt).encrypt(_ZERO_NONCE, plaintext, aad)
        return sealed

    def unseal(self, salt: bytes | memoryview, aad: bytes, sealed: memoryview) -> bytes | None:
        """The plaintext of ``sealed`` (ciphertext then tag), or None where the tag fails."""
        invalid = importlib.import_module("cryptography.exceptions").InvalidTag
        try:
            plain: bytes = self._aead(bytes(salt)).decrypt(_ZERO_NONCE, sealed, aad)
        except invalid:
            return None
        return plain

    def _aead(self, salt: bytes) -> Any:
        key = hmac.new(self.aead_key, salt, hashlib.sha256).digest()
        return require_cryptography().AESGCM(key)


class Refusals:
    """Fetched values refused by verification, counted per :class:`Corruption` kind; the first
    authentication refusal of each kind (:data:`AUTH_REFUSALS`) is logged as a warning, the
    rest only counted, so a flood of planted values cannot flood the log. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys((kind.value for kind in Corruption), 0)
        self._logged: set[Corruption] = set()

    def note(self, corruption: Corruption, chunk_key: bytes) -> None:
        """Count one refused value of chunk ``chunk_key``."""
        with self._lock:
            self._counts[corruption.value] += 1
            first = corruption in AUTH_REFUSALS and corruption not in self._logged
            self._logged.add(corruption)
        if first:
            logger.warning(
                "hybridkv remote tier: refused chunk %s: %s (%s); not loaded, recomputed. "
                "Further refusals of this kind are counted, not logged.",
                chunk_key.hex(),
                _WHY[corruption],
                corruption.value,
            )

    def counts(self) -> dict[str, int]:
        """Refused values so far per :class:`Corruption` value."""
        with self._lock:
            return dict(self._counts)

    def unauthenticated(self) -> int:
        """Of those, the authentication refusals (KEYING and MAC)."""
        with self._lock:
            return sum(self._counts[kind.value] for kind in AUTH_REFUSALS)


_WHY = {
    Corruption.KEYING: "it is not sealed the way this engine's fleet key expects (an engine "
    "with another remote_secret setting, or none, wrote it into the same namespace)",
    Corruption.MAC: "its MAC does not verify under this engine's fleet key (written without "
    "the fleet secret, under another secret, for another chunk key, or altered since)",
}


def _derive(secret: bytes, purpose: bytes) -> bytes:
    return hmac.new(secret, b"hybridkv/remote/" + purpose + b"/v1", hashlib.sha256).digest()


def require_cryptography() -> ModuleType:
    """``cryptography``'s AEAD module, or a config error naming the extra where it is missing
    (imported only when encryption is on: it is an optional dependency)."""
    try:
        return importlib.import_module("cryptography.hazmat.primitives.ciphers.aead")
    except ImportError as missing:
        raise HybridKVConfigError(
            "remote_encrypt",
            True,
            f"encryption needs the cryptography package, which does not import ({missing})",
            _INSTALL_CRYPTO,
        ) from missing
