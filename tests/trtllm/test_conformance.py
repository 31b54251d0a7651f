"""The stand-ins (kvdepot.testing.trtllm) against TensorRT-LLM's own module: fields, defaults and
abstract methods. Runs wherever `tensorrt_llm` imports (a CUDA machine with its wheel), skipped
elsewhere; the last test pins what the connector relies on either way."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from kvdepot.testing import trtllm as stand_in
from kvdepot.trtllm import api

real = api.real_module()
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
