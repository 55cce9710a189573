"""Remote tier throughput vs a plain redis-py SET/GET of the same bytes, same server, same run.

For each chunk layout, ``N`` chunks (one member per KV cache group, each member one host slot)
are written and read back two ways against one Redis/Valkey server:

- hybridkv write-behind: :meth:`RemoteTier.write_behind` of every chunk (encode: header,
  digest and the copy) then :meth:`RemoteTier.flush` (the writer thread's SETs), timed together.
- hybridkv promotion: :meth:`TwoTierStore.promote` of every chunk into empty host slots of a
  fresh host store (reservation, GET, verification, the copy into the slots), timed.
- plain: one redis-py ``SET`` per chunk of the same payload bytes (a zero-copy view of the
  chunk's contiguous source bytes), then one ``GET`` per chunk: the same number of values of
  the same payload sizes, no header, no digest, no copy into slots.

GB/s counts payload bytes only (the chunk header is hybridkv's overhead, not throughput), and
every figure is the median of ``--repeats`` timed passes, the four passes of a repeat run one
after the other. ``encode`` and ``verify`` are :func:`encode_chunk` and :func:`decode_chunk`
over the same chunks timed alone (no server), as a share of the write-behind and promotion
medians. After every pass the bytes are checked: the promoted slots equal the source bytes,
each plain GET returns what was SET, and both sides moved the same payload byte count.

Layouts come from the planner's plan of built-in presets (tp=1, the recommended chunk: one unit
per group; a member is one host slot of the largest group's unit bytes, as the connector's host
tier allocates them) plus a named 128 KB one below the smallest preset.

The value codec alone (no server, one thread), side by side in the same run: per layout,
:func:`encode_chunk` and :func:`decode_chunk` of every chunk as each value format does it, the
plain SHA-256 digest (no fleet key, format 2), the keyed MAC (HMAC-SHA256, format 3) and AES-256-GCM
encryption (format 4); GB/s of payload each way and the seconds per GB of one encode plus one
decode, the cost an engine pays per GB written and read back. Every decode is checked equal to
the source bytes. Encryption needs ``cryptography`` (``hybridkv[remote-crypto]``); without it
its rows say so.

Then, on the same server and in the same run, two engines (``tools/_shared_tier.py``): vLLM
0.33's real ``Scheduler`` in-process with HybridKVConnector; engine A serves a chat trace and
writes behind, engine B serves the same prompts through the remote tier, and a third engine
without the remote tier serves them too; printed per layout: the prefill B saved against it,
with what A wrote, what B promoted and wrong reads (which must be 0). This part needs vLLM
0.33 (``nox -s bench`` installs it); where vLLM does not import it prints why and the tool exits
2 after the GB/s table, unless ``--no-engines``.

Usage: ``python tools/bench_remote.py [--repeats N] [--total-mb N] [--port P] [--quick | --tiny]
[--no-engines]``. Without ``--port`` it starts its own ``redis-server`` (or ``valkey-server``)
on 127.0.0.1 on a free port, without persistence, in a temporary directory, and stops it at
the end.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from hybridkv.cli.plan import build_plan
from hybridkv.errors import HybridKVConfigError
from hybridkv.remote import (
    Admission,
    Chunk,
    FleetKey,
    PromoteOutcome,
    RemoteConfig,
    RemoteTier,
    SlotBuffer,
    TwoTierStore,
    decode_chunk,
    encode_chunk,
    make_chunk,
)
from hybridkv.store import HostStore
from spec.presets import preset_config

BINARIES = ("redis-server", "valkey-server")
PRESETS = ("gemma-3-1b", "gpt-oss-20b", "jamba-mini-1.5", "granite-4.0-h-tiny")
_PLAIN_PREFIX = b"bench:plain:"


@dataclass(frozen=True, slots=True)
class Layout:
    """One chunk shape: ``members`` payloads of ``member_bytes`` each (one per group)."""

    name: str
    members: int
    member_bytes: int

    @property
    def chunk_bytes(self) -> int:
        """Payload bytes of one chunk."""
        return self.members * self.member_bytes


@dataclass(frozen=True, slots=True)
class Row:
    """One layout's medians (seconds) and the byte counts each side moved per pass."""

    layout: Layout
    chunks: int
    write_s: float
    plain_set_s: float
    fetch_s: float
    plain_get_s: float
    write_ratio: float
    fetch_ratio: float
    encode_s: float
    verify_s: float
    bytes_written: int
    bytes_fetched: int
    plain_bytes_set: int
    plain_bytes_got: int

    @property
    def payload_bytes(self) -> int:
        """Payload bytes per pass, the same on both sides."""
        return self.chunks * self.layout.chunk_bytes


def preset_layout(preset: str) -> Layout:
    """The chunk of ``preset``'s plan at tp=1: one member per group, each the largest group's
    bytes per offload unit (the host slot size)."""
    plan = build_plan(preset_config(preset), source=f"preset:{preset}")
    offload = plan["offload"]
    per_group = [
        group["page_size_bytes"] * group["num_layers"] * unit // group["block_size"]
        for group, unit in zip(plan["groups"], offload["units"], strict=True)
    ]
    return Layout(preset, len(per_group), max(per_group))


def default_layouts() -> list[Layout]:
    """A named 128 KB chunk, then the presets' chunks, smallest first."""
    layouts = [Layout("named", 2, 64 * 1024)]
    layouts += sorted((preset_layout(p) for p in PRESETS), key=lambda lay: lay.chunk_bytes)
    return layouts


# --- the server ---


def find_binary() -> str:
    """The first of BINARIES on PATH; SystemExit naming the fix without one."""
    for name in BINARIES:
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit(
        "bench_remote: neither redis-server nor valkey-server is on PATH. Install one "
        "(`apt-get install -y redis-server`) or pass --port of a running server."
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def own_server(timeout_s: float = 10.0) -> Iterator[int]:
    """A fresh server on 127.0.0.1 (free port, no RDB/AOF, temp dir); yields its port."""
    binary = find_binary()
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="bench_remote_") as workdir:
        args = [
            binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", workdir, "--daemonize", "no",
            "--logfile", str(Path(workdir) / "server.log"),
        ]  # fmt: skip
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _wait_ready(process, port, timeout_s)
            yield port
        finally:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_ready(process: subprocess.Popen[bytes], port: int, timeout_s: float) -> None:
    client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            err = process.stderr.read().decode() if process.stderr else ""
            raise SystemExit(f"bench_remote: the server exited at start: {err}")
        with contextlib.suppress(redis.exceptions.ConnectionError):
            if client.ping():
                client.close()
                return
        time.sleep(0.02)
    raise SystemExit(f"bench_remote: the server did not answer PING within {timeout_s}s")


# --- one layout ---


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _chunks(layout: Layout, count: int, namespace: bytes) -> list[Chunk]:
    return [
        make_chunk(
            namespace, [b"c%d/g%d/%d" % (c, g, layout.member_bytes) for g in range(layout.members)]
        )
        for c in range(count)
    ]


def _write_behind(
    config: RemoteConfig, chunks: Sequence[Chunk], source: SlotBuffer, members: int
) -> tuple[float, int]:
    """Seconds to write every chunk behind and flush; payload bytes the server got."""
    tier = RemoteTier(config)
    views = [[source.view(c * members + g) for g in range(members)] for c in range(len(chunks))]

    def run() -> None:
        for chunk, payloads in zip(chunks, views, strict=True):
            admitted = tier.write_behind(chunk, payloads)
            assert admitted is Admission.ENQUEUED, admitted
        assert tier.flush(config.deadline_s * len(chunks)), "write-behind did not drain"

    seconds = _timed(run)
    counters = tier.snapshot()["counters"]
    tier.close()
    assert counters["written"] == len(chunks), counters
    assert counters["writes_failed"] == counters["writes_dropped"] == 0, counters
    return seconds, sum(len(v) for row in views for v in row)


def _promote(
    config: RemoteConfig, chunks: Sequence[Chunk], source: SlotBuffer, members: int
) -> tuple[float, int]:
    """Seconds to promote every chunk into a fresh host store; payload bytes now in its slots
    (each checked equal to the source bytes)."""
    capacity = len(chunks) * members
    store = TwoTierStore(
        HostStore(capacity),
        RemoteTier(config, background=False),
        SlotBuffer.allocate(capacity, source.slot_bytes),
    )

    def run() -> None:
        for chunk in chunks:
            outcome = store.promote(chunk)
            assert outcome is PromoteOutcome.PROMOTED, outcome

    seconds = _timed(run)
    store.tier.close()
    fetched = 0
    for c, chunk in enumerate(chunks):
        for g, slot in enumerate(store.host.slots(chunk.members)):
            got = bytes(store.slots.view(slot))  # bytes: memcmp, not a per-item compare
            assert got == bytes(source.view(c * members + g)), f"chunk {c} member {g} differs"
            fetched += len(got)
    return seconds, fetched


def _plain(
    client: redis.Redis, keys: Sequence[bytes], values: Sequence[memoryview]
) -> tuple[float, float, int, int]:
    """Seconds of one SET per value then one GET per key; bytes SET and bytes read back
    (each value checked equal to what was SET)."""
    set_s = _timed(lambda: [client.set(k, v) for k, v in zip(keys, values, strict=True)])
    got: list[bytes] = []
    get_s = _timed(lambda: got.extend(client.get(k) for k in keys))  # type: ignore[misc]
    for i, (value, back) in enumerate(zip(values, got, strict=True)):
        assert back == bytes(value), f"plain value {i} differs"
    return set_s, get_s, sum(len(v) for v in values), sum(len(b) for b in got)


def _codec_alone(chunks: Sequence[Chunk], source: SlotBuffer, members: int) -> tuple[float, float]:
    """Seconds to encode every chunk, and to decode (verify) every encoded value, no server."""
    encode_s = verify_s = 0.0
    for c, chunk in enumerate(chunks):
        payloads = [source.view(c * members + g) for g in range(members)]
        start = time.perf_counter()
        value = encode_chunk(chunk.members, payloads)
        middle = time.perf_counter()
        decoded = decode_chunk(value, chunk.members)
        verify_s += time.perf_counter() - middle
        encode_s += middle - start
        assert decoded.corruption is None, decoded.corruption
    return encode_s, verify_s


def measure(layout: Layout, count: int, repeats: int, port: int, seed: int = 0) -> Row:
    """Median timings of ``repeats`` passes of ``count`` chunks of ``layout`` on ``port``."""
    data = bytearray(random.Random(seed).randbytes(count * layout.chunk_bytes))
    source = SlotBuffer(data, layout.member_bytes)
    whole = memoryview(data)
    values = [whole[c * layout.chunk_bytes : (c + 1) * layout.chunk_bytes] for c in range(count)]
    keys = [_PLAIN_PREFIX + b"%d" % c for c in range(count)]
    # Generous deadline: a timeout would end the pass with an assertion, not a figure.
    config = RemoteConfig(port=port, deadline_s=60.0, max_pending=count, namespace=b"bench")
    admin = redis.Redis(port=port, socket_timeout=60)
    samples: dict[str, list[float]] = {k: [] for k in ("w", "s", "f", "g", "e", "v", "rw", "rf")}
    counts: set[tuple[int, int, int, int]] = set()
    for repeat in range(repeats):
        admin.flushall()
        chunks = _chunks(layout, count, b"bench/%d" % repeat)
        write_s, written = _write_behind(config, chunks, source, layout.members)
        fetch_s, fetched = _promote(config, chunks, source, layout.members)
        admin.flushall()
        set_s, get_s, plain_set, plain_got = _plain(admin, keys, values)
        admin.flushall()
        encode_s, verify_s = _codec_alone(chunks, source, layout.members)
        taken = {"w": write_s, "s": set_s, "f": fetch_s, "g": get_s, "e": encode_s, "v": verify_s}
        for name, seconds in taken.items():
            samples[name].append(seconds)
        # hybridkv GB/s over plain GB/s of the same repeat: both met the same machine load.
        samples["rw"].append(set_s / write_s)
        samples["rf"].append(get_s / fetch_s)
        counts.add((written, fetched, plain_set, plain_got))
    admin.close()
    assert len(counts) == 1, counts  # every pass moved the same bytes
    ((written, fetched, plain_set, plain_got),) = counts
    med = {name: statistics.median(values) for name, values in samples.items()}
    return Row(
        layout, count, med["w"], med["s"], med["f"], med["g"], med["rw"], med["rf"],
        med["e"], med["v"],
        written, fetched, plain_set, plain_got,
    )  # fmt: skip


# --- the value codec alone: digest, MAC, AES-GCM ---

VALUE_MODES = ("digest", "mac", "aes-gcm")


@dataclass(frozen=True, slots=True)
class CodecRow:
    """One layout's codec medians (seconds per pass) in one value format."""

    layout: Layout
    mode: str
    payload_bytes: int
    encode_s: float
    decode_s: float

    @property
    def s_per_gb(self) -> float:
        """Seconds of one encode plus one decode per GB of payload."""
        return (self.encode_s + self.decode_s) / (self.payload_bytes / 1e9)


def _fleet_key(mode: str) -> FleetKey | str | None:
    """The key of ``mode`` (a fresh random secret), or why it cannot run."""
    if mode == "digest":
        return None
    try:
        return FleetKey(os.urandom(32), encrypt=mode == "aes-gcm")
    except HybridKVConfigError as missing:
        return f"skipped: {missing.problem}"


def codec_costs(layout: Layout, count: int, repeats: int, seed: int = 0) -> list[CodecRow | str]:
    """Median encode and decode seconds of ``count`` chunks of ``layout`` in each value mode
    (a string where a mode cannot run); every decode checked equal to the source."""
    data = bytearray(random.Random(seed).randbytes(count * layout.chunk_bytes))
    source = SlotBuffer(data, layout.member_bytes)
    chunks = _chunks(layout, count, b"codec")
    rows: list[CodecRow | str] = []
    for mode in VALUE_MODES:
        key = _fleet_key(mode)
        if isinstance(key, str):
            rows.append(f"{layout.name} {mode}: {key}")
            continue
        encode_s, decode_s = [], []
        for _ in range(repeats):
            values: list[bytes] = []
            for c, chunk in enumerate(chunks):
                payloads = [source.view(c * layout.members + g) for g in range(layout.members)]
                start = time.perf_counter()
                values.append(encode_chunk(chunk.members, payloads, key, chunk.key))
                encode_s.append(time.perf_counter() - start)
            for c, (chunk, value) in enumerate(zip(chunks, values, strict=True)):
                start = time.perf_counter()
                decoded = decode_chunk(value, chunk.members, key, chunk.key)
                decode_s.append(time.perf_counter() - start)
                whole = b"".join(decoded.payloads)
                at = c * layout.chunk_bytes
                assert whole == data[at : at + layout.chunk_bytes], f"{mode} chunk {c} differs"
        per_pass = count  # samples are per chunk: a pass is the sum of `count` of them
        rows.append(
            CodecRow(
                layout, mode, count * layout.chunk_bytes,
                statistics.median(encode_s) * per_pass, statistics.median(decode_s) * per_pass,
            )
        )  # fmt: skip
    return rows


CODEC_HEADER = (
    "| chunk | value | encode GB/s | decode GB/s | s per GB (encode + decode) | x digest |"
)


def format_codec(rows: Sequence[CodecRow | str]) -> list[str]:
    """The codec table's rows (and the lines of modes that could not run)."""
    lines, base = [], 0.0
    for row in rows:
        if isinstance(row, str):
            lines.append(row)
            continue
        if row.mode == "digest":
            base = row.s_per_gb
        n = row.payload_bytes
        cells = (
            f"{row.layout.name} ({_size(row.layout.chunk_bytes)})", row.mode,
            f"{_gbps(n, row.encode_s):.2f}", f"{_gbps(n, row.decode_s):.2f}",
            f"{row.s_per_gb:.3f}", f"{row.s_per_gb / base:.2f}" if base else "-",
        )  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# --- report ---

HEADER = (
    "| chunk | members x bytes | chunks | write GB/s | plain SET GB/s | write/SET "
    "| promote GB/s | plain GET GB/s | promote/GET | encode share | verify share |"
)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _size(nbytes: int) -> str:
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MB"
    return f"{nbytes / 1024:.0f} KB"


def format_row(row: Row) -> str:
    """One markdown table row of ``row``."""
    lay, n = row.layout, row.payload_bytes
    write, plain_set = _gbps(n, row.write_s), _gbps(n, row.plain_set_s)
    fetch, plain_get = _gbps(n, row.fetch_s), _gbps(n, row.plain_get_s)
    cells = (
        f"{lay.name} ({_size(lay.chunk_bytes)})",
        f"{lay.members} x {lay.member_bytes}",
        str(row.chunks),
        f"{write:.2f}", f"{plain_set:.2f}", f"{row.write_ratio:.2f}",
        f"{fetch:.2f}", f"{plain_get:.2f}", f"{row.fetch_ratio:.2f}",
        f"{row.encode_s / row.write_s:.0%}", f"{row.verify_s / row.fetch_s:.0%}",
    )  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def format_bytes_check(row: Row) -> str:
    """The byte identity line of ``row``: what each side moved per pass."""
    return (
        f"{row.layout.name}: payload {row.payload_bytes} B per pass; hybridkv wrote "
        f"{row.bytes_written}, promoted {row.bytes_fetched} (slots equal to the source); "
        f"plain SET {row.plain_bytes_set}, GET {row.plain_bytes_got} (values equal)"
    )


def run(layouts: Sequence[Layout], total_bytes: int, repeats: int, port: int) -> list[Row]:
    """Measure every layout (at least 3 chunks each, about ``total_bytes`` per pass)."""
    return [measure(lay, max(3, total_bytes // lay.chunk_bytes), repeats, port) for lay in layouts]


def digest_speeds(nbytes: int, repeats: int = 3) -> dict[str, float]:
    """GB/s of hashlib's SHA-256 (the codec's digest) and BLAKE2b over ``nbytes``, medians."""
    data = random.Random(1).randbytes(nbytes)
    speeds = {}
    for name in ("sha256", "blake2b"):
        taken = []
        for _ in range(repeats):
            start = time.perf_counter()
            hashlib.new(name, data).digest()
            taken.append(time.perf_counter() - start)
        speeds[name] = _gbps(nbytes, statistics.median(taken))
    return speeds


def report(rows: Sequence[Row], port: int, server: str, digests: dict[str, float]) -> None:
    """Print the table, the digests' speeds alone, and the byte checks."""
    print(f"server: {server} on 127.0.0.1:{port}; python {platform.python_version()}, "
          f"redis-py {redis.__version__}")  # fmt: skip
    print("GB/s = payload bytes / median seconds of the passes; a ratio is the median over the "
          "repeats of hybridkv GB/s / plain GB/s in that repeat")  # fmt: skip
    print()
    print(HEADER)
    print("|" + "---|" * HEADER.count(" | ") + "---|")
    for row in rows:
        print(format_row(row))
    print()
    speeds = ", ".join(f"{name} {gbps:.2f} GB/s" for name, gbps in digests.items())
    print(f"digest alone, one thread: {speeds} (the codec uses sha256)")
    for row in rows:
        print(format_bytes_check(row))


def report_codec(layouts: Sequence[Layout], total_bytes: int, repeats: int) -> None:
    """Print the value codec's cost per layout and value format (module docstring)."""
    print()
    print("value codec alone, one thread, no server: per chunk, median of the repeats; GB/s "
          "of payload; x digest = s per GB over the digest's")  # fmt: skip
    print()
    print(CODEC_HEADER)
    print("|" + "---|" * (CODEC_HEADER.count(" | ") + 1))
    for layout in layouts:
        count = max(3, total_bytes // layout.chunk_bytes)
        for line in format_codec(codec_costs(layout, count, repeats)):
            print(line)


def _server_version(port: int) -> str:
    client = redis.Redis(port=port, socket_timeout=5)
    info = client.info("server")
    client.close()
    name = "valkey" if "valkey_version" in info else "redis"
    return f"{name}-server {info.get('valkey_version', info['redis_version'])}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 when every pass moved the same bytes on both sides."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per layout")
    parser.add_argument("--total-mb", type=int, default=64, help="payload MB per pass")
    parser.add_argument("--port", type=int, help="use the server on 127.0.0.1:PORT (it is flushed)")
    parser.add_argument("--tiny", action="store_true", help="one 3 x 4 KB layout (a smoke run)")
    parser.add_argument("--quick", action="store_true", help="8 MB per pass, 3 repeats")
    parser.add_argument(
        "--no-engines", action="store_true", help="skip the two-engine prefill part (no vLLM)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.total_mb, args.repeats = 8, 3
    if args.repeats < 1 or args.total_mb < 1:
        parser.error("--repeats and --total-mb must be >= 1")
    layouts = [Layout("tiny", 3, 4096)] if args.tiny else default_layouts()
    total = 64 * 1024 if args.tiny else args.total_mb << 20
    with contextlib.ExitStack() as stack:
        port = args.port if args.port is not None else stack.enter_context(own_server())
        rows = run(layouts, total, args.repeats, port)
        report(rows, port, _server_version(port), digest_speeds(min(total, 16 << 20)))
        report_codec(layouts, total, args.repeats)
        if args.tiny or args.no_engines:
            return 0
        return two_engines(port)


def two_engines(port: int) -> int:
    """The prefill engine B saves through the server at ``port``; 2 without vLLM, 1 on a
    wrong read."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _shared_tier
    from _vllm_tool import require_vllm, torchvision_shim

    shim = torchvision_shim("bench_remote")  # kept alive while vLLM imports (_vllm_tool)
    require_vllm("bench_remote")  # exits 2 with the reason where vLLM 0.33 does not import
    print()
    print("two engines, one server (vLLM 0.33's Scheduler in-process, HybridKVConnector, "
          "one-block chunks, host tier 2x the working set each; B alone: the same engine "
          "without the remote tier):")  # fmt: skip
    saved = _shared_tier.run(port)
    for row in saved:
        print(_shared_tier.format_saved(row))
    del shim
    return 1 if any(row.wrong_reads for row in saved) else 0


if __name__ == "__main__":
    sys.exit(main())
