"""kvdepotd command line: `kvdepotd serve [options]`."""

from __future__ import annotations

import argparse
import logging
import sys

from kvdepotd import config

DESCRIPTION = """kvdepotd: a KV-cache block manager that runs beside LLM inference engines.

Options come from, in rising precedence: defaults, a TOML file (--config or KVDEPOT_CONFIG),
KVDEPOT_* environment variables (KVDEPOT_HOST_GIB=8, KVDEPOT_LISTEN=a,b), and flags."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvdepotd", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the daemon (the default command)", description=DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    config.add_arguments(serve)
    check = sub.add_parser("check-config", help="print the effective configuration and exit")
    config.add_arguments(check)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["serve", *argv]
    args = parser().parse_args(argv)
    try:
        cfg = config.load(args)
    except config.ConfigError as e:
        print(f"kvdepotd: {e}", file=sys.stderr)
        return 2
    if args.command == "check-config":
        for name in cfg.__dataclass_fields__:
            print(f"{name} = {getattr(cfg, name)!r}")
        return 0
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
        stream=sys.stderr,
    )
    return run(cfg)


def run(cfg: config.DaemonConfig) -> int:
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


if __name__ == "__main__":
    sys.exit(main())
