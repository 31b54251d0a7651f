"""The deployment files agree with the daemon and with each other: every KVDEPOT_* setting they
give the daemon is one of its options (with a value it accepts), the engine reaches the daemon on
the socket the image serves, and the Kubernetes pod shares what the sidecar needs. (The images and
the compose file run for real in CI's container stage; no Kubernetes runs there.)"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import yaml

from kvdepotd import config

ROOT = Path(__file__).resolve().parents[2]
SOCKET = "unix:/run/kvdepot/kvdepotd.sock"


def check_daemon_env(env: dict[str, str], where: str) -> None:
    """Every KVDEPOT_* variable is a daemon option, and the daemon takes the whole set."""
    values = {k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v)) for k, v in env.items()}  # compose defaults
    for key in values:
        assert key.startswith(config.ENV_PREFIX) and key[len(config.ENV_PREFIX):].lower() in config.DaemonConfig.__dataclass_fields__, (where, key)
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    cfg = config.load(p.parse_args([]), env={**values, "KVDEPOT_DISK_DIR": "/tmp"})
    assert cfg.host_gib > 0, where


def connector_address(text: str) -> str:
    conf = json.loads(re.search(r"--kv-transfer-config[ =]'?(\{.*\})'?", text, re.S).group(1))  # type: ignore[union-attr]
    assert conf["kv_connector"] == "KvDepotConnector" and conf["kv_connector_module_path"] == "kvdepot.vllm"
    return conf["kv_connector_extra_config"]["address"]  # type: ignore[no-any-return]


def test_the_image_serves_the_socket_the_engines_use() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "unix:/run/kvdepot/kvdepotd.sock" in dockerfile and "EXPOSE 50061 50062 9464" in dockerfile


def test_compose_file() -> None:
    compose: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    daemon, engine = compose["services"]["kvdepotd"], compose["services"]["engine"]
    check_daemon_env(daemon["environment"], "compose kvdepotd")
    assert "kvdepot-sock:/run/kvdepot" in daemon["volumes"] and "kvdepot-sock:/run/kvdepot" in engine["volumes"]
    assert "kvdepot-disk:/var/lib/kvdepot" in daemon["volumes"] and daemon["environment"]["KVDEPOT_DISK_DIR"] == "/var/lib/kvdepot"
    assert connector_address(engine["command"]) == SOCKET
    assert engine["depends_on"]["kvdepotd"]["condition"] == "service_healthy"
    assert engine["build"]["dockerfile"] == "deploy/engine.Dockerfile" and (ROOT / engine["build"]["dockerfile"]).exists()


def test_kubernetes_pod() -> None:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "kvdepot-engine.yaml").read_text())
    pod = doc["spec"]["template"]["spec"]
    (daemon,) = pod["initContainers"]
    (engine,) = pod["containers"]
    assert daemon["restartPolicy"] == "Always"  # a native sidecar: up before the engine, down after it
    check_daemon_env({e["name"]: e["value"] for e in daemon["env"]}, "kubernetes kvdepotd")
    volumes = {v["name"]: v for v in pod["volumes"]}
    claims = {c["metadata"]["name"] for c in doc["spec"]["volumeClaimTemplates"]}

    def mounts(c: dict[str, Any]) -> dict[str, str]:
        out = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        for name in out.values():
            assert name in volumes or name in claims, (c["name"], name)
        return out

    d, e = mounts(daemon), mounts(engine)
    assert d["/run/kvdepot"] == e["/run/kvdepot"] and "emptyDir" in volumes[d["/run/kvdepot"]]
    assert volumes[d["/dev/shm"]]["emptyDir"]["medium"] == "Memory" and volumes[e["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert d["/var/lib/kvdepot"] in claims
    assert connector_address(" ".join(engine["args"])) == SOCKET
    assert daemon["securityContext"]["runAsUser"] == 10001 and 10001 in pod["securityContext"]["supplementalGroups"]
    ports = {p["name"]: p["containerPort"] for p in daemon["ports"]}
    assert ports == {"grpc": 50061, "metrics": 9464} and daemon["livenessProbe"]["grpc"]["port"] == 50061
    assert pod["terminationGracePeriodSeconds"] >= 30


def test_grafana_dashboard_is_well_formed() -> None:
    """What Grafana's import needs (the queries themselves run against a real Prometheus in CI's
    monitoring stage): unique panel ids, panels that do not overlap, every query on the chosen
    data source and daemon."""
    dash: dict[str, Any] = json.loads((ROOT / "deploy" / "grafana" / "kvdepot.json").read_text())
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}" and 'instance=~"$instance"' in t["expr"], (p["title"], t["expr"])
    names = {v["name"] for v in dash["templating"]["list"]}
    assert names == {"datasource", "instance"}
