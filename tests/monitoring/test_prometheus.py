"""The shipped alert rules and Grafana dashboard (deploy/) against promtool and a real Prometheus
that scrapes a real daemon (host, disk and remote tiers) under a FakeEngine workload: the rules
load and evaluate without error, every metric any expression names is one the daemon exports,
every dashboard query returns data, and an alert fires for a real event (an engine killed without
unregistering). Needs Debian's `prometheus` package (promtool with it); CI's monitoring stage."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvdepot import DepotClient
from kvdepot.errors import NotFound
from kvdepot.testing import DaemonProcess
from kvdepot.testing.daemon import free_port
from kvdepot.testing.valkey import ValkeyCluster, remote_args
from tests.integration.test_status import died_without_unregistering

pytestmark = pytest.mark.monitoring
ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "kvdepot-alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvdepot.json"
METRIC = re.compile(r"\bkvdepot_[a-z0-9_]+")


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        if os.environ.get("KVDEPOT_REQUIRE_MONITORING") == "1":
            pytest.fail(f"{tool} is not installed (Debian: apt-get install prometheus)")
        pytest.skip(f"{tool} is not installed (Debian: apt-get install prometheus)")
    return path


def rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def dashboard_targets() -> list[tuple[str, str]]:
    out = []
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    return out


def test_promtool_checks_and_unit_tests_the_rules() -> None:
    promtool = need("promtool")
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0 and f"SUCCESS: {len(rules())} rules found" in check.stdout, check.stdout + check.stderr
    tests = subprocess.run([promtool, "test", "rules", str(RULES.with_suffix(".test.yml"))], capture_output=True, text=True)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULES.with_suffix(".test.yml").read_text()))
    assert tested == {r["alert"] for r in rules()}  # every alert has a unit test


class Prometheus:
    def __init__(self, target: str, workdir: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        shutil.copy(RULES, os.path.join(workdir, "kvdepot-alerts.yml"))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["kvdepot-alerts.yml"],
            "scrape_configs": [{"job_name": "kvdepotd", "static_configs": [{"targets": [target]}]}],
        }
        with open(os.path.join(workdir, "prometheus.yml"), "w") as f:
            yaml.safe_dump(config, f)
        self.log = open(os.path.join(workdir, "prometheus.log"), "w+")
        self.proc = subprocess.Popen(
            [need("prometheus"), f"--config.file={workdir}/prometheus.yml", f"--storage.tsdb.path={workdir}/data",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=workdir,
        )

    def api(self, path: str, **params: Any) -> Any:
        url = f"{self.base}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def wait_ready(self) -> None:
        end = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.logs()
            try:
                with urllib.request.urlopen(self.base + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < end, self.logs()
            time.sleep(0.3)

    def logs(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def sample_names(url: str) -> set[str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return {ln.split("{")[0].split(" ")[0] for ln in r.read().decode().splitlines() if ln and not ln.startswith("#")}


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[DaemonProcess, Prometheus, str]]:
    need("prometheus")
    mport = free_port()
    with ValkeyCluster(primaries=1, cluster=False, maxmemory="64mb") as vc:
        args = ["--metrics-listen", f"127.0.0.1:{mport}", "--host-gib", "0.02", "--disk-dir", str(tmp_path / "disk"), "--disk-gib", "0.1",
                "--disk-admit-after", "1", *remote_args(vc.url), "--lease-ms", "1000"]
        with DaemonProcess(args=args) as d:
            prom = Prometheus(f"127.0.0.1:{mport}", tempfile.mkdtemp(prefix="kvdepot-prom-", dir=tmp_path))
            try:
                prom.wait_ready()
                yield d, prom, f"http://127.0.0.1:{mport}/metrics"
            finally:
                prom.stop()


def test_prometheus_scrapes_a_real_daemon_and_every_query_has_data(stack: tuple[DaemonProcess, Prometheus, str]) -> None:
    d, prom, metrics_url = stack
    end = time.monotonic() + 30
    while not prom.api("query", query='up{job="kvdepotd"} == 1')["result"]:  # scraped before anything happens
        assert time.monotonic() < end, prom.logs()
        time.sleep(0.3)
    # A workload over the unix socket (KV memory as memfds): stores, loads, evictions to disk and
    # the store; a refused call; an engine killed without unregistering (its lease expires).
    load = subprocess.Popen([sys.executable, "-m", "kvdepot.testing.workload", d.unix, "--seconds", "12", "--engines", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    died_without_unregistering(d.tcp)
    with DepotClient(d.tcp, strict=True) as c, pytest.raises(NotFound):
        c.slots("no-such-engine")  # an RPC answered with an error
    time.sleep(4)
    exported = sample_names(metrics_url)  # while engines are registered (their gauges have series only then)
    out, err = load.communicate(timeout=120)
    assert load.returncode == 0, out + err
    time.sleep(3)  # the last scrapes and rule evaluations after the workload

    # Every metric an expression names is one the daemon exports.
    exported |= sample_names(metrics_url)
    exprs = [(f"dashboard: {title}", e) for title, e in dashboard_targets()] + [(f"rule {r['alert']}", r["expr"]) for r in rules()]
    for where, expr in exprs:
        for name in METRIC.findall(expr):
            assert name in exported, f"{where} names {name}, which the daemon does not export"

    # Every alert rule loaded and evaluated without error, and every metric it names has data.
    groups = prom.api("rules")["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(loaded) == {r["alert"] for r in rules()}
    for name, r in loaded.items():
        assert r["health"] == "ok" and not r.get("lastError"), (name, r)
    for r in rules():
        for name in set(METRIC.findall(r["expr"])) | ({"up"} if "up{" in r["expr"] else set()):
            assert prom.api("query", query=f'count({name}{{job="kvdepotd"}})')["result"], f"rule {r['alert']}: no data for {name}"

    # Every dashboard query returns data over the workload's window.
    end = time.time()
    for title, expr in dashboard_targets():
        q = expr.replace("$__rate_interval", "5s").replace('instance=~"$instance"', 'instance=~".*"')
        data = prom.api("query_range", query=q, start=end - 20, end=end, step=1)["result"]
        assert data, f"dashboard panel {title!r}: no data for {q}"

    # A real event fires its alert: the killed engine's lease expired.
    deadline = time.monotonic() + 20
    firing: list[str] = []
    while time.monotonic() < deadline:
        firing = [a["labels"]["alertname"] for a in prom.api("alerts")["alerts"] if a["state"] == "firing"]
        if "KvdepotLeaseExpiries" in firing:
            break
        time.sleep(0.5)
    assert "KvdepotLeaseExpiries" in firing
    assert "KvdepotDown" not in firing and "KvdepotChecksumFailures" not in firing
