"""kvdepotd status's text view from snapshots (the daemon's side is tests/integration/test_status.py)."""

from __future__ import annotations

import copy
from typing import Any

from kvdepotd.status import FAILURE_COUNTERS, render


def snap(hit: int, asked: int, loads_failed: int = 0, engines: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    counters = {k: 0 for k in FAILURE_COUNTERS}
    counters["load_failed_blocks"] = loads_failed
    return {
        "address": "unix:/run/kvdepot/kvdepotd.sock", "time": 1_800_000_000.0, "health": "SERVING", "uptime_s": 3600.0,
        "engines": engines, "slots": 3,
        "tiers": {
            "host": {"capacity_bytes": 4 << 30, "used_bytes": 1 << 30, "used_blocks": 512, "pinned_blocks": 3, "in_flight_blocks": 1, "hit_tokens": hit // 2},
            "disk": {"capacity_bytes": 32 << 30, "used_bytes": 0, "used_blocks": 0, "pinned_blocks": 0, "in_flight_blocks": 0, "hit_tokens": hit // 4},
            "remote": {"address": "valkey://10.0.0.5:6379", "up": False, "queue_blocks": 17, "jobs": 2, "hit_tokens": hit // 4},
        },
        "lookups": {"lookups": 10, "asked_tokens": asked, "hit_tokens": hit},
        "ops": {"in_flight": 0, "oldest_age_s": 0.0, "oldest": []},
        "failures": {"counters": counters, "recent": []},
        "counters": counters,
    }


def test_view_with_every_tier_and_the_interval() -> None:
    before = snap(hit=400, asked=1000)
    now = snap(hit=1200, asked=2000, loads_failed=5, engines=[
        {"engine_id": "eng-1", "name": "vllm-0", "model": "m", "namespace": "team-a", "ranks_attached": 1, "world_size": 2, "slots": 3,
         "lease_s": 29.5, "last_step": 812},
    ])
    now["ops"] = {"in_flight": 1, "oldest_age_s": 12.5, "oldest": [
        {"op_id": 7, "kind": "store", "engine_id": "eng-1", "request_id": "r-1", "blocks": 4, "age_s": 12.5, "state": "waiting_forward"}]}
    now["failures"]["recent"] = [{"time": 1_800_000_000.0, "kind": "load", "engine_id": "eng-1", "message": "op 7 of request r-1: 5 of 8 blocks failed"}]
    text = render(now, before)
    lines = text.splitlines()
    assert lines[0].startswith("kvdepotd unix:/run/kvdepot/kvdepotd.sock  SERVING  up 60m")
    host = next(ln for ln in lines if ln.startswith("host"))
    assert "1.0 GiB" in host and "4.0 GiB" in host and "25.0%" in host and "30.0%" in host and "40.0%" in host  # use, since start, interval
    remote = next(ln for ln in lines if ln.startswith("remote"))
    assert "DOWN" in remote and "write queue 17 blocks, 2 jobs" in remote and remote.endswith("valkey://10.0.0.5:6379")
    assert "60.0%" in next(ln for ln in lines if ln.startswith("all")) and "80.0%" in text  # 1200/2000 since start, 800/1000 lately
    assert "vllm-0" in text and "team-a" in text and " 1/2 " in text and "29.5s" in text
    assert "ops in flight 1, oldest 12.5s" in text and "waiting_forward" in text and "r-1" in text
    assert "load_failed_blocks" in text and "+5" in text and "5 of 8 blocks failed" in text


def test_view_without_engines_or_lookups() -> None:
    s = snap(hit=0, asked=0)
    del s["tiers"]["remote"], s["tiers"]["disk"]
    text = render(s)
    assert "not shown to this token" in text and "failures: none since start" in text
    assert "disk" not in text and "remote" not in text and "last interval" not in text
    assert next(ln for ln in text.splitlines() if ln.startswith("host")).rstrip().endswith("-")  # no lookups: no hit rate
    s2 = copy.deepcopy(s)
    s2["engines"] = []
    assert "engines 0, request slots 3" in render(s2)
