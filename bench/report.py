"""Renders the current results table from bench/results/*.json (the README's and docs/performance.md's).

A results file is one sitting's measurements:
    {"what": "...", "date": "YYYY-MM-DD" (or YYYY-MM-DDTHH:MM, to order two of one day), "machine": "...",
     "sets": [{"bench": "host_tier", "command": "bench/host_tier.py", "build": "compiled",
               "date": "YYYY-MM-DD" (default: the file's), "label": "after" (optional), "commit": "...",
               "runs": [<a benchmark's JSON line>, ...],           # whole lines, when kept
               "ranges": {"offload_ratio": [min, max], ...},       # else (or also) ranges
               "n_runs": 6}]}                                      # how many runs the ranges span
A figure's current value is its range over the newest set (by date, then file order) of the
compiled build that has it; sets labelled other than "after" (the "before" of a comparison, a
version that was dropped) are left out. Nested figures are dotted ("ratios.3500.x").

    .venv/bin/python bench/report.py            # print the table (markdown)
    .venv/bin/python bench/report.py --write    # rewrite it in README.md and docs/performance.md
tests/unit/test_docs.py fails when either file's table is not what this prints.
"""

from __future__ import annotations

import argparse
import json
import operator
import pathlib
import sys
from dataclasses import dataclass
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BEGIN, END = "<!-- results table: bench/report.py --write -->", "<!-- end of results table -->"
TARGETS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt}


@dataclass(frozen=True)
class Figure:
    label: str
    bench: str
    key: str
    target: str = ""  # "<= 1" and the like; empty: reported, no target
    unit: str = ""
    reproduce: str = ""
    scale: float = 1.0  # shown as value x scale (a fraction as %)
    range_key: str = ""  # a [min, max] the run reports itself (its value is then a median)

    def met(self, value: float) -> bool:
        op, bound = self.target.split()
        return bool(TARGETS[op](value, float(bound)))


FIGURES = (
    Figure("Step, 256 decode updates, p50", "control_plane", "step256_p50_ms", "<= 1", " ms", "bench/control_plane.py"),
    Figure("Step, 256 decode updates, p99", "control_plane", "step256_p99_ms", "<= 3", " ms", "bench/control_plane.py"),
    Figure("Lookup, 128k-token prompt, full hit", "control_plane", "lookup128k_ms", "<= 10", " ms", "bench/control_plane.py"),
    Figure("host tier store / memcpy", "host_tier", "offload_ratio", ">= 0.7", "", "bench/host_tier.py"),
    Figure("host tier load / memcpy", "host_tier", "onboard_ratio", ">= 0.7", "", "bench/host_tier.py"),
    Figure("disk write / O_DIRECT write", "disk_tier", "write_ratio", ">= 0.7", "", "bench/disk_tier.py"),
    Figure("disk read / O_DIRECT read", "disk_tier", "read_ratio", ">= 0.7", "", "bench/disk_tier.py"),
    Figure("vLLM: daemon hit / local hit, 3500 tokens", "vllm_ttft", "ratios.3500.daemon_hit_over_local_hit", "<= 1.5", "x", "bench/vllm_ttft.py"),
    Figure("vLLM: recompute / daemon hit, 3500 tokens", "vllm_ttft", "ratios.3500.recompute_over_daemon_hit", ">= 5", "x", "bench/vllm_ttft.py"),
    Figure("vLLM: daemon hit / the same engine's local hit, 3500 tokens", "vllm_ttft", "ratios.3500.daemon_hit_over_own_local_hit", "<= 1.1", "x", "bench/vllm_ttft.py"),
    Figure("vLLM: daemon hit, layer by layer / whole, 3500 tokens", "vllm_ttft", "ratios.3500.layerwise_over_whole", "", "x", "bench/vllm_ttft.py"),
    Figure("vLLM: cold TTFT overhead, 2000 tokens", "vllm_ttft", "ratios.2000.cold_overhead", "<= 0.05", "%", "bench/vllm_ttft.py", 100),
    Figure("vLLM: decode tokens/s, kvdepot / none", "vllm_ttft", "decode_tps_ratio", ">= 0.95", "", "bench/vllm_ttft.py"),
    Figure("vLLM CPU: engine peak memory over plain, 2 GiB KV cache", "vllm_memory", "memfd.peak_over_plain_mib", "<= 205", " MiB", "bench/vllm_memory.py"),
    Figure("vLLM CPU: engine start, kvdepot / plain", "vllm_memory", "start_ratio", "<= 1.05", "", "bench/vllm_memory.py"),
    Figure("remote tier write / client SET", "remote_tier", "throughput.write_over_set", ">= 1.0", "", "bench/remote_tier.py"),
    Figure("remote tier read / client MGET", "remote_tier", "throughput.read_over_mget", ">= 1.0", "", "bench/remote_tier.py"),
    Figure("vLLM: recompute / remote hit, 3500 tokens", "remote_tier", "ttft.recompute_over_remote_hit", ">= 5", "x", "bench/remote_tier.py"),
    Figure("vLLM: remote hit / local hit, 3500 tokens", "remote_tier", "ttft.remote_hit_over_local_hit", "<= 3", "x", "bench/remote_tier.py"),
    Figure("restart to SERVING, 8 GiB host tier", "startup", "default_s", "<= 1", " s", "bench/startup.py", range_key="default_range_s"),
    Figure("restart to SERVING, + disk tier of 10k blocks", "startup", "disk_s", "<= 1", " s", "bench/startup.py", range_key="disk_range_s"),
    Figure("a busy port fails after", "startup", "busy_port_s", "< 1", " s", "bench/startup.py", range_key="busy_port_range_s"),
    Figure("daemon memory once SERVING (8 GiB tier)", "startup", "rss_mib", "", " MiB", "bench/startup.py"),
)


def dig(run: dict[str, Any], key: str) -> float | None:
    value: Any = run
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def load_sets() -> list[dict[str, Any]]:
    """Every set of every results file, oldest first (by date, then file name and order)."""
    out = []
    for path in sorted(RESULTS.glob("*.json")):
        doc = json.loads(path.read_text())
        for k, s in enumerate(doc["sets"]):
            out.append({**s, "date": s.get("date", doc["date"]), "_order": (s.get("date", doc["date"]), path.name, k)})
    return sorted(out, key=lambda s: s["_order"])


def current(fig: Figure, sets: list[dict[str, Any]]) -> tuple[float, float, int, dict[str, Any], list[float]] | None:
    """(min, max, runs, the set, every value) over the newest compiled set that has the figure."""
    for s in reversed(sets):
        if s["bench"] != fig.bench or s.get("build", "compiled") != "compiled" or s.get("label", "after") != "after":
            continue
        values = [v for r in s.get("runs", []) if (v := dig(r, fig.key)) is not None]
        if values and fig.range_key:  # each run's own extremes stand for its starts
            values = [float(x) for r in s["runs"] for x in r.get(fig.range_key, [dig(r, fig.key)] * 2)]
        rng = s.get("ranges", {}).get(fig.key)
        if rng is not None:
            return float(rng[0]), float(rng[1]), int(s.get("n_runs", len(values) or 1)), s, values
        if values:
            return min(values), max(values), int(s.get("n_runs", len(values))), s, values
    return None


def fmt(x: float) -> str:
    return f"{x:.3g}".replace("-", "−") if abs(x) < 100 else f"{x:,.0f}"


def table() -> str:
    sets = load_sets()
    rows = ["| figure | target | last measured | runs | date | reproduce |", "|---|---|---|---|---|---|"]
    for fig in FIGURES:
        got = current(fig, sets)
        op, _, bound = fig.target.partition(" ")
        target = f"{op.replace('<=', '≤').replace('>=', '≥')} {fmt(float(bound) * fig.scale)}{fig.unit}" if fig.target else "—"
        if got is None:
            rows.append(f"| {fig.label} | {target} | not measured yet | | | `{fig.reproduce}` |")
            continue
        lo, hi, n, where, values = got
        a, b = fmt(lo * fig.scale), fmt(hi * fig.scale)
        shown = (a if a == b else f"{a} – {b}") + fig.unit
        if fig.target:
            if values:
                met = sum(fig.met(v) for v in values)
                shown += f" (met in {met} of {len(values)})" if met < len(values) else " (met)"
            else:
                shown += " (met)" if fig.met(lo) and fig.met(hi) else " (not met in every run)"
        rows.append(f"| {fig.label} | {target} | {shown} | {n} | {where['date'][:10]} | `{where.get('command', fig.reproduce)}` |")
    return "\n".join(rows)


def replace_table(text: str, rendered: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + rendered + "\n" + text[end:]


DOCS = (ROOT / "README.md", ROOT / "docs" / "performance.md")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="rewrite the table in README.md and docs/performance.md")
    args = ap.parse_args()
    rendered = table()
    if not args.write:
        print(rendered)
        return 0
    for path in DOCS:
        path.write_text(replace_table(path.read_text(), rendered))
    return 0


if __name__ == "__main__":
    sys.exit(main())
