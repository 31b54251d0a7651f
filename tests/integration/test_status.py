"""`kvdepotd status`: the operator's view of a real daemon under a real workload, as JSON and in a
real terminal (tmux), with tokens, with a store op left waiting and an engine that died."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdepot import DepotClient, KvLayout, StepBatch
from kvdepot.testing import DaemonProcess
from tests.integration.conftest import LAYOUT, attached_engine

STATUS = [sys.executable, "-m", "kvdepotd", "status"]


def status_json(address: str, *extra: str) -> dict:
    out = subprocess.run([*STATUS, address, "--json", *extra], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def died_without_unregistering(address: str) -> None:
    """An engine process that registers and is killed (no unregister): its lease must expire."""
    code = (
        "import os; from kvdepot import DepotClient, KvLayout\n"
        f"c = DepotClient({address!r}); c.register_engine('m', KvLayout(2, 2, 8, 'float16', 16, kind='none'), name='doomed'); os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_status_shows_engines_tiers_hits_ops_and_failures(tmp_path: Path) -> None:
    with DaemonProcess(args=["--lease-ms", "1000", "--disk-dir", str(tmp_path / "disk"), "--disk-gib", "0.1"]) as d:
        e = attached_engine(d, LAYOUT, "model-a", address=d.unix)
        prompt = list(range(1, 200))
        first = e.generate(prompt)
        e.reset_prefix_cache()
        assert e.generate(prompt).output == first.output and e.stats.loaded_tokens > 0
        # A store planned and never started: the engine's forward for it is not reported.
        with DepotClient(d.tcp) as c:
            c.register_engine("model-b", KvLayout(2, 2, 8, "float16", 16, kind="none"), name="stalled")
            batch = StepBatch()
            batch.new("r-stalled", list(range(500, 565)), block_table=[0, 1, 2, 3, 4], computed=0, scheduled=65)
            assert [op.kind for op in c.step(batch).ops] == ["store"]
            died_without_unregistering(d.tcp)
            time.sleep(1.6)  # past the lease of 1 s
            snap = status_json(d.unix)
            text = subprocess.run([*STATUS, d.tcp], capture_output=True, text=True, timeout=30).stdout

    assert snap["health"] == "SERVING"
    names = {x["name"]: x for x in snap["engines"]}
    assert set(names) == {"stalled", ""}  # the FakeEngine has no name
    assert "doomed" not in names  # its lease expired
    host = snap["tiers"]["host"]
    assert host["used_blocks"] >= len(prompt) // 16 and host["hit_tokens"] == e.stats.loaded_tokens
    assert snap["tiers"]["disk"]["capacity_bytes"] == int(0.1 * 2**30)
    assert snap["lookups"]["asked_tokens"] >= snap["lookups"]["hit_tokens"] > 0
    ops = snap["ops"]
    assert ops["in_flight"] == 1 and ops["oldest_age_s"] >= 1.0
    assert ops["oldest"][0]["state"] == "waiting_forward" and ops["oldest"][0]["request_id"] == "r-stalled"
    assert snap["failures"]["counters"]["leases_expired"] == 1
    assert [f["kind"] for f in snap["failures"]["recent"]] == ["lease_expired"]
    # The text view says the same.
    assert "SERVING" in text and "stalled" in text and "r-stalled" in text and "waiting_forward" in text
    assert "leases_expired" in text and "lease_expired" in text and "hit rate" in text


def test_status_with_tokens_and_against_nothing(tmp_path: Path) -> None:
    admin, scrape, team = "admin-token-0123456789", "metrics-token-0123456789", "team-token-0123456789"
    (tmp_path / "tokens.toml").write_text(f'admin = "{admin}"\nmetrics = "{scrape}"\n[namespaces]\nteam = "{team}"\n')
    for name, tok in (("admin", admin), ("metrics", scrape), ("team", team)):
        (tmp_path / name).write_text(tok + "\n")
    with DaemonProcess(args=["--auth-file", str(tmp_path / "tokens.toml")]) as d:
        with DepotClient(d.tcp, token=team) as c:
            c.register_engine("m", KvLayout(2, 2, 8, "float16", 16, kind="none"), name="team-engine")
            full = status_json(d.tcp, "--token-file", str(tmp_path / "admin"))
            figures = status_json(d.tcp, "--token-file", str(tmp_path / "metrics"))
            refused = subprocess.run([*STATUS, d.tcp, "--token-file", str(tmp_path / "team")], capture_output=True, text=True, timeout=30)
            anonymous = subprocess.run([*STATUS, d.tcp], capture_output=True, text=True, timeout=30)
    assert [x["name"] for x in full["engines"]] == ["team-engine"]
    assert figures["engines"] is None and figures["tiers"]["host"]["capacity_bytes"] > 0
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr and "admin or a metrics token" in refused.stderr
    assert anonymous.returncode == 1 and "UNAUTHENTICATED" in anonymous.stderr
    gone = subprocess.run([*STATUS, d.tcp, "--timeout-s", "1"], capture_output=True, text=True, timeout=30)
    assert gone.returncode == 1 and gone.stderr.startswith(f"kvdepotd at {d.tcp}: UNAVAILABLE")
    for bad in (["--watch", "0"], ["--timeout-s", "-1"], ["--token-file", str(tmp_path / "missing")]):
        out = subprocess.run([*STATUS, d.tcp, *bad], capture_output=True, text=True, timeout=30)
        assert out.returncode == 2 and out.stderr.startswith("kvdepotd: "), (bad, out.stderr)
    hopeless = subprocess.run([*STATUS, "unix:/tmp/" + "y" * 120 + "/s.sock", "--watch", "1"], capture_output=True, text=True, timeout=30)
    assert hopeless.returncode == 2 and "over the system's limit of 107" in hopeless.stderr  # not retried forever


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_status_watch_in_a_real_terminal_under_load(tmp_path: Path) -> None:
    """`--watch` in tmux while a workload runs: the view refreshes with the interval's hit rate,
    and Ctrl-C ends it with exit 0."""
    session = f"kvdepot-status-{os.getpid()}"
    with DaemonProcess() as d:
        load = subprocess.Popen([sys.executable, "-m", "kvdepot.testing.workload", d.unix, "--seconds", "6"], stdout=subprocess.PIPE, text=True)
        done = tmp_path / "exit"
        cmd = f"{sys.executable} -m kvdepotd status {d.tcp} --watch 0.5; echo $? > {done}"
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "45", cmd], check=True)
        try:
            screens = []
            for _ in range(8):
                time.sleep(0.6)
                screens.append(subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout)
            out, _ = load.communicate(timeout=60)
            subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], check=True)
            deadline = time.monotonic() + 10
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    assert load.returncode == 0, out
    last = screens[-1]
    assert "SERVING" in last and "workload-0" in last and "last interval" in last and "refreshing every 0.5s" in last
    stamps = {s.splitlines()[0] for s in screens if s.strip()}
    assert len(stamps) >= 3  # it refreshed (the first line carries the time and uptime)
    hit_lines = [ln for ln in last.splitlines() if ln.startswith("host")]
    assert hit_lines and "%" in hit_lines[0]
    assert done.read_text().strip() == "0"
