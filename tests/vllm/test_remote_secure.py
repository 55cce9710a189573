"""The shared tier's security keys in ``kv_connector_extra_config`` (issue 30, item 1): parsed
and refused as an operator reads them, then two in-process vLLM 0.33 engines on a real server
with a password, an ACL user, TLS (certificates made here) and a fleet secret.

- The keys: credentials come from an environment variable or a file, never the URL; TLS needs
  ``rediss://``; encryption needs the secret; every refusal names the key, and no message or
  repr shows a secret.
- Start-up: an engine whose password the server refuses does not start: building it raises one
  HybridKVConfigError (the connector's tier checks the server when it is built).
- Two engines holding the same secret share chunks (0 wrong reads, prefill saved); when a
  holder of the server's password but not of the secret rewrites every chunk, the reader loads
  none of them: each fetch is CORRUPT, counted as ``remote_fetches_unauthenticated``, and
  every prompt token is computed or hit exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

# The fake server of the library tests (the TP test needs no real one).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "remote"))

import torch  # noqa: E402
from _fake_chunk_client import FakeClient  # noqa: E402
from _two_engines import (  # noqa: E402
    HOST_BYTES,
    SHAPES,
    Shape,
    chat_prompts,
    flush_writes,
    redis_binary_or_skip,
    run_prompts,
)
from diffharness.layouts import RECIPES, Layout  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from hybridkv.errors import HybridKVConfigError  # noqa: E402
from hybridkv.hostmem import HostMemory, PinMode  # noqa: E402
from hybridkv.remote import (  # noqa: E402
    Credentials,
    FleetKey,
    ModelIdentity,
    RemoteConfig,
    ShardPlan,
    TlsFiles,
    redis_key,
    shard_keys,
    shard_namespaces,
)
from hybridkv.vllm.config import parse_extra_config  # noqa: E402
from hybridkv.vllm.harness.cpu_worker import HybridKVOnCPU  # noqa: E402
from hybridkv.vllm.harness.inprocess import InProcessEngine  # noqa: E402
from hybridkv.vllm.remote import (  # noqa: E402
    FetchOrder,
    FetchReport,
    RemoteOrders,
    WorkerRemote,
    remote_config,
)

W = "kv_connector_extra_config"
PASSWORD = "engine-password-5b1e"
SECRET = "fleet-secret-of-the-vllm-tests-0123456789"
URL = "rediss://cache.local:6380"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """A CA, a client certificate and key it signed, and the fleet secret's file."""
    from _certs import make_certs  # tests/remote, on the path through _two_engines

    made = make_certs(tmp_path)
    (tmp_path / "fleet.secret").write_text(SECRET + "\n")
    return {
        "ca.crt": str(made.ca),
        "client.crt": str(made.client_cert),
        "client.key": str(made.client_key),
        "secret": str(tmp_path / "fleet.secret"),
    }


def _refusal(extra: dict[str, Any]) -> HybridKVConfigError:
    with pytest.raises(HybridKVConfigError) as caught:
        parse_extra_config(extra)
    return caught.value


# ------------------------------------------------------------------ the keys


def test_every_security_key_parses_and_reaches_the_tier(
    files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDKV_TEST_PASSWORD", PASSWORD)
    extra = {
        "remote_url": URL,
        "remote_username": "engine",
        "remote_password_env": "HYBRIDKV_TEST_PASSWORD",
        "remote_tls_ca_file": files["ca.crt"],
        "remote_tls_cert_file": files["client.crt"],
        "remote_tls_key_file": files["client.key"],
        "remote_secret_file": files["secret"],
        "remote_encrypt": True,
    }
    parsed = parse_extra_config(extra)
    remote = parsed.remote
    assert remote is not None
    assert remote.credentials == Credentials("engine", PASSWORD)
    assert remote.tls == TlsFiles(files["ca.crt"], files["client.crt"], files["client.key"])
    assert remote.key == FleetKey(SECRET.encode(), encrypt=True)  # the newline dropped
    config = remote_config(remote)
    assert (config.credentials, config.tls, config.key) == (
        remote.credentials,
        remote.tls,
        remote.key,
    )
    for text in (repr(parsed), repr(config)):
        assert PASSWORD not in text
        assert SECRET not in text


def test_without_security_keys_the_tier_is_as_before() -> None:
    remote = parse_extra_config({"remote_url": "redis://cache.local:6379"}).remote
    assert remote is not None
    assert (remote.credentials, remote.tls, remote.key) == (Credentials(), None, None)
    tls = parse_extra_config({"remote_url": URL}).remote
    assert tls is not None
    assert tls.tls == TlsFiles()  # rediss:// alone: the system's CAs


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://engine:hunter2@cache.local:6379", "redis://<credentials>@cache.local:6379"),
        ("rediss://e:hun@ter//2@cache.local:6380/0", "rediss://<credentials>@cache.local:6380/0"),
        ("redis://hunter@cache.local:6379/2", "redis://<credentials>@cache.local:6379/2"),
    ],
)
def test_a_password_in_the_url_is_refused_without_echoing_it(url: str, shown: str) -> None:
    refused = _refusal({"remote_url": url})
    assert (refused.field, refused.value, refused.problem, refused.fix) == (
        f"{W}.remote_url",
        shown,
        "carries credentials: the URL is logged with vLLM's config",
        "drop them from the URL; give remote_username and remote_password_env or "
        "remote_password_file",
    )
    assert "hunter" not in str(refused)
    assert "ter//2" not in str(refused)


def test_a_url_of_another_scheme_with_credentials_is_refused_without_echoing_them() -> None:
    refused = _refusal({"remote_url": "http://u:hunter2@cache.local:6379"})
    assert (refused.value, refused.problem) == (
        "http://<credentials>@cache.local:6379",
        "is not a redis:// or rediss:// URL",
    )


def test_a_tls_cluster_url_carries_every_security_key(
    files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDKV_TEST_PASSWORD", PASSWORD)
    extra = {
        "remote_url": "rediss+cluster://10.0.0.5:7000,10.0.0.6:7001",
        "remote_password_env": "HYBRIDKV_TEST_PASSWORD",
        "remote_tls_ca_file": files["ca.crt"],
        "remote_secret_file": files["secret"],
    }
    remote = parse_extra_config(extra).remote
    assert remote is not None
    assert remote.cluster_nodes == (("10.0.0.5", 7000), ("10.0.0.6", 7001))
    assert (remote.host, remote.port) == ("10.0.0.5", 7000)
    assert remote.credentials == Credentials(None, PASSWORD)
    assert remote.tls == TlsFiles(files["ca.crt"])
    assert remote.key == FleetKey(SECRET.encode())
    config = remote_config(remote)
    assert (config.cluster_nodes, config.credentials, config.tls, config.key) == (
        remote.cluster_nodes,
        remote.credentials,
        remote.tls,
        remote.key,
    )
    # A plaintext cluster URL with TLS files is refused, as a plaintext server's is.
    plain = extra | {"remote_url": "redis+cluster://10.0.0.5:7000"}
    refused = _refusal(plain)
    assert (refused.field, refused.problem) == (
        f"{W}.remote_tls_ca_file",
        "is set but remote_url is plaintext",
    )


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis+cluster://u:hunter2@h:1,h:2", "redis+cluster://<credentials>@h:1,h:2"),
        ("rediss+cluster://h:1,u:hunter2@h:2", "rediss+cluster://<credentials>@h:2"),
    ],
)
def test_credentials_in_a_cluster_url_are_refused_without_echoing_them(
    url: str, shown: str
) -> None:
    refused = _refusal({"remote_url": url})
    assert (refused.value, refused.problem) == (
        shown,
        "carries credentials: the URL is logged with vLLM's config",
    )
    assert "hunter2" not in str(refused)


def test_each_tp_rank_verifies_its_shard_under_its_own_key() -> None:
    """Under TP the MAC binds each value to its rank's shard key (the key it is stored under):
    engine B's ranks load the shards A's ranks wrote, and a shard copied under another rank's
    key is refused."""
    slot, plan = 64, ShardPlan(tp_size=2)
    config = RemoteConfig(namespace=b"t", key=FleetKey(SECRET.encode()))
    identity = ModelIdentity("org/model", "", "torch.bfloat16/auto", "small", 2, 0)
    members = (b"\x01" * 32, b"\x02" * 32)
    keys = shard_keys(shard_namespaces(config.namespace, identity, plan, 0), members)
    order = FetchOrder(keys[0], members, (0, 1), keys)
    server = FakeClient()

    def shard(member: bytes, rank: int) -> bytes:
        return (member[:1] + bytes([rank])) * (slot // 2)

    def ranks() -> tuple[list[HostMemory], list[WorkerRemote]]:
        hosts = [HostMemory(4 * slot, slot, PinMode.OFF) for _ in range(plan.tp_size)]
        workers = [
            WorkerRemote(config, hosts[r], client=server, background=False, rank=r, shards=plan)
            for r in range(plan.tp_size)
        ]
        return hosts, workers

    a_hosts, a = ranks()
    for rank, (host, worker) in enumerate(zip(a_hosts, a, strict=True)):
        for index, member in enumerate(members):
            host.slot(index).copy_(
                torch.frombuffer(bytearray(shard(member, rank)), dtype=torch.uint8)
            )
        assert worker.run(RemoteOrders(writes=(order,))) == ()
        assert worker.tier.write_pending() == 1
    assert set(server.data) == {redis_key(k) for k in keys}  # one value per shard key
    b_hosts, b = ranks()
    promoted = (FetchReport(keys[0], "promoted"),)
    assert [worker.run(RemoteOrders(fetches=(order,))) for worker in b] == [promoted] * 2
    for rank, host in enumerate(b_hosts):
        assert [bytes(host.slot(i).numpy()) for i in (0, 1)] == [shard(m, rank) for m in members]
    # Rank 0's valid value copied under rank 1's key: the MAC names rank 0's key, refused.
    server.data[redis_key(keys[1])] = server.data[redis_key(keys[0])]
    _, c = ranks()
    assert c[1].run(RemoteOrders(fetches=(order,))) == (FetchReport(keys[0], "corrupt"),)
    assert c[1].refusals.counts()["mac"] == 1
    assert c[1].counters()["remote_fetches_unauthenticated"] == 1


PLAINTEXT_FIX = 'write "remote_url": "rediss://HOST:PORT" (TLS), or drop the key'
ENV_FIX = "export {} in the engine's environment (every vLLM process inherits it)"
STRING = ("must be a non-empty string or null", "e.g. null")


@pytest.mark.parametrize(
    ("extra", "field", "value", "problem_fix"),
    [
        ({"remote_tls_ca_file": "ca.crt"}, "remote_tls_ca_file", "ca.crt",
         ("is set but remote_url is plaintext", PLAINTEXT_FIX)),
        ({"remote_encrypt": True}, "remote_encrypt", True,
         ("needs the fleet secret (the AES key derives from it)",
          "set remote_secret_env or remote_secret_file, or drop remote_encrypt")),
        ({"remote_encrypt": "yes"}, "remote_encrypt", "yes",
         ("must be true or false", "write a JSON boolean")),
        ({"remote_username": 7}, "remote_username", 7, STRING),
        ({"remote_password_env": ""}, "remote_password_env", "", STRING),
        ({"remote_password_env": "HYBRIDKV_UNSET_VARIABLE"}, "remote_password_env",
         "HYBRIDKV_UNSET_VARIABLE",
         ("names an environment variable that is unset or empty in this process",
          ENV_FIX.format("HYBRIDKV_UNSET_VARIABLE"))),
        ({"remote_secret_env": "HYBRIDKV_SHORT_SECRET"}, "remote_secret_env", "<12 bytes>",
         ("must be at least 32 bytes", "make one: openssl rand -base64 32 > fleet.secret")),
        ({"remote_username": "engine"}, "remote_username", "engine",
         ("is set without a password",
          "give the user's password through remote_password_env or remote_password_file")),
        ({"remote_secret_env": "HYBRIDKV_SHORT_SECRET", "remote_secret_file": "f"},
         "remote_secret_file", "f", ("is given with remote_secret_env too", "give only one")),
    ],
)  # fmt: skip
def test_a_bad_security_key_is_refused_whole(
    monkeypatch: pytest.MonkeyPatch,
    extra: dict[str, Any],
    field: str,
    value: object,
    problem_fix: tuple[str, str],
) -> None:
    monkeypatch.setenv("HYBRIDKV_SHORT_SECRET", "short-secret")
    monkeypatch.delenv("HYBRIDKV_UNSET_VARIABLE", raising=False)
    refused = _refusal({"remote_url": "redis://cache.local:6379", **extra})
    assert (refused.field, refused.value, refused.problem, refused.fix) == (
        f"{W}.{field}",
        value,
        *problem_fix,
    )
    assert "short-secret" not in str(refused)


def test_a_short_secret_in_a_file_names_the_file(tmp_path: Path) -> None:
    short = tmp_path / "short.secret"
    short.write_text("short-secret\n")
    refused = _refusal({"remote_url": URL, "remote_secret_file": str(short)})
    assert (refused.field, refused.value) == (f"{W}.remote_secret_file", "<12 bytes>")


def test_a_password_file_that_is_not_text_is_refused_naming_the_file(tmp_path: Path) -> None:
    binary = tmp_path / "password.bin"
    binary.write_bytes(b"\xff\xfe\x00secret")
    refused = _refusal({"remote_url": URL, "remote_password_file": str(binary)})
    assert (refused.field, refused.value, refused.problem, refused.fix) == (
        f"{W}.remote_password_file",
        "<hidden>",
        "is not UTF-8 text",
        "give the password as text",
    )


def test_tls_files_are_checked_when_the_config_is_parsed(files: dict[str, str]) -> None:
    refused = _refusal({"remote_url": URL, "remote_tls_ca_file": "/nonexistent/ca.crt"})
    assert (refused.field, refused.problem) == (
        f"{W}.remote_tls_ca_file",
        "is not a readable file",
    )
    refused = _refusal({"remote_url": URL, "remote_tls_cert_file": files["client.crt"]})
    assert refused.field == f"{W}.remote_tls_cert_file"


HOWTO = Path(__file__).resolve().parents[2] / "docs" / "howto" / "share-prefix-cache.md"


def test_the_howto_secure_config_parses_with_its_secrets_in_place(
    files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = [x for x in HOWTO.read_text().splitlines() if "--kv-transfer-config" in x]
    (secure,) = [x for x in lines if "remote_secret_file" in x]
    extra = json.loads(secure.split("--kv-transfer-config '")[1].rstrip("'"))[
        "kv_connector_extra_config"
    ]
    assert extra["remote_password_env"] == "HYBRIDKV_REDIS_PASSWORD"
    monkeypatch.setenv("HYBRIDKV_REDIS_PASSWORD", PASSWORD)
    # The files it names, here: the how-to's paths are the operator's.
    extra |= {"remote_tls_ca_file": files["ca.crt"], "remote_secret_file": files["secret"]}
    remote = parse_extra_config(extra).remote
    assert remote is not None
    assert (remote.host, remote.port, remote.namespace) == ("cache.internal", 6380, "prod")
    assert remote.credentials == Credentials("hybridkv", PASSWORD)
    assert remote.tls == TlsFiles(files["ca.crt"])
    assert remote.key == FleetKey(SECRET.encode(), encrypt=True)


@pytest.mark.parametrize("key", ["remote_secret_env", "remote_encrypt", "remote_tls_ca_file"])
def test_a_security_key_without_a_remote_url_is_refused(key: str) -> None:
    refused = _refusal({key: True if key == "remote_encrypt" else "x"})
    assert (refused.field, refused.problem) == (f"{W}.{key}", "is set but remote_url is null")


# ------------------------------------------------------------------ two engines, a secure server


@dataclasses.dataclass(frozen=True, slots=True)
class Secure:
    """A server with TLS, a default-user password and an ACL user ``engine``."""

    server: Any
    certs: Any


@pytest.fixture
def secure(tmp_path: Path) -> Iterator[Secure]:
    from _certs import make_certs
    from _redis_server import RedisServer

    certs = make_certs(tmp_path / "server")  # apart from the files fixture's
    admin_password = "admin-password-c0ffee"
    args = [
        "--port", "0", "--tls-port", "{port}", "--tls-auth-clients", "no",
        "--tls-cert-file", str(certs.server_cert), "--tls-key-file", str(certs.server_key),
        "--tls-ca-cert-file", str(certs.ca), "--requirepass", admin_password,
    ]  # fmt: skip
    client = {"host": "127.0.0.1", "ssl": True, "ssl_ca_certs": str(certs.ca),
              "password": admin_password}  # fmt: skip
    server = RedisServer(redis_binary_or_skip(), tmp_path / "server", args, client)
    server.start()
    admin = server.admin()
    admin.execute_command(
        "ACL", "SETUSER", "engine", "on", f">{PASSWORD}", "~hybridkv:chunk:*", "-@all",
        "+get", "+set", "+exists",
    )  # fmt: skip
    admin.close()
    try:
        yield Secure(server, certs)
    finally:
        server.stop()


def _engine(shape: Shape, secure: Secure, secret_file: str | None) -> InProcessEngine:
    extra: dict[str, Any] = {
        "host_memory_bytes": HOST_BYTES,
        "chunk_size": shape.chunk,
        "remote_url": f"rediss://127.0.0.1:{secure.server.port}",
        "remote_username": "engine",
        "remote_password_env": "HYBRIDKV_TEST_PASSWORD",
        "remote_tls_ca_file": str(secure.certs.ca),
    }
    if secret_file is not None:
        extra |= {"remote_secret_file": secret_file, "remote_encrypt": True}
    transfer = KVTransferConfig(
        kv_connector="HybridKVConnector",
        kv_connector_module_path="hybridkv.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    return InProcessEngine(
        RECIPES[shape.layout].config_json(), shape.settings, transfer, HybridKVOnCPU(delay=1)
    )


@pytest.mark.remote
def test_a_wrong_password_stops_the_engine_at_start_up(
    secure: Secure, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDKV_TEST_PASSWORD", "not-the-engine-password")
    with pytest.raises(HybridKVConfigError) as caught:
        _engine(SHAPES[Layout.SLIDING_FULL], secure, None)
    assert caught.value.field == "remote_password"
    assert "refused ACL user 'engine'" in caught.value.problem
    assert "not-the-engine-password" not in str(caught.value)


@pytest.mark.remote
def test_secure_engines_share_chunks_and_refuse_every_rewritten_one(
    secure: Secure, files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDKV_TEST_PASSWORD", PASSWORD)
    shape = SHAPES[Layout.SLIDING_FULL]
    a = _engine(shape, secure, files["secret"])
    ra = run_prompts(a, chat_prompts(shape.trace, "a-"))
    assert flush_writes(a)
    written = a.worker.worker_remote.counters()["remote_written"]
    assert written > 0
    b = _engine(shape, secure, files["secret"])
    rb = run_prompts(b, chat_prompts(shape.trace, "b-"))
    b_remote = b.scheduler.connector.remote
    assert b_remote.count["promoted"] > 0
    assert rb.external_hits > 0
    # Whoever holds the server's password but not the secret rewrites every chunk: a valid
    # unkeyed value of other bytes, as an engine without remote_secret_* would write it.
    admin = secure.server.admin()
    names = admin.keys(redis_key(b"").decode() + "*")
    assert len(names) == written
    for name in names:
        value = admin.get(name)
        assert SECRET.encode() not in value
        admin.set(name, b"HKVC\x00\x02" + value[6:])  # relabelled unkeyed: refused as KEYING
    admin.close()
    c = _engine(shape, secure, files["secret"])
    rc = run_prompts(c, chat_prompts(shape.trace, "c-"))
    c_remote = c.scheduler.connector.remote
    refused = c.worker.worker_remote.counters()["remote_fetches_unauthenticated"]
    assert c_remote.count["promotions_started"] > 0
    assert c_remote.count["promoted"] == 0
    assert refused == c_remote.count["corrupt"] == c_remote.count["promotions_started"]
    for report in (ra, rb, rc):
        assert report.finished == report.requests > 0
        assert report.wrong_reads == 0
        assert report.preemptions == 0
        total = report.prefill_computed + report.gpu_prefix_hits + report.external_hits
        assert total == report.prompt_tokens
    for engine in (a, b, c):
        engine.close()
