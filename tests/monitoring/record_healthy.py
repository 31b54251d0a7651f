"""Records a healthy daemon at a full host tier, for the promtool unit tests of the alert rules
(deploy/prometheus/kvdepot-alerts.test.yml, "a healthy full daemon fires nothing"): the series
there are this script's output, not invented.

    python tests/monitoring/record_healthy.py [--seconds 60]

A real daemon (host tier of 2 MiB: 256 blocks of the workload's 8 KiB, a disk tier, a Valkey
remote tier started here) serves kvdepot.testing.workload's two engines, whose prompts share
prefixes and end in suffixes no later prompt repeats. Once the host tier is full and evicting, its
/metrics is read, again --seconds later, and every sample a rule names is printed as a promtool
input series: a counter (or histogram bucket) growing at the rate measured, per minute, for an
hour; a gauge at the highest value it showed in a scrape every second.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvdepot import DepotClient  # noqa: E402
from kvdepot.testing import DaemonProcess  # noqa: E402
from kvdepot.testing.daemon import free_port  # noqa: E402
from kvdepot.testing.valkey import ValkeyCluster, remote_args  # noqa: E402
from kvdepot.v1 import kvdepot_pb2 as pb  # noqa: E402

RULES = ROOT / "deploy" / "prometheus" / "kvdepot-alerts.yml"
MINUTES = 60


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], tuple[str, float]]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith(("_created", "_sum", "_count")):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = (fam.type, s.value)
    return out


def full(c: DepotClient) -> bool:
    st = c.stats()
    host = [p for p in st.pools if p.tier == pb.TIER_HOST]
    return bool(host) and all(p.used_blocks >= 0.95 * p.capacity_blocks for p in host) and st.counters["evictions"] > 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args()
    exprs = [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    named = {n for e in exprs for n in re.findall(r"\bkvdepot_[a-z0-9_]+", e)}
    mport = free_port()
    with tempfile.TemporaryDirectory() as tmp, ValkeyCluster(primaries=1, cluster=False, maxmemory="64mb") as vc:
        dargs = ["--metrics-listen", f"127.0.0.1:{mport}", "--host-gib", str(2 / 1024), "--slab-mib", "1", "--disk-dir", tmp,
                 "--disk-gib", "0.05", "--disk-slab-mib", "8", "--disk-admit-after", "2", *remote_args(vc.url)]
        with DaemonProcess(args=dargs) as d, DepotClient(d.tcp) as c:
            load = subprocess.Popen([sys.executable, "-m", "kvdepot.testing.workload", d.unix, "--seconds", str(args.seconds + 120), "--engines", "2"],
                                    stdout=subprocess.DEVNULL)
            end = time.monotonic() + 120
            while not full(c):
                assert time.monotonic() < end and load.poll() is None, f"the host tier did not fill: {c.stats().pools}"
                time.sleep(0.5)
            url = f"http://127.0.0.1:{mport}/metrics"
            t0, first = time.monotonic(), scrape(url)
            highest: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}  # each gauge's highest value, scraped every second
            while time.monotonic() < t0 + args.seconds:
                time.sleep(1)
                for key, (kind, value) in scrape(url).items():
                    if kind == "gauge":
                        highest[key] = max(value, highest.get(key, value))
            t1, last = time.monotonic(), scrape(url)
            st = c.stats()
            load.kill()
            load.wait()
    per_min = 60 / (t1 - t0)
    host = [p for p in st.pools if p.tier == pb.TIER_HOST]
    print(f"      # recorded by tests/monitoring/record_healthy.py over {t1 - t0:.0f} s at a full host tier "
          f"({sum(p.used_blocks for p in host)} of {sum(p.capacity_blocks for p in host)} blocks used, "
          f"{st.counters['evictions']} evictions, {st.counters['lookup_hit_tokens']} of {st.counters['lookup_asked_tokens']} asked tokens hit)")
    print(f"      - {{series: 'up{{job=\"kvdepotd\",instance=\"h\"}}', values: '1x{MINUTES}'}}")
    for (name, labels), (kind, value) in sorted(last.items()):
        base = name[: -len("_bucket")] if name.endswith("_bucket") else name[: -len("_total")] if name.endswith("_total") else name
        if (name not in named and base not in named) or dict(labels).get("method", "Lookup") not in ("Lookup", "Step"):
            continue  # the rules name the engine calls' latency alone
        sel = ",".join([*(f'{k}="{v}"' for k, v in labels), 'job="kvdepotd"', 'instance="h"'])
        if kind in ("counter", "histogram"):
            start = first.get((name, labels), ("", 0.0))[1]
            step = (value - start) * per_min
            values = f"{start:g}+{step:.4g}x{MINUTES}"
        else:  # a gauge at the highest value it showed, all along: a harder case than any one reading
            values = f"{max(value, highest.get((name, labels), value)):g}x{MINUTES}"
        print(f"      - {{series: '{name}{{{sel}}}', values: '{values}'}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
