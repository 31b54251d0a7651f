"""The core imports only pure standard-library modules (import-linter checks third-party and
project modules; it cannot see the standard library, so this test does)."""

from __future__ import annotations

import ast
import pathlib

import kvdepotd.core

PURE_STDLIB = {"__future__", "abc", "collections", "dataclasses", "enum", "heapq", "typing"}


def test_core_imports_only_pure_modules() -> None:
    root = pathlib.Path(kvdepotd.core.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                ok = top in PURE_STDLIB or name.startswith("kvdepotd.core") or name in ("kvdepot.hashing", "kvdepot.layout")
                assert ok, f"{path.name} imports {name}: the core must stay free of I/O, clocks and RPC"
