"""A throwaway Redis/Valkey server for the remote tests: 127.0.0.1, a free port, no persistence.

The tests start the real server binary found on PATH (``redis-server``, else ``valkey-server``)
in a temporary directory and can kill it (SIGKILL, as a crash would), restart it on the same
port, or stop it. ``nox -s remote`` installs ``redis-server`` from the system's package manager
where it is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import redis

BINARIES = ("redis-server", "valkey-server")


def find_binary() -> str | None:
    """The first server binary on PATH, or None."""
    for name in BINARIES:
        path = shutil.which(name)
        if path:
            return path
    return None


def found_or_skip(found: str | None, reason: str) -> str:
    """``found``; when None, the test skips for ``reason``, or fails under
    HYBRIDKV_REQUIRE_REDIS=1 (where a missing server binary is a broken set-up)."""
    import pytest  # here only: a runner (tools/soak.py) may import this module bare

    if found is None:
        if os.environ.get("HYBRIDKV_REQUIRE_REDIS") == "1":
            pytest.fail(f"HYBRIDKV_REQUIRE_REDIS=1 but {reason}")
        pytest.skip(reason)
    return found


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RedisServer:
    """One server process on 127.0.0.1:``port`` with its files in ``workdir``.

    ``args``: more server options (``--requirepass``, TLS: ``--port 0 --tls-port PORT ...``,
    later options win); ``client``: redis-py keywords :meth:`admin` needs to get in.
    """

    def __init__(
        self,
        binary: str,
        workdir: Path,
        args: Sequence[str] = (),
        client: Mapping[str, Any] | None = None,
    ) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.args = tuple(args)
        self.client = dict(client or {})
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server (no RDB, no AOF) and wait until it answers PING."""
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--logfile", str(self.workdir / "server.log"),
            "--daemonize", "no",
            *(arg.replace("{port}", str(self.port)) for arg in self.args),
        ]  # fmt: skip
        self._process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                err = self._process.stderr.read().decode() if self._process.stderr else ""
                raise RuntimeError(f"{self.binary} exited at start: {err}")
            try:
                if self.admin().ping():
                    return
            except redis.exceptions.ConnectionError:
                time.sleep(0.01)
        raise RuntimeError(f"{self.binary} did not answer PING within {timeout_s}s")

    def admin(self) -> redis.Redis:
        """A plain client for the test's own commands (CLIENT PAUSE, DEL, CONFIG...)."""
        return redis.Redis(
            port=self.port, socket_timeout=5, socket_connect_timeout=1, **self.client
        )

    def kill(self) -> None:
        """SIGKILL the server, as a crash would, and reap it."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait()

    def restart(self) -> None:
        """Kill (if running) and start again on the same port, empty."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Terminate the server (SIGKILL after 5 s) and reap it."""
        if self._process is None or self._process.poll() is not None:
            return
        self._process.terminate()
        try:
            self._process.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()


class CuttingProxy:
    """A TCP proxy to the server that can reset a connection in the middle of a reply.

    ``cut_after = n`` makes the next reply from the server pass only its first ``n`` bytes,
    then the client's connection is reset (RST, SO_LINGER 0): the client has read half a
    value when the connection dies. ``cut_after = None`` forwards everything. While
    ``stalled`` is set, replies are swallowed: the server answered, the client never hears
    it, as with a server or network slower than any deadline (independent of the machine's
    load, unlike CLIENT PAUSE's timer).
    """

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.cut_after: int | None = None
        self.stalled = False
        self.cuts = 0
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        """Stop accepting (open connections end when either side closes)."""
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:  # the server is down: the client sees its connection closed
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        try:
            while data := source.recv(65536):
                with self._lock:
                    cut, self.cut_after = (
                        (self.cut_after, None) if replies else (None, self.cut_after)
                    )
                    if cut is not None:
                        self.cuts += 1
                if replies and self.stalled:
                    continue
                if cut is None:
                    sink.sendall(data)
                    continue
                sink.sendall(data[:cut])
                # Linger 0: the close resets. shutdown() first, because the other pump's
                # recv() on this socket would keep it open past close().
                sink.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sink.shutdown(socket.SHUT_RDWR)
                break
        except OSError:
            pass  # a reset or closed socket ends this pump; the lines below end the other
        # Either side gone ends both; shutdown() wakes the other pump's recv() first.
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                end.close()
