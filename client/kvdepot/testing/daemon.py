"""Start a real kvdepotd process for tests and benchmarks (free TCP port + Unix socket)."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 10), ("grpc.min_reconnect_backoff_ms", 10), ("grpc.max_reconnect_backoff_ms", 20)]


_GIVEN: set[int] = set()  # ports free_port handed out in this process


def free_port() -> int:
    """A port nothing listens on now, never one this process was given before: two calls in a row
    may get the same port from the kernel (a test's metrics port and its daemon's gRPC port once
    did, and the daemon could not start)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


_FOLDERS: list[str] = []  # every daemon's temporary folder (socket, log), removed when this process exits


@atexit.register
def _remove_folders() -> None:
    for folder in _FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class DaemonProcess:
    """A kvdepotd child process. `tcp` and `unix` are addresses a client can use. Its temporary
    folder (socket, log) stays until this process exits: a test may read the log after a stop, and
    a daemon started again on the same `unix` address uses the same folder."""

    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    tcp: str = ""
    unix: str = ""
    proc: subprocess.Popen[bytes] | None = None
    log_path: str = ""

    def start(self, timeout_s: float = 20.0) -> DaemonProcess:
        """Starts the daemon and waits until it serves. A TCP port this picked itself that another
        process took in the meantime is picked again (twice at most)."""
        picked = not self.tcp
        for attempt in range(3):
            try:
                return self._start(timeout_s)
            except RuntimeError as e:
                if not picked or attempt == 2 or "cannot listen on" not in str(e):
                    raise
                self.tcp = ""
        raise AssertionError("unreachable")

    def _start(self, timeout_s: float) -> DaemonProcess:
        tmp = tempfile.mkdtemp(prefix="kvdepotd-")
        _FOLDERS.append(tmp)
        self.tcp = self.tcp or f"127.0.0.1:{free_port()}"
        self.unix = self.unix or f"unix:{tmp}/kvdepotd.sock"
        self.log_path = os.path.join(tmp, "kvdepotd.log")
        sized = [] if any(a.startswith("--host-gib") for a in self.args) else ["--host-gib", "0.25"]  # tests need little
        cmd = [sys.executable, "-m", "kvdepotd", "serve", "--listen", self.tcp, "--listen", self.unix, "--metrics-listen", "", *sized, *self.args]
        env = {**os.environ, **self.env}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.wait_serving(timeout_s)
        return self

    def wait_serving(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        # plaintext whether or not TCP has TLS; retried every 10 ms, not at gRPC's default backoff (1 s)
        with grpc.insecure_channel(self.unix, options=FAST_RECONNECT) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvdepotd exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > end:
                    raise TimeoutError(f"kvdepotd did not serve within {timeout_s} s:\n{self.log()}")
                time.sleep(0.01)

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
