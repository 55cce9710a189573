"""Every refusal of ``kv_connector_extra_config`` (:mod:`hybridkv.vllm.config`), whole: field,
value, problem, fix and the one-line message, and each accepted boundary with the value it
parses to.

A refusal is what an operator reads when ``vllm serve`` will not start: these tests pin its words
as well as its field, so a message that loses its value or its fix fails here. They were written
for the mutants mutmut left alive in ``tools/mutants.py``'s run over the module
(docs/explanation/mutations.md, "Whole modules under mutmut"). The module imports no vLLM, but
its package (``hybridkv.vllm``) does, hence the skip.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed")

from hybridkv.errors import HybridKVConfigError
from hybridkv.vllm.config import (
    DEFAULTS,
    DiskSettings,
    HybridKVConfig,
    RemoteSettings,
    check_failure_policy,
    parse_extra_config,
)

pytestmark = pytest.mark.vllm

W = "kv_connector_extra_config"
URL_FIX = (
    'write "redis://HOST:PORT" (database 0; separate engines with remote_namespace), '
    'or "redis+cluster://HOST:PORT,HOST:PORT" for a cluster'
)
KEYS = (
    "chunk_size, eviction_policy, gpu_scratch_bytes, host_memory_bytes, load_deadline_steps, "
    "offload_decode_state, sync_load_max_bytes"
)
REMOTE_KEYS = (
    "remote_breaker_backoff_ms, remote_breaker_failures, remote_encrypt, "
    "remote_lookup_wait_ms, remote_max_pending_writes, remote_namespace, "
    "remote_password_env, remote_password_file, remote_secret_env, remote_secret_file, "
    "remote_timeout_ms, remote_tls_ca_file, remote_tls_cert_file, remote_tls_key_file, "
    "remote_ttl_s, remote_url, remote_username"
)
NO_REMOTE_FIX = 'set "remote_url": "redis://host:port", or drop the key'
SYNC_PROBLEM = (
    "sync loads are refused: with several KV cache groups vLLM 0.33 cannot undo a failed sync "
    "load (block ids raise at v1/core/sched/scheduler.py:3712, failed_recving of a running "
    "request is ignored at 3688-3701)"
)
SYNC_FIX = "leave it 0, every load async (docs/explanation/vllm-differential.md, Sync loads)"
REMOTE = {"remote_url": "redis://cache.local:6379"}


def _refusal(extra: dict[str, Any]) -> HybridKVConfigError:
    with pytest.raises(HybridKVConfigError) as caught:
        parse_extra_config(extra)
    return caught.value


def _whole(refused: HybridKVConfigError) -> tuple[str, object, str, str]:
    return (refused.field, refused.value, refused.problem, refused.fix)


@pytest.mark.parametrize("extra", [None, {}, dict(DEFAULTS)])
def test_no_keys_and_the_defaults_parse_to_the_documented_config(extra: Any) -> None:
    assert parse_extra_config(extra) == HybridKVConfig(
        host_memory_bytes=4 << 30,
        chunk_size=None,
        eviction_policy="lru",
        load_deadline_steps=None,
        offload_decode_state=True,
        sync_load_max_bytes=0,
        gpu_scratch_bytes=64 << 20,
        remote=None,
    )


def test_every_key_at_its_lowest_accepted_value_is_kept_as_given() -> None:
    parsed = parse_extra_config(
        {
            "host_memory_bytes": 1,
            "chunk_size": 1,
            "eviction_policy": "arc",
            "load_deadline_steps": 1,
            "offload_decode_state": False,
            "gpu_scratch_bytes": 0,
            "sync_load_max_bytes": 0,
        }
    )
    assert parsed == HybridKVConfig(1, 1, "arc", 1, False, 0, 0, None)
    assert parse_extra_config({"eviction_policy": "lru"}).eviction_policy == "lru"


def test_the_first_unknown_key_in_sorted_order_is_refused_naming_every_known_key() -> None:
    refused = _refusal({"zeta": 2, "alpha": 1, "host_memory_bytes": 0})
    fix = f"use only {KEYS}, or a remote_* or disk_* key (docs/howto/serve.md)"
    assert _whole(refused) == (f"{W}.alpha", 1, "is not a hybridkv key", fix)
    assert str(refused) == f"{W}.alpha=1: is not a hybridkv key; {fix}"


@pytest.mark.parametrize("key", ["remote_password", "remote_secret"])
def test_an_unknown_remote_key_is_refused_naming_every_remote_key(key: str) -> None:
    refused = _refusal({key: "hunter2"})
    fix = f"use only {REMOTE_KEYS} (docs/howto/share-prefix-cache.md)"
    # A password or secret given inline is never echoed: the message goes to logs.
    assert _whole(refused) == (f"{W}.{key}", "<hidden>", "is not a hybridkv key", fix)
    assert str(refused) == f"{W}.{key}='<hidden>': is not a hybridkv key; {fix}"


def test_an_unknown_key_of_no_secret_shows_its_value() -> None:
    assert _refusal({"remote_user": "engine"}).value == "engine"


@pytest.mark.parametrize(
    ("key", "value", "low", "example"),
    [
        ("host_memory_bytes", 0, 1, 4 << 30),
        ("host_memory_bytes", True, 1, 4 << 30),
        ("host_memory_bytes", "8GiB", 1, 4 << 30),
        ("gpu_scratch_bytes", -1, 0, 64 << 20),
        ("gpu_scratch_bytes", 1.0, 0, 64 << 20),
        ("sync_load_max_bytes", -1, 0, 0),
    ],
)
def test_a_size_below_its_floor_or_not_an_int_is_refused_with_an_example(
    key: str, value: object, low: int, example: int
) -> None:
    refused = _refusal({key: value})
    assert _whole(refused) == (
        f"{W}.{key}",
        value,
        f"must be an integer >= {low}",
        f"e.g. {example}",
    )
    assert str(refused) == f"{W}.{key}={value!r}: must be an integer >= {low}; e.g. {example}"


@pytest.mark.parametrize("key", ["chunk_size", "load_deadline_steps"])
@pytest.mark.parametrize("value", [0, -3, True, "8", 2.0])
def test_an_optional_count_below_one_or_not_an_int_is_refused(key: str, value: object) -> None:
    refused = _refusal({key: value})
    problem, fix = "must be an integer >= 1 or null", "e.g. null (default)"
    assert _whole(refused) == (f"{W}.{key}", value, problem, fix)
    assert str(refused) == f"{W}.{key}={value!r}: {problem}; {fix}"


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_offload_decode_state_must_be_a_boolean(value: object) -> None:
    refused = _refusal({"offload_decode_state": value})
    field = f"{W}.offload_decode_state"
    assert _whole(refused) == (field, value, "must be true or false", "write a JSON boolean")
    assert str(refused) == f"{field}={value!r}: must be true or false; write a JSON boolean"


@pytest.mark.parametrize("value", ["fifo", "LRU", None])
def test_an_unknown_eviction_policy_is_refused_naming_both(value: object) -> None:
    refused = _refusal({"eviction_policy": value})
    field = f"{W}.eviction_policy"
    assert _whole(refused) == (field, value, "is not an eviction policy", "use lru or arc")
    assert str(refused) == f"{field}={value!r}: is not an eviction policy; use lru or arc"


def test_a_sync_load_size_is_refused_with_the_reason_vllm_cannot_undo_it() -> None:
    refused = _refusal({"sync_load_max_bytes": 4096})
    assert _whole(refused) == (f"{W}.sync_load_max_bytes", 4096, SYNC_PROBLEM, SYNC_FIX)
    assert str(refused) == f"{W}.sync_load_max_bytes=4096: {SYNC_PROBLEM}; {SYNC_FIX}"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("remote_namespace", "prod"),
        ("remote_ttl_s", 5),
        ("remote_max_pending_writes", 8),
        ("remote_timeout_ms", 100),
        ("remote_lookup_wait_ms", 5),
        ("remote_breaker_failures", 1),
        ("remote_breaker_backoff_ms", 100),
    ],
)
def test_a_remote_key_without_a_remote_url_is_refused(key: str, value: object) -> None:
    refused = _refusal({key: value})
    assert _whole(refused) == (
        f"{W}.{key}",
        value,
        "is set but remote_url is null",
        NO_REMOTE_FIX,
    )
    assert str(refused) == f"{W}.{key}={value!r}: is set but remote_url is null; {NO_REMOTE_FIX}"


def test_remote_keys_at_their_defaults_without_a_url_are_no_remote_tier() -> None:
    remote_defaults = {k: v for k, v in DEFAULTS.items() if k.startswith("remote_")}
    assert parse_extra_config(remote_defaults).remote is None


def test_a_remote_url_parses_every_remote_key() -> None:
    parsed = parse_extra_config(
        {
            "remote_url": "redis://cache.local:6380/0",
            "remote_namespace": "prod",
            "remote_ttl_s": 7,
            "remote_max_pending_writes": 3,
            "remote_timeout_ms": 250,
            "remote_lookup_wait_ms": 0,
            "remote_breaker_failures": 5,
            "remote_breaker_backoff_ms": 750,
        }
    )
    assert parsed.remote == RemoteSettings("cache.local", 6380, "prod", 7, 3, 0.25, 0.0, 5, 0.75)
    assert parse_extra_config(REMOTE).remote == RemoteSettings(
        "cache.local", 6379, "hybridkv", 0, 64, 0.2
    )


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"remote_ttl_s": 0, "remote_max_pending_writes": 1}, (0, 1)),
        ({"remote_timeout_ms": 1}, 0.001),
        ({"remote_timeout_ms": 60_000}, 60.0),
        ({"remote_lookup_wait_ms": 60_000, "remote_breaker_backoff_ms": 3_600_000}, (60.0, 3600.0)),
        ({"remote_lookup_wait_ms": 0, "remote_breaker_backoff_ms": 1}, (0.0, 0.001)),
    ],
)
def test_remote_bounds_are_accepted(extra: dict[str, Any], expected: object) -> None:
    remote = parse_extra_config({**REMOTE, **extra}).remote
    assert remote is not None
    if "remote_lookup_wait_ms" in extra:
        assert (remote.lookup_wait_s, remote.breaker_backoff_s) == expected
    elif isinstance(expected, tuple):
        assert (remote.ttl_s, remote.max_pending_writes) == expected
    else:
        assert remote.timeout_s == expected


@pytest.mark.parametrize(
    ("key", "value", "problem", "fix"),
    [
        ("remote_namespace", "", "must be a non-empty string", 'e.g. "prod"'),
        ("remote_namespace", b"ns", "must be a non-empty string", 'e.g. "prod"'),
        ("remote_timeout_ms", 60_001, "must be at most 60000", "e.g. 200"),
        ("remote_timeout_ms", 0, "must be an integer >= 1", "e.g. 200"),
        ("remote_ttl_s", -1, "must be an integer >= 0", "e.g. 0"),
        ("remote_max_pending_writes", 0, "must be an integer >= 1", "e.g. 64"),
        ("remote_lookup_wait_ms", -1, "must be an integer >= 0", "e.g. 20"),
        ("remote_lookup_wait_ms", 60_001, "must be at most 60000", "e.g. 20"),
        ("remote_lookup_wait_ms", 2.5, "must be an integer >= 0", "e.g. 20"),
        ("remote_breaker_failures", 0, "must be an integer >= 1", "e.g. 3"),
        ("remote_breaker_backoff_ms", 0, "must be an integer >= 1", "e.g. 5000"),
        ("remote_breaker_backoff_ms", 3_600_001, "must be at most 3600000", "e.g. 5000"),
    ],
)
def test_a_bad_remote_setting_is_refused_with_an_example(
    key: str, value: object, problem: str, fix: str
) -> None:
    refused = _refusal({**REMOTE, key: value})
    assert _whole(refused) == (f"{W}.{key}", value, problem, fix)
    assert str(refused) == f"{W}.{key}={value!r}: {problem}; {fix}"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        (6379, "is not a redis:// or rediss:// URL"),
        ("http://cache.local:6379", "is not a redis:// or rediss:// URL"),
        ("rediss:/cache.local:6379", "is not a redis:// or rediss:// URL"),
        ("redis://cache.local:6379/2", "names database '2': only 0 is used"),
        ("redis://cache.local:6379/00", "names database '00': only 0 is used"),
        ("redis://:6379", "needs a host and a port 1..65535, no user"),
        ("redis://cache.local", "needs a host and a port 1..65535, no user"),
        ("redis://cache.local:http", "needs a host and a port 1..65535, no user"),
        ("redis://cache.local:0", "needs a host and a port 1..65535, no user"),
        ("redis://cache.local:65536", "needs a host and a port 1..65535, no user"),
    ],
)
def test_a_bad_remote_url_is_refused_with_how_to_write_one(url: object, problem: str) -> None:
    refused = _refusal({"remote_url": url})
    assert _whole(refused) == (f"{W}.remote_url", url, problem, URL_FIX)
    assert str(refused) == f"{W}.remote_url={url!r}: {problem}; {URL_FIX}"


@pytest.mark.parametrize(
    ("url", "host", "port"),
    [
        ("redis://cache.local:1", "cache.local", 1),
        ("redis://cache.local:65535/", "cache.local", 65535),
        ("redis://10.0.0.7:6379/0", "10.0.0.7", 6379),
        ("redis://[::1]:6379", "[::1]", 6379),
        ("rediss://cache.local:6380/0", "cache.local", 6380),
    ],
)
def test_a_remote_url_names_host_and_port(url: str, host: str, port: int) -> None:
    remote = parse_extra_config({"remote_url": url}).remote
    assert remote is not None
    assert (remote.host, remote.port) == (host, port)


def test_a_load_deadline_is_refused_unless_vllm_recomputes_failed_loads() -> None:
    deadline = parse_extra_config({"load_deadline_steps": 4})
    check_failure_policy(deadline, "recompute")  # accepted: returns, raises nothing
    check_failure_policy(parse_extra_config({}), "fail")  # no deadline: any policy
    with pytest.raises(HybridKVConfigError) as caught:
        check_failure_policy(deadline, "fail")
    problem = (
        "needs kv_load_failure_policy 'recompute' (it is 'fail': an abandoned load would fail "
        "its request)"
    )
    fix = 'set "kv_load_failure_policy": "recompute", or leave the deadline null'
    assert _whole(caught.value) == (f"{W}.load_deadline_steps", 4, problem, fix)
    assert str(caught.value) == f"{W}.load_deadline_steps=4: {problem}; {fix}"


# ------------------------------------------------------------------ the disk tier (issue 31)

DISK = {"disk_dir": "/mnt/nvme/hybridkv", "disk_bytes": 1 << 30}
DISK_BYTES_FIX = (
    'give the bytes the tier may use on disk, e.g. "disk_bytes": 107374182400 (100 GiB)'
)


def test_disk_keys_parse_to_the_settings_each_names() -> None:
    assert parse_extra_config(DISK).disk == DiskSettings("/mnt/nvme/hybridkv", 1 << 30)
    given = {
        **DISK,
        "disk_policy": "arc",
        "disk_threads": 1,
        "disk_fsync": "never",
        "disk_direct": "off",
    }
    parsed = parse_extra_config(given)
    assert parsed.disk == DiskSettings("/mnt/nvme/hybridkv", 1 << 30, "arc", 1, "never", "off")
    assert parsed.remote is None
    assert parse_extra_config({}).disk is None


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("disk_bytes", 1 << 30),
        ("disk_policy", "arc"),
        ("disk_threads", 8),
        ("disk_fsync", "never"),
        ("disk_direct", "on"),
    ],
)
def test_a_disk_key_without_a_disk_dir_is_refused(key: str, value: object) -> None:
    refused = _refusal({key: value})
    fix = 'set "disk_dir": "/path/to/dir" (and disk_bytes), or drop the key'
    assert _whole(refused) == (f"{W}.{key}", value, "is set but disk_dir is null", fix)


def test_disk_keys_at_their_defaults_without_a_dir_are_no_disk_tier() -> None:
    disk_defaults = {k: v for k, v in DEFAULTS.items() if k.startswith("disk_")}
    assert parse_extra_config(disk_defaults).disk is None


@pytest.mark.parametrize("value", [None, 0, -1, True, 1.5, "1GiB"])
def test_disk_bytes_is_required_and_positive(value: object) -> None:
    refused = _refusal({"disk_dir": "/d", "disk_bytes": value})
    problem = "is required with disk_dir" if value is None else "must be an integer >= 1"
    assert _whole(refused) == (f"{W}.disk_bytes", value, problem, DISK_BYTES_FIX)


@pytest.mark.parametrize("value", ["", 3, "a\0b"])
def test_a_disk_dir_that_is_no_path_is_refused(value: object) -> None:
    refused = _refusal({**DISK, "disk_dir": value})
    assert (refused.field, refused.value) == (f"{W}.disk_dir", value)
    assert refused.problem == "must be a non-empty path string"


@pytest.mark.parametrize(
    ("key", "value", "fix"),
    [
        ("disk_policy", "fifo", "use lru or arc (default lru)"),
        ("disk_fsync", "always", "use file or never (default file)"),
        ("disk_fsync", True, "use file or never (default file)"),
        ("disk_direct", "yes", "use auto or on or off (default auto)"),
    ],
)
def test_a_disk_word_outside_its_choices_is_refused_naming_them(
    key: str, value: object, fix: str
) -> None:
    refused = _refusal({**DISK, key: value})
    assert refused.field == f"{W}.{key}"
    assert refused.value == value
    assert refused.fix == fix


@pytest.mark.parametrize("value", [0, -2, 1.0, True])
def test_disk_threads_below_one_is_refused(value: object) -> None:
    refused = _refusal({**DISK, "disk_threads": value})
    assert _whole(refused) == (f"{W}.disk_threads", value, "must be an integer >= 1", "e.g. 4")


def test_an_unknown_disk_key_names_every_disk_key() -> None:
    refused = _refusal({"disk_size": 5})
    keys = "disk_bytes, disk_dir, disk_direct, disk_fsync, disk_policy, disk_threads"
    assert refused.fix == f"use only {keys} (docs/howto/disk-tier.md)"


def test_disk_with_a_remote_url_parses_to_both_tiers_stacked() -> None:
    parsed = parse_extra_config({**DISK, **REMOTE})
    assert parsed.disk == DiskSettings("/mnt/nvme/hybridkv", 1 << 30)
    assert parsed.remote is not None
    assert (parsed.remote.host, parsed.remote.port) == ("cache.local", 6379)
