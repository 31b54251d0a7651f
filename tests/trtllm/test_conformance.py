"""The stand-ins (kvdepot.testing.trtllm) and the connector against TensorRT-LLM's own API.

CI cannot install TensorRT-LLM (its PyPI entry is a placeholder that fetches the real wheel from
NVIDIA's index), so trtllm_api_record.json records the API as TensorRT-LLM's sources have it at
named commits (classes, fields and defaults, methods and their parameters, which are abstract),
transcribed from those sources. The stand-ins must be the newest recorded release exactly, and the
connector must implement every recorded release: the day either drifts from the record, CI fails.
Where `tensorrt_llm` imports (a CUDA machine with its wheel), the stand-ins are compared with the
real module as well."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from kvdepot.testing import trtllm as stand_in
from kvdepot.trtllm import api

real = api.real_module()
RECORD = json.loads((Path(__file__).parent / "trtllm_api_record.json").read_text())
VERSIONS = RECORD["versions"]
NEWEST = list(VERSIONS)[-1]
needs_real = pytest.mark.skipif(real is None, reason="tensorrt_llm does not import here (its wheel needs CUDA; PyPI has a stub)")


def _fields(cls: type) -> list[tuple[str, Any]]:
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default: Any = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "<required>"
        out.append((f.name, default))
    return out


@needs_real
@pytest.mark.parametrize("name", ["RequestData", "SchedulerOutput"])
def test_dataclasses_match_field_for_field(name: str) -> None:
    ours, theirs = dict(_fields(getattr(stand_in, name))), dict(_fields(getattr(real, name)))
    # The same required fields in the same order; the same default wherever both have a field;
    # a field only one side has (a release older or newer than the stand-ins) has a default.
    assert [n for n, d in ours.items() if d == "<required>"] == [n for n, d in theirs.items() if d == "<required>"]
    assert {n: ours[n] for n in ours.keys() & theirs.keys()} == {n: theirs[n] for n in ours.keys() & theirs.keys()}
    assert all(d != "<required>" for n, d in {**ours, **theirs}.items() if (n in ours) != (n in theirs))


@needs_real
@pytest.mark.parametrize("name", ["KvCacheConnectorScheduler", "KvCacheConnectorWorker"])
def test_bases_have_the_same_abstract_methods_and_signatures(name: str) -> None:
    ours, theirs = getattr(stand_in, name), getattr(real, name)
    assert ours.__abstractmethods__ == theirs.__abstractmethods__
    for method in sorted(theirs.__abstractmethods__) + ["__init__"]:
        assert list(inspect.signature(getattr(ours, method)).parameters) == list(inspect.signature(getattr(theirs, method)).parameters), method


@needs_real
def test_worker_base_keeps_its_metadata_methods() -> None:
    for method in ("bind_connector_meta", "get_connector_meta", "_clear_connector_meta", "register_forward_pass_callable"):
        assert hasattr(real.KvCacheConnectorWorker, method) and hasattr(stand_in.KvCacheConnectorWorker, method)


def test_the_connector_subclasses_the_bases_in_use() -> None:
    from kvdepot.trtllm import KvDepotScheduler, KvDepotWorker

    module = real if real is not None else stand_in
    assert api.real == (real is not None)
    assert issubclass(KvDepotScheduler, module.KvCacheConnectorScheduler)
    assert issubclass(KvDepotWorker, module.KvCacheConnectorWorker)
    assert not KvDepotScheduler.__abstractmethods__ and not KvDepotWorker.__abstractmethods__
    required = [f.name for f in dataclasses.fields(stand_in.RequestData)][:5]
    assert required == ["request_id", "new_tokens", "new_block_ids", "computed_position", "num_scheduled_tokens"]


def _params(fn: Any) -> list[list[Any]]:
    """[name, default text or None] as the record writes them (stars kept on *args, **kwargs)."""
    out: list[list[Any]] = []
    for p in inspect.signature(fn).parameters.values():
        name = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name  # type: ignore[call-overload]
        out.append([name, None if p.default is p.empty else repr(p.default)])
    return out


def _own_methods(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if callable(v) or isinstance(v, (classmethod, staticmethod))}


@pytest.mark.parametrize("name", ["RequestData", "SchedulerOutput"])
def test_stand_in_data_is_the_newest_recorded_release(name: str) -> None:
    recorded = VERSIONS[NEWEST]["classes"][name]["fields"]
    theirs = [[f, "<required>" if d == "<required>" else d] for f, _, d in recorded]
    ours = [[n, d if isinstance(d, str) else ("factory:list" if d == [] else repr(d))] for n, d in _fields(getattr(stand_in, name))]
    assert ours == theirs


@pytest.mark.parametrize("name", ["KvCacheConnectorScheduler", "KvCacheConnectorWorker"])
def test_stand_in_bases_are_the_newest_recorded_release(name: str) -> None:
    """Method for method: names, parameters and their defaults, which are abstract; class flags."""
    recorded = VERSIONS[NEWEST]["classes"][name]
    cls = getattr(stand_in, name)
    assert _own_methods(cls) == set(recorded["methods"]), _own_methods(cls) ^ set(recorded["methods"])
    for method, rec in recorded["methods"].items():
        fn = vars(cls)[method]
        fn = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn
        assert _params(fn) == rec["params"], method
        assert getattr(fn, "__isabstractmethod__", False) == rec["abstract"], method
    assert cls.__abstractmethods__ == {m for m, rec in recorded["methods"].items() if rec["abstract"]}
    assert {k: repr(getattr(cls, k)) for k in recorded.get("attrs", {})} == recorded.get("attrs", {})


def test_stand_in_connector_config_is_the_newest_recorded_release() -> None:
    newest = list(RECORD["KvCacheConnectorConfig"].values())[-1]
    assert [[n, d] for n, d in _fields(stand_in.KvCacheConnectorConfig)] == [[n, None if d == "None" else d] for n, _, d in newest["fields"]]


@pytest.mark.parametrize("version", list(VERSIONS))
def test_the_connector_implements_every_recorded_release(version: str) -> None:
    """Every release's abstract methods are the connector's own, with that release's parameters;
    a method the connector overrides has the parameters of each release that has it."""
    from kvdepot.trtllm import KvDepotScheduler, KvDepotWorker

    classes = VERSIONS[version]["classes"]
    for ours, name in ((KvDepotScheduler, "KvCacheConnectorScheduler"), (KvDepotWorker, "KvCacheConnectorWorker")):
        for method, rec in classes[name]["methods"].items():
            if rec["abstract"]:
                assert method in vars(ours), f"{ours.__name__} lacks {method} ({version})"
            if method in vars(ours) and not method.startswith("__"):
                assert _params(vars(ours)[method]) == rec["params"], (version, method)
    required = [f for f, _, d in classes["RequestData"]["fields"] if d == "<required>"]
    assert required == ["request_id", "new_tokens", "new_block_ids", "computed_position", "num_scheduled_tokens"]


def test_the_record_names_its_sources() -> None:
    for label, v in VERSIONS.items():
        assert v["repo"] == "NVIDIA/TensorRT-LLM" and len(v["commit"]) == 40 and v["path"].endswith("kv_cache_connector.py"), label
