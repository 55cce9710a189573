"""A throwaway Redis/Valkey Cluster for the remote tests: 3 primaries and 3 replicas of
``redis-server --cluster-enabled yes`` on 127.0.0.1, free ports, no persistence.

:class:`LocalCluster` starts the six servers in a temporary directory, joins them with
``redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes`` and waits until every node
says ``cluster_state:ok`` and every replica's link to its primary is up (a replica that never
synced refuses to fail over). The node timeout is short (1 s by default) so that a killed
primary's replica takes over within a few seconds. A test may kill a primary and wait for the
failover, or add a shard (a primary and its replica) and move slots to it while clients run.

With ``password``, every node runs with ``--requirepass`` and ``--masterauth`` (replicas sync
with it) and the fixture's own clients and ``redis-cli`` send it. With ``tls`` (a
``_certs.Certs``), every node speaks only TLS, to clients, to its replicas and on the cluster
bus (``--port 0 --tls-port``, ``--tls-cluster yes``, ``--tls-replication yes``), no client
certificate asked.

Each node's cluster bus port is chosen free too (``--cluster-port``), not the port + 10000
that an OS-chosen port could push past 65535.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from _redis_server import found_or_skip, free_port

CLIS = ("redis-cli", "valkey-cli")


def find_cli() -> str | None:
    """The first cluster command line on PATH (``redis-cli``, else ``valkey-cli``), or None."""
    for name in CLIS:
        path = shutil.which(name)
        if path:
            return path
    return None


def cli_or_skip() -> str:
    """The cluster command line; skip without one unless HYBRIDKV_REQUIRE_REDIS=1 (then fail)."""
    reason = f"none of {', '.join(CLIS)} is on PATH (apt-get install redis-tools)"
    return found_or_skip(find_cli(), reason)


def _tls_kwargs(ca: str | None) -> dict[str, Any]:
    return {} if ca is None else {"ssl": True, "ssl_ca_certs": ca}


@dataclass(slots=True)
class Node:
    """One cluster node's process, ports and directory."""

    port: int
    bus: int
    workdir: Path
    process: subprocess.Popen[bytes] | None = None
    stopped: bool = False  # SIGSTOPped by the test
    password: str | None = None
    ca: str | None = None  # TLS: the CA file that signed the node's certificate

    def admin(self) -> redis.Redis:
        """A plain client of this node alone (CLUSTER, INFO, DBSIZE...)."""
        return redis.Redis(
            host="127.0.0.1",  # the name the TLS certificate carries
            port=self.port,
            password=self.password,
            socket_timeout=5,
            socket_connect_timeout=1,
            **_tls_kwargs(self.ca),
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def info(self, section: str) -> dict[str, object]:
        """INFO ``section``, parsed by redis-py."""
        admin = self.admin()
        try:
            return dict(admin.info(section))
        finally:
            admin.close()


@dataclass(slots=True)
class LocalCluster:
    """``primaries`` shards of 1 primary + ``replicas`` replicas each, started by :meth:`start`."""

    binary: str
    cli: str
    workdir: Path
    primaries: int = 3
    replicas: int = 1
    node_timeout_ms: int = 1000
    password: str | None = None
    tls: Any = None  # a _certs.Certs: every node TLS only
    nodes: list[Node] = field(default_factory=list)

    # --- life cycle ---

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the nodes, create the cluster, wait until it serves every slot."""
        count = self.primaries * (1 + self.replicas)
        started = [self._start_node() for _ in range(count)]
        self._cli(
            "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in started),
            "--cluster-replicas", str(self.replicas), "--cluster-yes",
        )  # fmt: skip
        self.wait_ready(timeout_s)

    def stop(self) -> None:
        """Stop every node (SIGCONT first where stopped; SIGKILL after 5 s) and reap it."""
        running = [n for n in self.nodes if n.process is not None and n.alive()]
        for node in running:
            assert node.process is not None
            if node.stopped:
                node.process.send_signal(signal.SIGCONT)
            node.process.terminate()  # all at once: each saves nothing, exits at once
        for node in running:
            assert node.process is not None
            try:
                node.process.wait(5)
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait()

    # --- what the clients see ---

    @property
    def seeds(self) -> tuple[tuple[str, int], ...]:
        """Every node of the cluster as it was started: (host, port)."""
        return tuple(("127.0.0.1", node.port) for node in self.nodes)

    @property
    def url(self) -> str:
        """The connector's ``remote_url`` for this cluster."""
        return "redis+cluster://" + ",".join(f"{h}:{p}" for h, p in self.seeds)

    def client(self) -> redis.RedisCluster:
        """A redis-py cluster client for the test's own commands."""
        return redis.RedisCluster(
            startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in self.seeds if self._up(p)],
            password=self.password,
            socket_timeout=5,
            socket_connect_timeout=1,
            **_tls_kwargs(self._ca),
        )

    @property
    def _ca(self) -> str | None:
        return None if self.tls is None else str(self.tls.ca)

    def topology(self) -> dict[int, tuple[str, int | None, int]]:
        """Each live node's (role, its primary's port for a replica, slots it owns), as a
        live node sees them."""
        admin = self._live()[0].admin()
        try:
            rows = admin.execute_command("CLUSTER NODES")  # redis-py parses it: a dict
        finally:
            admin.close()
        ports = {row["node_id"]: int(name.rsplit(":", 1)[1]) for name, row in rows.items()}
        found: dict[int, tuple[str, int | None, int]] = {}
        for name, row in rows.items():
            flags = row["flags"].split(",")
            if "fail" in flags or "noaddr" in flags:
                continue
            role = "primary" if "master" in flags else "replica"
            slots = sum(int(end) - int(start) + 1 for start, end in row["slots"])
            found[int(name.rsplit(":", 1)[1])] = (role, ports.get(row["master_id"]), slots)
        return found

    def primary_ports(self) -> list[int]:
        """Live primaries that own slots."""
        return [p for p, (role, _, slots) in self.topology().items() if role == "primary" and slots]

    def owner(self, key: bytes) -> int:
        """The port of the primary that owns ``key``'s slot."""
        admin = self._live()[0].admin()
        try:
            slot = int(admin.execute_command("CLUSTER KEYSLOT", key))
            for start, end, primary, *_ in admin.execute_command("CLUSTER SLOTS"):
                if int(start) <= slot <= int(end):
                    return int(primary[1])
        finally:
            admin.close()
        raise AssertionError(f"slot of {key!r} is not covered")

    def keys_per_primary(self) -> dict[int, int]:
        """DBSIZE of each live primary that owns slots."""
        found = {}
        for port in self.primary_ports():
            admin = self.node(port).admin()
            found[port] = int(admin.dbsize())
            admin.close()
        return found

    def node(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    # --- faults and growth ---

    def wait_ready(self, timeout_s: float = 30.0) -> float:
        """Wait until every live node says ``cluster_state:ok``, agrees on who owns each slot,
        and every replica's link is up; the seconds waited."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            with contextlib.suppress(redis.exceptions.RedisError, IndexError):
                if self._ready():
                    return time.monotonic() - started
            time.sleep(0.05)
        raise RuntimeError(f"the cluster was not ready within {timeout_s}s: {self._states()}")

    def wait_replicated(self, timeout_s: float = 10.0) -> None:
        """Wait until every replica has every write its primary took."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            lag = 0
            for port, (role, primary, _) in self.topology().items():
                if role == "replica" and primary is not None:
                    ahead = self.node(primary).info("replication")["master_repl_offset"]
                    lag += ahead != self.node(port).info("replication").get("slave_repl_offset")
            if not lag:
                return
            time.sleep(0.05)
        raise RuntimeError(f"replicas still behind after {timeout_s}s")

    def kill(self, port: int) -> None:
        """SIGKILL one node, as a crash would, and reap it."""
        node = self.node(port)
        if node.process is not None and node.alive():
            node.process.send_signal(signal.SIGKILL)
            node.process.wait()

    def pause(self, port: int, paused: bool = True) -> None:
        """SIGSTOP (or SIGCONT) one node: it holds its connections and answers nothing."""
        node = self.node(port)
        assert node.process is not None
        node.process.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)
        node.stopped = paused

    def wait_failover(self, dead: int, timeout_s: float = 30.0) -> int:
        """Wait until a replica of the killed primary ``dead`` owns its slots and the cluster
        is ready again; that replica's port."""
        replicas = [p for p, (role, primary, _) in self.topology().items() if primary == dead]
        self.wait_ready(timeout_s)
        promoted = [p for p in replicas if self.topology()[p][0] == "primary"]
        if not promoted:
            raise RuntimeError(f"no replica of {dead} was promoted: {self.topology()}")
        return promoted[0]

    def add_shard(self) -> int:
        """Start a new primary and its replica and join them (no slots yet); the primary's port."""
        seed = f"127.0.0.1:{self.primary_ports()[0]}"
        primary = self._start_node()  # each joins before the next starts (_wait_known)
        self._cli("--cluster", "add-node", f"127.0.0.1:{primary.port}", seed)
        self._wait_known(primary.port)
        primary_id = self._node_id(primary.port)
        replica = self._start_node()
        self._cli(
            "--cluster", "add-node", f"127.0.0.1:{replica.port}", seed,
            "--cluster-slave", "--cluster-master-id", primary_id,
        )  # fmt: skip
        self._wait_known(replica.port)
        self.wait_ready()
        return primary.port

    def reshard(self, to_port: int, slots: int) -> subprocess.Popen[bytes]:
        """Start moving ``slots`` slots from every primary to ``to_port`` (redis-cli, keys
        migrated slot by slot while clients run); the running command (``wait()`` on it, its
        output in ``reshard-PORT.log`` of the workdir)."""
        args = [
            self.cli, *self._auth(), "--cluster", "reshard", f"127.0.0.1:{to_port}",
            "--cluster-from", "all", "--cluster-to", self._node_id(to_port),
            "--cluster-slots", str(slots), "--cluster-yes",
        ]  # fmt: skip
        # Its output goes to a file: a line per slot would fill a pipe nobody reads.
        with (self.workdir / f"reshard-{to_port}.log").open("ab") as log:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    # --- internals ---

    def _start_node(self, timeout_s: float = 10.0) -> Node:
        port, bus = free_port(), free_port()
        while bus == port:
            bus = free_port()
        workdir = self.workdir / f"node-{port}"
        workdir.mkdir()
        node = Node(port, bus, workdir, password=self.password, ca=self._ca)
        args = [
            self.binary,
            "--port", str(port),
            "--cluster-port", str(bus),
            "--bind", "127.0.0.1",
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(workdir / "nodes.conf"),
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--repl-diskless-sync-delay", "0",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(workdir),
            "--logfile", str(workdir / "server.log"),
            "--daemonize", "no",
        ]  # fmt: skip
        if self.password is not None:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        if self.tls is not None:
            args[args.index("--port") + 1] = "0"
            args += [
                "--tls-port", str(port), "--tls-cluster", "yes", "--tls-replication", "yes",
                "--tls-cert-file", str(self.tls.server_cert),
                "--tls-key-file", str(self.tls.server_key),
                "--tls-ca-cert-file", str(self.tls.ca), "--tls-auth-clients", "no",
            ]  # fmt: skip
        node.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.nodes.append(node)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not node.alive():
                err = node.process.stderr.read().decode() if node.process.stderr else ""
                raise RuntimeError(f"{self.binary} exited at start: {err}")
            with contextlib.suppress(redis.exceptions.ConnectionError):
                admin = node.admin()
                answered = admin.ping()
                admin.close()
                if answered:
                    return node
            time.sleep(0.01)
        raise RuntimeError(f"{self.binary} on {port} did not answer PING within {timeout_s}s")

    def _cli(self, *args: str) -> str:
        done = subprocess.run(
            [self.cli, *self._auth(), *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0 or "[ERR]" in done.stdout:
            raise RuntimeError(f"{self.cli} {' '.join(args)} failed: {done.stdout}{done.stderr}")
        return done.stdout

    def _auth(self) -> list[str]:
        """``redis-cli``'s password and TLS options (none without either)."""
        auth = [] if self.password is None else ["-a", self.password, "--no-auth-warning"]
        return auth if self.tls is None else [*auth, "--tls", "--cacert", str(self.tls.ca)]

    def _node_id(self, port: int) -> str:
        admin = self.node(port).admin()
        try:
            return bytes(admin.execute_command("CLUSTER MYID")).decode()
        finally:
            admin.close()

    def _up(self, port: int) -> bool:
        node = self.node(port)
        return node.alive() and not node.stopped

    def _live(self) -> list[Node]:
        return [n for n in self.nodes if n.alive() and not n.stopped]

    def _ready(self) -> bool:
        views = set()
        for node in self._live():
            admin = node.admin()
            try:
                state = admin.execute_command("CLUSTER INFO")["cluster_state"]
                slots = admin.execute_command("CLUSTER SLOTS")
            finally:
                admin.close()
            if state != "ok":
                return False
            views.add(tuple(sorted((int(s), int(e), int(p[1])) for s, e, p, *_ in slots)))
            replication = node.info("replication")
            if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                return False
        return len(views) == 1

    def _wait_known(self, port: int, timeout_s: float = 30.0) -> None:
        """Wait until every live node lists ``port`` in CLUSTER NODES (gossip reached it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            unaware = []
            for node in self._live():
                admin = node.admin()
                rows = admin.execute_command("CLUSTER NODES")
                admin.close()
                if f"127.0.0.1:{port}" not in rows:
                    unaware.append((node.port, sorted(rows)))
            if not unaware:
                return
            time.sleep(0.05)
        raise RuntimeError(f"node {port} did not join within {timeout_s}s: {unaware}")

    def _states(self) -> dict[int, str]:
        found = {}
        for node in self.nodes:
            try:
                found[node.port] = str(node.info("replication").get("role", "?"))
            except redis.exceptions.RedisError as error:
                found[node.port] = f"{type(error).__name__}"
        return found
