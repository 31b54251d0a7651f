"""`kvdepotd status ADDRESS`: what an operator asks a running daemon first, in a terminal.

    fetch(address, token, tls, timeout_s) -> dict   one snapshot over gRPC (health, GetStats,
                                                    ListEngines); raises StatusError
    snapshot(health, stats, engines, now) -> dict   the same from the messages (plain, for --json)
    render(snap, prev) -> str                       the text view; with the previous snapshot the
                                                    hit rates and failures are also over the interval
    main(args) -> int                               one view, `--watch` refreshing, or `--json`

The figures come from the daemon's own GetStats (an admin or metrics token where the daemon has
tokens; the oldest ops and recent failures need an admin token) and ListEngines.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

# Counters that say something went wrong, in the order the view lists them.
FAILURE_COUNTERS = (
    "load_failed_blocks", "store_failed_blocks", "checksum_failures", "disk_checksum_failures", "remote_checksum_failures",
    "ops_expired", "leases_expired", "pins_expired", "disk_write_failed_blocks", "disk_read_failed_blocks", "disk_full",
    "remote_write_failed_blocks", "remote_read_failed_blocks", "remote_dropped_store_down_blocks", "remote_dropped_queue_full_blocks",
    "store_blocks_tier_full", "disk_write_missed_blocks", "lookups_unmapped", "store_blocks_unmapped",
)
TIER_HITS = {"host": None, "disk": "lookup_disk_hit_tokens", "remote": "lookup_remote_hit_tokens"}


class StatusError(Exception):
    pass


def fetch(address: str, token: str = "", tls: Any = None, timeout_s: float = 5.0) -> dict[str, Any]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvdepot.tls import channel
    from kvdepot.v1 import kvdepot_pb2 as pb
    from kvdepot.v1 import kvdepot_pb2_grpc as pb_grpc

    try:
        ch = channel(address, tls, [], token=token)
    except ValueError as e:
        raise StatusError(f"kvdepotd: {e}") from None
    with ch:
        try:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s).status
            stub = pb_grpc.BlockManagerStub(ch)
            stats = stub.GetStats(pb.GetStatsRequest(), timeout=timeout_s)
            try:
                engines = stub.ListEngines(pb.ListEnginesRequest(), timeout=timeout_s).engines
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.PERMISSION_DENIED:
                    raise
                engines = None  # a metrics token: the figures, not who is registered
        except grpc.RpcError as e:
            raise StatusError(f"kvdepotd at {address}: {e.code().name}: {e.details()}") from None
    snap = snapshot(health_pb2.HealthCheckResponse.ServingStatus.Name(health), stats, engines, time.time())
    snap["address"] = address
    return snap


def snapshot(health: str, stats: Any, engines: Any | None, now: float) -> dict[str, Any]:
    """`engines` None: the caller may not list them (a metrics token)."""
    from kvdepot.v1 import kvdepot_pb2 as pb

    c = dict(stats.counters)
    tiers: dict[str, dict[str, Any]] = {}
    sizes = {"host": stats.host_bytes, "disk": stats.disk_bytes}
    for p in stats.pools:
        name = {pb.TIER_HOST: "host", pb.TIER_DISK: "disk"}.get(p.tier, str(p.tier))
        t = tiers.setdefault(name, _empty_tier(sizes.get(name, 0)))
        t["used_bytes"] += p.used_blocks * p.block_bytes
        t["used_blocks"] += p.used_blocks
        t["pinned_blocks"] += p.pinned_blocks
        t["in_flight_blocks"] += p.in_flight_blocks
        t["layout_classes"] += 1
    for name, size in sizes.items():
        if size:
            tiers.setdefault(name, _empty_tier(size))
    if stats.remote:
        tiers["remote"] = {"address": stats.remote, "up": stats.remote_up, "queue_blocks": stats.remote_queue_blocks, "jobs": stats.remote_jobs}
    hits = c.get("lookup_hit_tokens", 0)
    by_tier = {"disk": c.get("lookup_disk_hit_tokens", 0), "remote": c.get("lookup_remote_hit_tokens", 0)}
    by_tier["host"] = hits - by_tier["disk"] - by_tier["remote"]
    for name, t in tiers.items():
        t["hit_tokens"] = by_tier.get(name, 0)
    return {
        "time": now,
        "health": health,
        "uptime_s": round(stats.uptime_s, 1),
        "engines": [
            {
                "engine_id": e.engine_id, "name": e.engine_name, "model": e.model, "namespace": e.namespace,
                "ranks_attached": len(e.attached_ranks), "world_size": e.layout.world_size or 1, "slots": e.slots,
                "ranks_mapped": len(e.mapped_ranks) if e.layout.kind != pb.KV_LAYOUT_KIND_UNSPECIFIED else None,
                "lease_s": round(max(0.0, e.lease_expires_unix_ms / 1000 - now), 1), "last_step": e.last_step,
            }
            for e in engines
        ] if engines is not None else None,
        "slots": stats.slots,
        "tiers": tiers,
        "lookups": {"lookups": c.get("lookups", 0), "asked_tokens": c.get("lookup_asked_tokens", 0), "hit_tokens": hits},
        "ops": {
            "in_flight": stats.ops_in_flight,
            "oldest_age_s": stats.oldest_op_age_ms / 1000,
            "oldest": [
                {"op_id": o.op_id, "kind": pb.OpKind.Name(o.kind).removeprefix("OP_KIND_").lower(), "engine_id": o.engine_id,
                 "request_id": o.request_id, "blocks": o.blocks, "age_s": o.age_ms / 1000, "state": o.state}
                for o in stats.oldest_ops
            ],
        },
        "failures": {
            "counters": {k: c.get(k, 0) for k in FAILURE_COUNTERS},
            "recent": [{"time": f.unix_s, "kind": f.kind, "engine_id": f.engine_id, "message": f.message} for f in stats.recent_failures],
        },
        "counters": c,
    }


def _empty_tier(capacity_bytes: int) -> dict[str, int]:
    return {"capacity_bytes": capacity_bytes, "used_bytes": 0, "used_blocks": 0, "pinned_blocks": 0, "in_flight_blocks": 0, "layout_classes": 0}


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""  # unreachable


def _rate(part: float, whole: float) -> str:
    return f"{100 * part / whole:5.1f}%" if whole > 0 else "    -"


def _age(s: float) -> str:
    return f"{s:.1f}s" if s < 120 else f"{s / 60:.0f}m"


def render(snap: dict[str, Any], prev: dict[str, Any] | None = None) -> str:
    """The view, a few dozen lines. With `prev` (the last refresh), the interval's hit rates and
    new failures stand beside the totals since start."""
    out: list[str] = []
    stamp = time.strftime("%H:%M:%S", time.localtime(snap["time"]))
    out.append(f"kvdepotd {snap.get('address', '')}  {snap['health']}  up {_age(snap['uptime_s'])}  {stamp}")
    interval = prev is not None
    lk, plk = snap["lookups"], (prev or {}).get("lookups", {})
    asked = lk["asked_tokens"]
    d_asked = asked - plk.get("asked_tokens", 0)
    head = f"{'tier':<7} {'used':>10} {'of':>10} {'use':>6} {'blocks':>8} {'pinned':>7} {'storing':>8} {'hit rate':>9}"
    out.append("")
    out.append(head + ("  last interval" if interval else ""))
    for name in ("host", "disk", "remote"):
        t = snap["tiers"].get(name)
        if t is None:
            continue
        hit = _rate(t["hit_tokens"], asked)
        recent = ""
        if interval:
            pt = prev["tiers"].get(name, {}) if prev else {}
            recent = "  " + _rate(t["hit_tokens"] - pt.get("hit_tokens", 0), d_asked)
        if name == "remote":
            state = "up" if t["up"] else "DOWN"
            left = f"{name:<7} {state:>10}   write queue {t['queue_blocks']} blocks, {t['jobs']} jobs"
            out.append(f"{left:<63}{hit:>9}{recent}  {t['address']}")
            continue
        use = _rate(t["used_bytes"], t["capacity_bytes"])
        out.append(
            f"{name:<7} {_bytes(t['used_bytes']):>10} {_bytes(t['capacity_bytes']):>10} {use:>6} {t['used_blocks']:>8} {t['pinned_blocks']:>7} {t['in_flight_blocks']:>8} {hit:>9}{recent}"
        )
    total = _rate(lk["hit_tokens"], asked)
    recent_total = "  " + _rate(lk["hit_tokens"] - plk.get("hit_tokens", 0), d_asked) if interval else ""
    left = f"{'all':<7} {lk['lookups']:>10} lookups, {asked} tokens asked, {lk['hit_tokens']} served"
    out.append(f"{left:<63}{total:>9}{recent_total}")

    out.append("")
    engines = snap["engines"]
    if engines is None:
        out.append(f"engines: not shown to this token (an admin token lists them), request slots {snap['slots']}")
    else:
        out.append(f"engines {len(engines)}, request slots {snap['slots']}")
    if engines:
        out.append(f"  {'engine':<22} {'name':<16} {'namespace':<12} {'ranks':>5} {'slots':>6} {'lease':>7} {'step':>8}  model")
        for e in engines:
            ranks = f"{e['ranks_attached']}/{e['world_size']}"
            lease = _age(e["lease_s"])
            waiting = e.get("ranks_mapped") is not None and e["ranks_mapped"] < e["world_size"]
            note = f"  [memory of {e['ranks_mapped']}/{e['world_size']} ranks mapped: no hits, no stores]" if waiting else ""
            out.append(f"  {e['engine_id'][:22]:<22} {e['name'][:16]:<16} {e['namespace'][:12]:<12} {ranks:>5} {e['slots']:>6} {lease:>7} {e['last_step']:>8}  {e['model']}{note}")

    ops = snap["ops"]
    out.append("")
    out.append(f"ops in flight {ops['in_flight']}" + (f", oldest {_age(ops['oldest_age_s'])}" if ops["in_flight"] else ""))
    for o in ops["oldest"][:5]:
        out.append(f"  op {o['op_id']:<8} {o['kind']:<5} {o['blocks']:>4} blocks  {_age(o['age_s']):>6}  {o['state']:<15} {o['engine_id'][:22]} {o['request_id'][:30]}")

    out.append("")
    counters = snap["failures"]["counters"]
    pcount = (prev or {}).get("failures", {}).get("counters", {})
    moved = [(k, v, v - pcount.get(k, 0)) for k, v in counters.items() if v]
    if not moved:
        out.append("failures: none since start")
    else:
        out.append("failures since start" + (" (+ in the last interval)" if interval else "") + ":")
        for k, v, d in moved:
            out.append(f"  {k:<34} {v:>10}" + (f"  +{d}" if interval and d > 0 else ""))
    recent = snap["failures"]["recent"]
    if recent:
        out.append("recent failures (newest last):")
        for f in recent[-6:]:
            when = time.strftime("%H:%M:%S", time.localtime(f["time"]))
            who = f" {f['engine_id']}" if f["engine_id"] else ""
            out.append(f"  {when} {f['kind']:<13}{who} {f['message']}"[:160])
    return "\n".join(out) + "\n"


def main(args: Any) -> int:
    from kvdepot.auth import read_token
    from kvdepot.tls import Tls, channel

    if args.watch is not None and args.watch < 0.1 or args.timeout_s <= 0:
        print("kvdepotd: --watch takes at least 0.1 seconds and --timeout-s more than 0", file=sys.stderr)
        return 2
    try:
        token = read_token(args.token_file) if args.token_file else ""
    except ValueError as e:
        print(f"kvdepotd: {e}", file=sys.stderr)
        return 2
    tls = Tls.of(args.tls_ca, args.tls_cert, args.tls_key)
    try:  # an address or TLS file that cannot work is a usage error, not a daemon to wait for
        channel(args.address, tls, []).close()
    except ValueError as e:
        print(f"kvdepotd: {e}", file=sys.stderr)
        return 2
    if args.watch is None:
        try:
            snap = fetch(args.address, token, tls, args.timeout_s)
        except StatusError as e:
            print(e, file=sys.stderr)
            return 1
        sys.stdout.write(json.dumps(snap, indent=1) + "\n" if args.json else render(snap))
        return 0
    prev: dict[str, Any] | None = None
    try:
        while True:
            try:
                now: dict[str, Any] | None = fetch(args.address, token, tls, args.timeout_s)
            except StatusError as e:
                text = f"{e}\n(retrying every {args.watch:g}s; Ctrl-C quits)\n"
                now = None
            else:
                assert now is not None
                if prev is not None and now["uptime_s"] < prev["uptime_s"]:
                    prev = None  # the daemon restarted: its counters started again
                text = json.dumps(now) + "\n" if args.json else render(now, prev)
            if args.json:
                (sys.stdout if now is not None else sys.stderr).write(text)  # stdout stays one JSON object a line
            else:
                sys.stdout.write("\x1b[H\x1b[2J" + text + f"\nrefreshing every {args.watch:g}s; Ctrl-C quits\n")
            sys.stdout.flush()
            prev = now or prev
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
