"""kvdepotd command line: `kvdepotd serve [options]`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from kvdepotd import config

if TYPE_CHECKING:
    from kvdepot.tls import Tls

DESCRIPTION = """kvdepotd: a KV-cache block manager that runs beside LLM inference engines.

Options come from, in rising precedence: defaults, a TOML file (--config or KVDEPOT_CONFIG),
KVDEPOT_* environment variables (KVDEPOT_HOST_GIB=8, KVDEPOT_LISTEN=a,b), and flags."""
EPILOG = """`kvdepotd serve` runs the daemon with working defaults (gRPC on 127.0.0.1:50061, a 4 GiB host
tier, metrics on http://127.0.0.1:9464/metrics) until SIGTERM or Ctrl-C, which drain it;
`kvdepotd --host-gib 8 ...` (options, no command) serves too. `kvdepotd serve --help` lists
every option."""


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    from kvdepotd import core

    try:
        v = dist_version("kvdepot")
    except PackageNotFoundError:
        v = "unknown"
    return f"kvdepotd {v} (core {'compiled' if core.compiled() else 'plain Python'}, Python {sys.version.split()[0]})"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvdepotd", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the daemon (what options alone, with no command, do too)", description=DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    config.add_arguments(serve)
    check = sub.add_parser("check-config", help="print the effective configuration and exit (2 when it or its tokens file is wrong)")
    config.add_arguments(check)
    health = sub.add_parser("health", help="exit 0 if the daemon at ADDR answers SERVING (gRPC health check)")
    health.add_argument("address", nargs="?", default=config.DEFAULT_LISTEN, help=f"HOST:PORT or unix:PATH (default {config.DEFAULT_LISTEN})")
    health.add_argument("--timeout-s", type=float, default=3.0)
    tls_arguments(health)
    status = sub.add_parser(
        "status", help="show a running daemon's engines, tiers, hit rates, ops in flight and failures (--watch refreshes, --json for scripts)"
    )
    status.add_argument("address", nargs="?", default=config.DEFAULT_LISTEN, help=f"HOST:PORT or unix:PATH (default {config.DEFAULT_LISTEN})")
    status.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS", help="refresh every SECONDS (default 2) until Ctrl-C")
    status.add_argument("--json", action="store_true", help="print the snapshot as JSON (with --watch: one line per refresh)")
    status.add_argument("--token-file", metavar="FILE", default="", help="an admin or metrics token, for a daemon with tokens (admin: also the oldest ops and recent failures)")
    status.add_argument("--timeout-s", type=float, default=5.0)
    tls_arguments(status)
    disk = sub.add_parser("check-disk", help="read every block a disk tier directory holds and check it as start-up would (run it with the daemon stopped); exits 1 when it finds damage")
    disk.add_argument("directory")
    return p


def tls_arguments(p: argparse.ArgumentParser) -> None:
    """For the commands that call a daemon over TCP with TLS."""
    p.add_argument("--tls-ca", metavar="FILE", default="", help="TLS: the CA that signed the daemon's certificate (PEM)")
    p.add_argument("--tls-cert", metavar="FILE", default="", help="TLS: this client's certificate, when the daemon asks for one")
    p.add_argument("--tls-key", metavar="FILE", default="", help="TLS: the key of --tls-cert")


def check_disk(directory: str) -> int:
    import json

    from kvdepotd.storage.disk_dir import verify

    if not os.path.isdir(directory):
        print(f"kvdepotd: {directory} is not a directory", file=sys.stderr)
        return 2
    result = verify(directory)
    print(json.dumps(result, indent=1))
    return 1 if result["problems"] else 0


def check_tokens(path: str) -> int:
    """The tokens file as the daemon would read it (at start or on SIGHUP): check it before a reload."""
    from kvdepotd.auth import AuthError, Tokens

    try:
        tokens = Tokens.load(path)
    except AuthError as e:
        print(f"kvdepotd: {e}", file=sys.stderr)
        return 2
    print(f"# {path}: {len(tokens)} tokens {tokens.summary()}")
    return 0


def health_check(address: str, timeout_s: float, tls: Tls | None = None) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvdepot.tls import channel

    try:
        ch = channel(address, tls, [])
    except ValueError as e:
        print(f"kvdepotd: {e}", file=sys.stderr)
        return 2
    with ch:
        try:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s).status
        except grpc.RpcError as e:
            print(f"kvdepotd at {address}: {e.code().name}", file=sys.stderr)
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(f"kvdepotd at {address}: {name}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # someone finding out what this is: tell them rather than start a daemon
        parser().print_help()
        return 0
    if argv[0] == "--version":
        print(version())
        return 0
    if argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["serve", *argv]
    args = parser().parse_args(argv)
    if args.command == "health":
        from kvdepot.tls import Tls

        return health_check(args.address, args.timeout_s, Tls.of(args.tls_ca, args.tls_cert, args.tls_key))
    if args.command == "check-disk":
        return check_disk(args.directory)
    if args.command == "status":
        from kvdepotd import status

        return status.main(args)
    try:
        cfg = config.load(args)
    except config.ConfigError as e:
        print(f"kvdepotd: {e}", file=sys.stderr)
        return 2
    if args.command == "check-config":
        for name in cfg.__dataclass_fields__:
            print(f"{name} = {getattr(cfg, name)!r}")
        for warning in cfg.warnings():
            print(f"kvdepotd: warning: {warning}", file=sys.stderr)
        return check_tokens(cfg.auth_file) if cfg.auth_file else 0
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if cfg.log_format == "json" else logging.Formatter(TEXT_FORMAT, "%Y-%m-%dT%H:%M:%S"))
    logging.basicConfig(level=cfg.log_level.upper(), handlers=[handler])
    return run(cfg)


TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, for log collectors (--log-format json)."""

    def format(self, record: logging.LogRecord) -> str:
        import json
        from datetime import datetime, timezone

        out = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def taken(cfg: config.DaemonConfig) -> str:
    """Which TCP address another process already listens on, checked before the daemon's imports
    (a second or so) so that a busy port fails at once; "" when none is (the daemon's own binds
    follow and report anything else)."""
    import errno
    import socket

    addresses = [a for a in cfg.listen if not a.startswith("unix:")] + ([cfg.metrics_listen] if cfg.metrics_listen else [])
    for addr in addresses:
        host, _, port = addr.rpartition(":")
        if not port.isdigit() or int(port) == 0:
            continue
        try:
            infos = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except OSError:
            continue
        for family, kind, proto, _, where in infos:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: a TIME_WAIT is not a listener
                try:
                    s.bind(where)
                except OSError as e:
                    if e.errno == errno.EADDRINUSE:
                        return addr
    return ""


def run(cfg: config.DaemonConfig) -> int:
    busy = taken(cfg)
    if busy:
        logging.getLogger("kvdepotd").error("cannot start: another process is listening on %s", busy)
        return 1
    raise_fd_limit()
    from kvdepotd.server import Daemon, StartupError

    try:
        import uvloop

        uvloop.run(Daemon(cfg).run())
    except StartupError as e:
        logging.getLogger("kvdepotd").error("cannot start: %s", e)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def raise_fd_limit() -> None:
    """Descriptors up to the hard limit: every client connection (gRPC, lane, handoff) holds one, and
    running out would stop the daemon opening disk files or accepting engines for everyone."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (OSError, ValueError) as e:
            logging.getLogger("kvdepotd").warning("cannot raise the descriptor limit from %d to %d: %s", soft, want, e)


if __name__ == "__main__":
    sys.exit(main())
