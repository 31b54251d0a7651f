"""Each core module's docstring lists exactly the primitives that exist: every public method of
its main class is named there, and every `name(` the docstring names exists. Read from the
sources beside the package (a compiled core keeps no docstrings)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import kvdepotd.core

CASES = [("depot", "Depot"), ("disk", "DiskPlanner"), ("plan", "OpPlanner"), ("registry", "BlockRegistry"), ("ops", "OpTable"), ("pool", "BlockPool")]


@pytest.mark.parametrize(("module", "cls"), CASES, ids=[c for _, c in CASES])
def test_the_docstring_names_the_primitives_that_exist(module: str, cls: str) -> None:
    tree = ast.parse((pathlib.Path(kvdepotd.core.__file__).parent / f"{module}.py").read_text())
    doc = ast.get_docstring(tree) or ""
    [klass] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    methods = {n.name for n in klass.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    public = {n for n in methods if not n.startswith("_")}
    missing = {n for n in public if not re.search(rf"\b{n}\b", doc)}
    assert not missing, f"{module}.py does not list {sorted(missing)}"
    defined = methods | {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    unknown = {n for n in re.findall(r"\b([a-z_][a-z0-9_]*)\(", doc) if n not in defined}
    assert not unknown, f"{module}.py lists {sorted(unknown)}, which do not exist"
