"""Each core module's docstring lists exactly the primitives that exist: every public method of
its main class is named there, and every `name(` the docstring names exists."""

from __future__ import annotations

import re

import pytest

from kvdepotd.core import depot, disk, ops, plan, pool, registry

CASES = [
    (depot, depot.Depot),
    (disk, disk.DiskPlanner),
    (plan, plan.OpPlanner),
    (registry, registry.BlockRegistry),
    (ops, ops.OpTable),
    (pool, pool.BlockPool),
]


@pytest.mark.parametrize(("module", "cls"), CASES, ids=[c.__name__ for _, c in CASES])
def test_the_docstring_names_the_primitives_that_exist(module: object, cls: type) -> None:
    doc = module.__doc__ or ""
    public = {n for n in vars(cls) if not n.startswith("_")}
    missing = {n for n in public if not re.search(rf"\b{n}\b", doc)}
    assert not missing, f"{module.__name__} does not list {sorted(missing)}"
    named = set(re.findall(r"\b([a-z_][a-z0-9_]*)\(", doc))
    unknown = {n for n in named if not hasattr(cls, n) and not hasattr(module, n)}
    assert not unknown, f"{module.__name__} lists {sorted(unknown)}, which do not exist"
