"""The remote tier (G4) on a real 3-primary Valkey cluster on loopback, started here: its
throughput through two daemons against the client library's own pipelined SET and MGET of the
same bytes, measured side by side in one run, and a real vLLM's TTFT with a prompt served from the
store on a second node against recomputing it and against vLLM's own prefix cache.

    python bench/remote_tier.py                    # throughput (any venv with the project)
    .venv-vllm/bin/python bench/remote_tier.py     # and the TTFT (needs vLLM: scripts/bootstrap-vllm)

Prints one JSON line.

Throughput: an engine (FakeEngine, real KV bytes in shared memory) on daemon A computes a prompt of
--blocks blocks twice, so its blocks are admitted (--disk-admit-after 2) all at once on the second
run: `write` is the time from that run's start until A reports every block written to the store.
A fresh engine on daemon B then looks the prompt up: `read` is the time from that Lookup's start
until B reports every block read into its host tier (the Lookup finds them in the store and starts
the reads at once: remote_prefetch on for this part; every header, checksum and MAC checked), and the engine then
generates the prompt from B (checked byte for byte, not timed). The baseline is the glide client's
own non-atomic batch of SETs, and MGET, of values of the same size, the same number of them.
Targets: >= 1.0x of the baseline both ways.

TTFT: three vLLM engines (the random Llama of bench/vllm_ttft.py: 8 layers, hidden 512, 8 heads of
64, float32, 32-token blocks: 1 MiB a block): one without kvdepot (recompute, then its own prefix
hit), one on daemon A (computes and stores the prompt, whose blocks reach the store), one on daemon B
(the prompt comes from the store). Targets: remote hit <= 3x a local prefix hit (goal 2x), and
>= 5x faster than recompute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvdepot import DepotClient, KvLayout  # noqa: E402
from kvdepot.testing import DaemonProcess, FakeEngine  # noqa: E402
from kvdepot.testing.valkey import ValkeyCluster, remote_args  # noqa: E402


def wait_counter(c: DepotClient, name: str, at_least: int, timeout_s: float = 120.0) -> float:
    end = time.monotonic() + timeout_s
    while c.stats().counters[name] < at_least:
        if time.monotonic() > end:
            raise RuntimeError(f"{name} stayed below {at_least}")
        time.sleep(0.002)
    return time.perf_counter()


POLL_S = float(os.environ.get("POLL_S", "0.002"))


class Watch:
    """Polls a daemon's counter every millisecond on a thread of its own, from before the action it
    brackets, and keeps the moment the counter reached `target` (the engine's own work, FakeEngine
    writing and checking every position's KV, is not the tier's and is left out)."""

    def __init__(self, d: DaemonProcess, name: str, target: int) -> None:
        self.client = DepotClient(d.tcp, session=False)
        self.name, self.target, self.at = name, target, 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        end = time.monotonic() + 120
        while self.client.stats().counters[self.name] < self.target:
            if time.monotonic() > end:
                return
            time.sleep(POLL_S)
        self.at = time.perf_counter()

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join()
        self.client.close()
        if not self.at:
            raise RuntimeError(f"{self.name} never reached {self.target}")


def engine(d: DaemonProcess, lay: KvLayout, blocks: int) -> FakeEngine:
    c = DepotClient(d.unix, strict=True, deadline_s=30)
    c.register_engine("bench-remote", lay)
    e = FakeEngine(c, layout=lay, num_blocks=blocks + 8, max_batched_tokens=4096, load_timeout_s=60)
    for w in e.workers:
        assert w.attached.wait(10)
    return e


def close(e: FakeEngine) -> None:
    e.client.close()
    assert e.kv is not None
    e.kv.close()


def baseline(vc: ValkeyCluster, n: int, value_bytes: int, tag: int) -> tuple[float, float]:
    """(SET GB/s, MGET GB/s) of n values of value_bytes through the glide client, one pipelined
    non-atomic batch of SETs and one MGET, as the daemon's client is set up."""
    import glide_sync as g

    client = g.GlideClusterClient.create(
        g.GlideClusterClientConfiguration([g.NodeAddress("127.0.0.1", p) for p in vc.ports], request_timeout=60_000)
    )
    try:
        # n distinct values, as many bytes as the daemon moves (a few values reused would be
        # served from the CPU's caches: 0.5 - 0.8 of this run's figure against 0.6 - 1.0).
        values = [os.urandom(64) * (value_bytes // 64) for _ in range(n)]
        keys = [b"bench:%d:%d" % (tag, i) for i in range(n)]
        batch = g.ClusterBatch(is_atomic=False)
        for i, k in enumerate(keys):
            batch.set(k, values[i])
        t0 = time.perf_counter()
        client.exec(batch, raise_on_error=True)
        t_set = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = client.mget(keys)
        t_get = time.perf_counter() - t0
        assert all(v is not None and len(v) == len(values[0]) for v in got)
        client.delete(keys)
    finally:
        client.close()
    total = n * len(values[0]) / 1e9
    return total / t_set, total / t_get


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    heads = max(1, args.block_kib * 1024 // (16 * 2 * 128 * 16 * 2))  # 16 layers, K and V, head 128, 16 tokens, fp16
    lay = KvLayout(num_layers=16, num_kv_heads=heads, head_size=128, dtype="float16", block_size=16, kind="vllm_cpu")
    n = args.blocks
    host_gib = str(max(0.25, 3 * n * lay.block_bytes / 2**30))
    res: dict[str, Any] = {"block_bytes": lay.block_bytes, "blocks": n, "repeat": args.repeat}
    writes, reads, set_gbs, get_gbs, lookups = [], [], [], [], []
    with ValkeyCluster(primaries=3) as vc:
        # remote_prefetch: B's Lookup starts the reads, timed from its start (the Step's loads then find them)
        common = ["--host-gib", host_gib, *remote_args(vc.url), "--disk-admit-after", "2", "--remote-prefetch", "true", *args.daemon_arg]
        with DaemonProcess(args=common) as a, DaemonProcess(args=common) as b:
            for r in range(args.repeat + 1):  # the first round warms up (code paths, page faults), not counted
                toks = list(range(1_000_000 * (r + 1), 1_000_000 * (r + 1) + n * 16 + 1))
                ea = engine(a, lay, n)
                ea.generate(toks, max_new_tokens=1)
                written = ea.client.stats().counters["remote_written_blocks"]
                ea.reset_prefix_cache()
                ea.check_kv = False  # its check of every position would compete with the writes for the 2 cores
                time.sleep(0.3)
                queued = ea.client.stats().counters["remote_queued_blocks"]
                with Watch(a, "remote_queued_blocks", queued + 1) as started, Watch(a, "remote_written_blocks", written + n) as ended:
                    ea.generate(toks, max_new_tokens=1)  # the second sighting: every block admitted at once
                t0, t1 = started.at, ended.at
                close(ea)
                eb = engine(b, lay, n)
                time.sleep(0.3)
                read = eb.client.stats().counters["remote_read_blocks"]
                with Watch(b, "remote_read_blocks", read + n) as ended:
                    t2 = time.perf_counter()
                    assert eb.client.lookup("probe", toks).by_tier == {"remote": n * 16}  # all n in the store: read from now on
                    lookups.append((time.perf_counter() - t2) * 1000)  # the Lookup RPC alone
                t3 = ended.at
                eb.generate(toks, max_new_tokens=1)
                assert eb.stats.loaded_tokens == n * 16 and eb.stats.kv_mismatched_tokens == 0, eb.stats
                close(eb)
                gb = n * lay.block_bytes / 1e9
                s, g = baseline(vc, n, lay.block_bytes, r)
                if r:
                    writes.append(gb / (t1 - t0))
                    reads.append(gb / (t3 - t2))
                    set_gbs.append(s)
                    get_gbs.append(g)
            with DepotClient(b.tcp) as cb:
                counters = dict(cb.stats().counters)
    med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    res.update(
        write_gbs=med(writes), read_gbs=med(reads), set_gbs=med(set_gbs), mget_gbs=med(get_gbs),
        runs={"write": [round(x, 3) for x in writes], "read": [round(x, 3) for x in reads], "set": [round(x, 3) for x in set_gbs],
              "mget": [round(x, 3) for x in get_gbs]},
        lookup_ms=[round(x, 2) for x in lookups],  # a Lookup RPC whose every block is in the store (round 0 included)
        read_side={k: counters[k] for k in ("remote_read_blocks", "remote_prefetched_blocks", "remote_read_failed_blocks", "remote_checksum_failures", "remote_forged_blocks", "lookup_remote_hit_tokens")},
    )
    # Each round's daemon and client figures were taken back to back: the median of the rounds' ratios.
    res["write_over_set"] = round(statistics.median(w / s for w, s in zip(writes, set_gbs)), 2)
    res["read_over_mget"] = round(statistics.median(r / g for r, g in zip(reads, get_gbs)), 2)
    return res


def ttft(args: argparse.Namespace) -> dict[str, Any]:
    import vllm_ttft as vt  # bench/vllm_ttft.py: the same model, engines and measurement
    from vllm.config import KVTransferConfig

    from kvdepot.testing.tiny_llama import build_tiny_llama

    work = tempfile.mkdtemp(prefix="kvdepot-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    model = build_tiny_llama(os.path.join(work, "model"), layers=8, hidden=512, heads=8, kv_heads=8, head_dim=64, intermediate=1024)
    size = args.prompt
    got: dict[str, list[float]] = {"ttft_recompute_ms": [], "ttft_local_hit_ms": [], "ttft_remote_hit_ms": []}
    same = True
    engines: list[Any] = []
    with ValkeyCluster(primaries=3) as vc:
        common = ["--host-gib", "2", *remote_args(vc.url), "--disk-admit-after", "1"]
        with DaemonProcess(args=common) as a, DaemonProcess(args=common) as b:
            try:

                def kv(d: DaemonProcess) -> Any:
                    return KVTransferConfig(kv_connector="KvDepotConnector", kv_connector_module_path="kvdepot.vllm", kv_role="kv_both",
                                            kv_connector_extra_config={"address": d.unix})

                plain = vt.engine(model, "float32")
                on_a = vt.engine(model, "float32", kv_transfer_config=kv(a))
                on_b = vt.engine(model, "float32", kv_transfer_config=kv(b))
                engines += [plain, on_a, on_b]
                ca = DepotClient(a.tcp)
                for e in engines:  # warm-up: code paths and every KV page once
                    for w in range(-(-vt.KV_BLOCKS * vt.BLOCK // size)):
                        vt.ttft_ms(e, vt.prompt(size, 10_000 + w))
                    vt.reset(e)
                written = ca.stats().counters["remote_written_blocks"]
                warm = vt.prompt(size, 20_000)  # and one remote hit: the first load runs code for the first time
                vt.ttft_ms(on_a, warm)
                written += size // vt.BLOCK  # every full block of the prompt
                wait_counter(ca, "remote_written_blocks", written)
                vt.settle()
                vt.ttft_ms(on_b, warm)
                vt.reset(on_b)
                for v in range(args.ttft_repeat):
                    toks = vt.prompt(size, v)
                    vt.settle()
                    t, want = vt.ttft_ms(plain, toks)
                    got["ttft_recompute_ms"].append(t)
                    vt.settle()
                    got["ttft_local_hit_ms"].append(vt.ttft_ms(plain, toks)[0])
                    _, out_a = vt.ttft_ms(on_a, toks)
                    written += size // vt.BLOCK
                    wait_counter(ca, "remote_written_blocks", written)
                    vt.settle()
                    t, out_b = vt.ttft_ms(on_b, toks)
                    got["ttft_remote_hit_ms"].append(t)
                    same = same and out_a == want and out_b == want
                    vt.reset(on_b)
                    vt.reset(on_a)
                with DepotClient(b.tcp) as cb:
                    counters = dict(cb.stats().counters)
                ca.close()
            finally:
                for e in engines:
                    vt.close(e)
                shutil.rmtree(work, ignore_errors=True)
    res: dict[str, Any] = {k: round(statistics.median(v), 1) for k, v in got.items()}
    res["runs"] = {k: [round(x, 1) for x in v] for k, v in got.items()}
    res.update(prompt_tokens=size, outputs_identical=same, model="llama 8x512, 8 heads of 64, float32, 1 MiB blocks")
    res["recompute_over_remote_hit"] = round(res["ttft_recompute_ms"] / res["ttft_remote_hit_ms"], 2)
    res["remote_hit_over_local_hit"] = round(res["ttft_remote_hit_ms"] / res["ttft_local_hit_ms"], 2)
    res["node_b"] = {k: counters[k] for k in ("lookup_remote_hit_tokens", "remote_read_blocks", "remote_read_failed_blocks", "load_failed_blocks")}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=256, help="blocks per throughput round; default 256")
    ap.add_argument("--block-kib", type=int, default=512, help="block size in KiB for the throughput rounds; default 512")
    ap.add_argument("--repeat", type=int, default=5, help="measured throughput rounds (median); default 5")
    ap.add_argument("--prompt", type=int, default=3500, help="TTFT prompt tokens; default 3500")
    ap.add_argument("--ttft-repeat", type=int, default=5, help="measured TTFT rounds (median); default 5")
    ap.add_argument("--no-ttft", action="store_true", help="skip the vLLM TTFT part")
    ap.add_argument("--daemon-arg", action="append", default=[], help="an extra kvdepotd argument for the throughput daemons (repeatable)")
    args = ap.parse_args()
    out: dict[str, Any] = {"bench": "remote_tier", "store": "valkey cluster, 3 primaries on loopback"}
    out["throughput"] = tp = throughput(args)
    targets = {"write_ge_1.0x_set": tp["write_over_set"] >= 1.0, "read_ge_1.0x_mget": tp["read_over_mget"] >= 1.0}
    try:
        import vllm  # noqa: F401
    except ImportError:
        vllm_ok = False
    else:
        vllm_ok = True
    if args.no_ttft or not vllm_ok:
        out["ttft"] = "skipped: " + ("--no-ttft" if args.no_ttft else "vLLM is not installed here (run it with .venv-vllm/bin/python)")
    else:
        os.environ.update(VLLM_CPU_OMP_THREADS_BIND="auto", VLLM_CPU_NUM_OF_RESERVED_CPU="1")
        import logging

        logging.disable(logging.WARNING)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        out["ttft"] = t = ttft(args)
        targets["remote_hit_ge_5x_faster_than_recompute"] = t["recompute_over_remote_hit"] >= 5
        targets["remote_hit_le_3x_local_hit"] = t["remote_hit_over_local_hit"] <= 3
        targets["outputs_identical"] = t["outputs_identical"]
    out["targets_met"] = targets
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
