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


def manifests(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / name).read_text()) if d]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


# The "restricted" Pod Security Standard (kubernetes.io/docs/concepts/security/pod-security-standards),
# the checks a pod's spec can fail, field by field.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret", "name"}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    out = [f"pod: {k}" for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]
    for v in pod.get("volumes", []):
        out += [f"volume {v['name']}: {k}" for k in set(v) - RESTRICTED_VOLUMES]
    psc = pod.get("securityContext", {})
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc, where = c.get("securityContext", {}), f"container {c['name']}"
        if sc.get("privileged"):
            out.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: capabilities must drop ALL and add at most NET_BIND_SERVICE")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")) or sc.get("runAsUser", psc.get("runAsUser", 1)) == 0:
            out.append(f"{where}: may run as root")
        if sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type") not in ("RuntimeDefault", "Localhost"):
            out.append(f"{where}: no seccomp profile")
        out += [f"{where}: hostPort" for p in c.get("ports", []) if p.get("hostPort")]
    return out


def gib(quantity: str) -> float:
    units = {"Mi": 1 / 1024, "Gi": 1.0}
    return float(quantity[:-2]) * units[quantity[-2:]]


def check_daemon_container(daemon: dict[str, Any], pod: dict[str, Any], annotations: dict[str, str]) -> None:
    env = {e["name"]: e["value"] for e in daemon["env"]}
    check_daemon_env(env, daemon["name"])
    assert env["KVDEPOT_LISTEN"] == SOCKET  # no TCP gRPC: nothing off the socket can call Clear
    for probe in ("startupProbe", "livenessProbe"):
        assert daemon[probe]["exec"]["command"] == ["kvdepotd", "health", SOCKET]  # over the socket: right with TLS on TCP
    assert {p["name"]: p["containerPort"] for p in daemon["ports"]} == {"metrics": 9464}
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "9464"
    res = daemon["resources"]
    assert res["requests"]["memory"] == res["limits"]["memory"] and "cpu" in res["requests"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm = volumes[{m["mountPath"]: m["name"] for m in daemon["volumeMounts"]}["/dev/shm"]]["emptyDir"]
    host_gib = float(env["KVDEPOT_HOST_GIB"])
    assert shm["medium"] == "Memory" and host_gib <= gib(shm["sizeLimit"]) <= host_gib + 1
    assert gib(res["limits"]["memory"]) >= host_gib + 1.5  # the tier's pages count as the container's memory
    assert daemon["securityContext"]["runAsUser"] == 10001 and daemon["securityContext"]["readOnlyRootFilesystem"]


def check_engine_container(engine: dict[str, Any], pod: dict[str, Any]) -> None:
    assert connector_address(" ".join(engine["args"])) == SOCKET
    res = engine["resources"]
    assert res["requests"]["memory"] == res["limits"]["memory"] and "cpu" in res["requests"]
    assert engine["securityContext"]["runAsUser"] != 0 and 10001 in pod["securityContext"]["supplementalGroups"]  # may connect
    assert {"livenessProbe", "readinessProbe", "startupProbe"} <= set(engine)


def network_policy_ports(docs: list[dict[str, Any]], labels: dict[str, str]) -> set[int]:
    ports = set()
    for np in of_kind(docs, "NetworkPolicy"):
        if np["spec"]["podSelector"]["matchLabels"].items() <= labels.items():
            assert np["spec"]["policyTypes"] == ["Ingress"]
            ports |= {p["port"] for rule in np["spec"]["ingress"] for p in rule["ports"]}
    return ports


def test_kubernetes_sidecar_pod() -> None:
    docs = manifests("kvdepot-engine.yaml")
    (sts,) = of_kind(docs, "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    (daemon,) = pod["initContainers"]
    (engine,) = pod["containers"]
    assert daemon["restartPolicy"] == "Always"  # a native sidecar: up before the engine, down after it
    assert restricted_violations(pod) == []
    check_daemon_container(daemon, pod, sts["spec"]["template"]["metadata"]["annotations"])
    check_engine_container(engine, pod)
    volumes = {v["name"]: v for v in pod["volumes"]}
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}

    def mounts(c: dict[str, Any]) -> dict[str, str]:
        out = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        for name in out.values():
            assert name in volumes or name in claims, (c["name"], name)
        return out

    d, e = mounts(daemon), mounts(engine)
    assert d["/run/kvdepot"] == e["/run/kvdepot"] and "emptyDir" in volumes[d["/run/kvdepot"]]
    assert volumes[e["/dev/shm"]]["emptyDir"]["medium"] == "Memory" and d["/var/lib/kvdepot"] in claims
    assert pod["terminationGracePeriodSeconds"] >= 30 and pod["enableServiceLinks"] is False
    (svc,) = of_kind(docs, "Service")
    assert svc["metadata"]["name"] == sts["spec"]["serviceName"] and svc["spec"]["clusterIP"] == "None"  # the StatefulSet's governing Service
    assert network_policy_ports(docs, sts["spec"]["template"]["metadata"]["labels"]) == {8000, 9464}


def test_kubernetes_daemon_per_node() -> None:
    """One daemon per node, engines in other pods reaching it through the node's socket folder: a
    hostPath, which the namespace admits (privileged) while warning and auditing at restricted, the
    one thing short of the restricted standard."""
    docs = manifests("kvdepot-node.yaml")
    (ns,) = of_kind(docs, "Namespace")
    labels = ns["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/warn"] == labels["pod-security.kubernetes.io/audit"] == "restricted"
    (ds,) = of_kind(docs, "DaemonSet")
    (dep,) = of_kind(docs, "Deployment")
    dpod, epod = ds["spec"]["template"]["spec"], dep["spec"]["template"]["spec"]
    assert sorted(restricted_violations(dpod)) == [
        "container own-folders: capabilities must drop ALL and add at most NET_BIND_SERVICE", "container own-folders: may run as root",
        "volume disk: hostPath", "volume sockets: hostPath",
    ]
    assert restricted_violations(epod) == ["volume sockets: hostPath"]
    # The kubelet makes a hostPath folder root's (0755) and fsGroup skips it: the init container
    # gives both folders to the daemon's user before it starts.
    (owner,) = dpod["initContainers"]
    assert "chown 10001:10001 /run/kvdepot /var/lib/kvdepot" in owner["command"][-1] and set(owner["securityContext"]["capabilities"]["add"]) == {"CHOWN", "FOWNER"}
    assert {m["mountPath"] for m in owner["volumeMounts"]} == {"/run/kvdepot", "/var/lib/kvdepot"}
    assert dpod["nodeSelector"] == epod["nodeSelector"]  # engines only where a daemon runs
    assert dpod["enableServiceLinks"] is False and epod["enableServiceLinks"] is False
    (daemon,) = dpod["containers"]
    (engine,) = epod["containers"]
    check_daemon_container(daemon, dpod, ds["spec"]["template"]["metadata"]["annotations"])
    check_engine_container(engine, epod)
    host = {v["name"]: v for v in dpod["volumes"]}["sockets"]["hostPath"]["path"]
    assert {v["name"]: v for v in epod["volumes"]}["sockets"]["hostPath"]["path"] == host
    assert {m["name"]: m["mountPath"] for m in daemon["volumeMounts"]}["sockets"] == "/run/kvdepot"
    assert {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}["sockets"] == "/run/kvdepot"
    assert network_policy_ports(docs, ds["spec"]["template"]["metadata"]["labels"]) == {9464}
    assert all(d["metadata"].get("namespace") == "kvdepot" for d in docs if d["kind"] != "Namespace")


def test_the_restricted_check_finds_what_the_standard_refuses() -> None:
    docs = manifests("kvdepot-engine.yaml")
    pod = of_kind(docs, "StatefulSet")[0]["spec"]["template"]["spec"]
    pod["containers"][0]["securityContext"].pop("allowPrivilegeEscalation")
    pod["initContainers"][0]["securityContext"]["capabilities"] = {"add": ["SYS_ADMIN"]}
    pod["securityContext"].pop("seccompProfile")
    pod["hostIPC"] = True
    assert sorted(restricted_violations(pod)) == [
        "container engine: allowPrivilegeEscalation is not false", "container engine: no seccomp profile",
        "container kvdepotd: capabilities must drop ALL and add at most NET_BIND_SERVICE", "container kvdepotd: no seccomp profile", "pod: hostIPC",
    ]


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
