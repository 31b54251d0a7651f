"""Control-plane benchmark against the real daemon process over loopback.

Prints one JSON line:
  step256_p50_ms / step256_p99_ms   a Step carrying 256 decode updates (client build + RPC + daemon + parse)
  lookup128k_ms                      Lookup of a 131072-token prompt the host tier holds (full hit, worst case)
  lookup128k_miss_ms                 the same prompt when nothing matches (encoding + transport of 512 KiB)
  empty_step_p50_ms                  a Step carrying nothing: the round-trip floor of this machine
                                     (on the daemon's lane, as the client sends; *_session_*: on the
                                     gRPC Session stream; *_unary_*: each Step its own gRPC call)
  step256_sparse_*                   the same 256 decoding requests as a connector sends them: an update
                                     only when a request appends or completes a block (engine-side cost
                                     per step, including the steps that need no round trip)
Targets (docs/design.md): p50 <= 1 ms, p99 <= 3 ms, lookup <= 10 ms.

    python bench/control_plane.py [--steps 2000] [--address HOST:PORT [--token-file F]] [--auth]
    (no --address: starts a daemon; --auth: that daemon asks for tokens and every call carries one)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
import urllib.request

from kvdepot import DepotClient, KvLayout, StepBatch, StepResult, read_token
from kvdepot.messages import OpCompleted
from kvdepot.testing import DaemonProcess, free_port
from kvdepot.v1 import kvdepot_pb2 as pb

LAYOUT = KvLayout(num_layers=2, num_kv_heads=8, head_size=128, dtype="float16", block_size=16)
BATCH = 256


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def worker_main(address: str, token: str, engine_key: str, steps: mp.Queue, acks: mp.Queue) -> None:
    """The engine's worker process: joins the scheduler's engine by its key, as an engine's workers
    do, reports each step's forward done and waits (up to 5 ms, the least a real forward of 256
    requests takes) for the daemon to complete that step's stores, so the next Step meets a daemon
    that is not still busy with this one, as it would behind a real forward."""
    c = DepotClient(address, strict=True, token=token)
    c.register_engine("bench-model", LAYOUT, engine_key=engine_key)
    w = c.worker(0)
    w.attached.wait(10)
    acks.put(-1)  # attached
    early: set[int] = set()  # completions that came in while the worker waited on an earlier step
    while (item := steps.get()) is not None:
        s, stores = item
        w.forward_done(s)
        pending = set(stores) - early
        early -= set(stores)
        seen = 0

        def done(evs: list[object]) -> bool:
            nonlocal seen
            for ev in evs[seen:]:
                if isinstance(ev, OpCompleted):
                    (pending.discard if ev.op_id in pending else early.add)(ev.op_id)
            seen = len(evs)
            return not pending

        w.wait(done, 0.005)
        acks.put(s)
    c.close()


def bench_steps(c: DepotClient, token: str, steps: int, dense_only: bool = False, metrics_port: int = 0) -> dict[str, float]:
    bs = LAYOUT.block_size
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    acks: mp.Queue = ctx.Queue()
    assert c._reg is not None and c._reg.req.engine_key, "the scheduler registers with an engine_key for its worker to join"
    proc = ctx.Process(target=worker_main, args=(c.address, token, c._reg.req.engine_key, q, acks))
    proc.start()
    acks.get(timeout=30)

    class W:  # the step goes to the worker process, as an engine's scheduler hands it to its workers
        @staticmethod
        def forward_done(res: StepResult) -> None:
            q.put((res.step, [op.op_id for op in res.ops if op.kind == "store"]))

        @staticmethod
        def poll() -> None:
            acks.get(timeout=10)  # the "forward" of this step is over

    w = W()
    rng = random.Random(0)
    reqs = []
    admit = StepBatch()
    next_block = 0
    for i in range(BATCH):
        n = rng.randrange(64, 200)  # varied lengths so blocks complete on different steps
        toks = [rng.randrange(50_000) for _ in range(n)]
        nb = -(-(n + 1) // bs)
        table = list(range(next_block, next_block + nb))
        next_block += nb
        admit.new(f"r{i}", toks, table, computed=0, scheduled=n)
        reqs.append({"rid": f"r{i}", "n": n, "blocks": nb})
    w.forward_done(c.step(admit))
    times: list[float] = []
    daemon_before = daemon_totals(metrics_port, "Step") if metrics_port else (0.0, 0.0)
    rids = [r["rid"] for r in reqs]
    ones = [1] * BATCH
    for s in range(steps + 50):
        # What the engine's scheduler hands the connector (vLLM's CachedRequestData is columnar).
        computed, nblk, blocks = [], [], []
        for r in reqs:
            n = r["n"]
            computed.append(n)
            if n + 1 > r["blocks"] * bs:
                blocks.append(next_block)
                next_block += 1
                r["blocks"] += 1
                nblk.append(1)
            else:
                nblk.append(0)
            r["n"] = n + 1
        sampled = [rng.randrange(50_000) for _ in range(BATCH)]
        t0 = time.perf_counter()  # from here on: the connector's and the daemon's cost
        b = StepBatch()
        b.cached_columns(rids, computed, ones, ones, sampled, nblk, blocks)
        res = c.step(b)
        dt = time.perf_counter() - t0
        assert not res.degraded, "step degraded: the daemon did not answer in time"
        w.forward_done(res)
        if s >= 50:  # warm-up
            times.append(dt * 1000)
        w.poll()
    daemon_after = daemon_totals(metrics_port, "Step") if metrics_port else daemon_before
    daemon_ms = 1000 * (daemon_after[0] - daemon_before[0]) / max(daemon_after[1] - daemon_before[1], 1)
    if dense_only:
        q.put(None)
        proc.join(10)
        return {"step256_p50_ms": round(statistics.median(times), 3), "step256_p99_ms": round(pct(times, 0.99), 3)}
    # The same batch as a connector sends it: a request's update goes out only when it appends a
    # block or completes one (its tokens ride along); a step with nothing to say costs no round trip.
    sparse: list[float] = []
    for r in reqs:
        r["pending"] = []
        r["sent_end"] = r["n"]
    for s in range(steps):
        b = StepBatch()
        for r in reqs:
            n = r["n"]
            r["pending"].append(rng.randrange(50_000))
            new_blocks = []
            if n + 1 > r["blocks"] * bs:
                new_blocks = [next_block]
                next_block += 1
                r["blocks"] += 1
            r["n"] = n + 1
            if new_blocks or (n + 1) // bs > r["sent_end"] // bs:
                b.cached(r["rid"], r["pending"], new_blocks, computed=n, scheduled=1)
                r["pending"], r["sent_end"] = [], n + 1
        t0 = time.perf_counter()  # the batch is what the connector built; from here on, the wire and the daemon
        res = c.step(b)
        sparse.append((time.perf_counter() - t0) * 1000)
        assert not res.degraded
        w.forward_done(res)
        w.poll()
    q.put(None)
    proc.join(10)
    # The floor: a Step that carries nothing, same client and daemon, on each transport (the client
    # itself skips empty steps; these force the round trip).
    empty: dict[str, list[float]] = {"lane": [], "session": [], "unary": []}
    for _ in range(500):
        for how, out in empty.items():
            c._step += 1
            req = StepBatch().to_pb(c.engine_id, c._step)
            t0 = time.perf_counter()
            if how == "unary":
                c._stub.Step(req, timeout=5)
            else:
                call = c._lane.call if how == "lane" else c._session.call
                assert call(pb.SessionRequest(step=req), 5.0) is not None, f"no {how}"
            out.append((time.perf_counter() - t0) * 1000)
    return {
        "empty_step_p50_ms": round(statistics.median(empty["lane"][50:]), 3),
        "empty_step_session_p50_ms": round(statistics.median(empty["session"][50:]), 3),
        "empty_step_unary_p50_ms": round(statistics.median(empty["unary"][50:]), 3),
        "step256_p50_ms": round(statistics.median(times), 3),
        "step256_p99_ms": round(pct(times, 0.99), 3),
        "step256_mean_ms": round(statistics.fmean(times), 3),
        **({"step256_daemon_mean_ms": round(daemon_ms, 3)} if metrics_port else {}),
        "steps": len(times),
        "step256_sparse_p50_ms": round(statistics.median(sparse), 3),
        "step256_sparse_p99_ms": round(pct(sparse, 0.99), 3),
        "step256_sparse_mean_ms": round(statistics.fmean(sparse), 3),
    }


def bench_lookup(c: DepotClient) -> dict[str, float]:
    rng = random.Random(1)
    n = 131072
    toks = [rng.randrange(50_000) for _ in range(n)]
    w = c.worker(0)
    w.attached.wait(10)
    b = StepBatch()
    b.new("big", toks, list(range(n // LAYOUT.block_size + 1)), computed=0, scheduled=n)
    res = c.step(b)
    w.forward_done(res.step)
    w.wait(lambda evs: len(evs) >= 1, 10)
    hit, miss = [], []
    other = [t + 1 for t in toks]
    for i in range(21):
        t0 = time.perf_counter()
        r = c.lookup(f"q{i}", toks)
        hit.append((time.perf_counter() - t0) * 1000)
        assert r.matched_tokens == n - LAYOUT.block_size, r
        t0 = time.perf_counter()
        c.lookup(f"m{i}", other)
        miss.append((time.perf_counter() - t0) * 1000)
    return {
        "lookup128k_ms": round(statistics.median(hit[1:]), 3),
        "lookup128k_miss_ms": round(statistics.median(miss[1:]), 3),
        "lookup128k_matched_tokens": n - LAYOUT.block_size,
    }


SCRAPE_TOKEN = secrets.token_hex(24)  # the --auth daemon's metrics token (its /metrics needs one)


def daemon_totals(port: int, method: str) -> tuple[float, float]:
    """The daemon's RPC histogram for `method`: (seconds in total, calls)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {SCRAPE_TOKEN}"})
    body = urllib.request.urlopen(req, timeout=5).read().decode()
    total = count = 0.0
    for line in body.splitlines():
        if line.startswith(f'kvdepot_rpc_duration_seconds_sum{{method="{method}"}}'):
            total = float(line.split()[-1])
        if line.startswith(f'kvdepot_rpc_duration_seconds_count{{method="{method}"}}'):
            count = float(line.split()[-1])
    return total, count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--address", default="")
    ap.add_argument("--token-file", default="", help="the token for a daemon at --address that asks for one")
    ap.add_argument("--auth", action="store_true", help="the daemon started here asks for tokens (what checking them costs)")
    args = ap.parse_args()
    daemon = None
    token = read_token(args.token_file) if args.token_file else ""
    auth_args: list[str] = []
    if args.auth and not args.address:
        token = secrets.token_hex(24)
        fd, tokens_path = tempfile.mkstemp(suffix=".toml")
        with os.fdopen(fd, "w") as f:
            f.write(f'metrics = "{SCRAPE_TOKEN}"\n[namespaces]\nbench = "{token}"\n')
        auth_args = ["--auth-file", tokens_path]
    for attempt in range(3):  # a free port can be taken by another process before the daemon binds it
        metrics_port = free_port()
        daemon_args = ["--log-level", "warning", "--metrics-listen", f"127.0.0.1:{metrics_port}", "--host-gib", "2", *auth_args]  # 8192 blocks of 128 KiB fit
        if args.address:
            break
        try:
            daemon = DaemonProcess(args=daemon_args).start(timeout_s=60)
            break
        except RuntimeError as e:
            if "already in use" not in str(e) or attempt == 2:
                raise
    address = args.address or daemon.tcp  # type: ignore[union-attr]
    try:
        out: dict[str, object] = {"bench": "control_plane", "address": "loopback tcp", "tokens": bool(token)}
        with DepotClient(address, strict=True, deadline_s=5.0, token=token) as c:
            c.register_engine("bench-model", LAYOUT, name="bench-steps", engine_key="bench-steps")
            # The daemon's own time per dense Step (its RPC histogram over that pass), without the wire.
            out.update(bench_steps(c, token, args.steps, metrics_port=metrics_port if daemon is not None else 0))
        for how, kwargs in (("session", {"lane": False}), ("unary", {"session": False})):  # the other transports
            with DepotClient(address, strict=True, deadline_s=5.0, token=token, **kwargs) as c:
                c.register_engine("bench-model", LAYOUT, name=f"bench-steps-{how}", engine_key=f"bench-steps-{how}")
                other = bench_steps(c, token, args.steps, dense_only=True)
                out[f"step256_{how}_p50_ms"], out[f"step256_{how}_p99_ms"] = other["step256_p50_ms"], other["step256_p99_ms"]
        with DepotClient(address, strict=True, deadline_s=5.0, token=token) as c:
            c.register_engine("bench-model", LAYOUT, name="bench-lookup")
            out.update(bench_lookup(c))
        out["targets_met"] = out["step256_p50_ms"] <= 1.0 and out["step256_p99_ms"] <= 3.0 and out["lookup128k_ms"] <= 10.0  # type: ignore[operator]
        print(json.dumps(out))
    finally:
        if daemon is not None:
            daemon.stop()
        if auth_args:
            os.unlink(auth_args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
