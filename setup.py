"""Builds the daemon's native parts: its pure core (kvdepotd.core) into C extensions with mypyc
(the same source, type-checked by the same mypy, and less time per Step), and the block copy of
its data path (kvdepotd/transfer/_blockcopy.c: a copy and its checksum in one pass over memory).
docs/performance.md has what each is worth.

KVDEPOT_COMPILE decides, when a wheel is built (`pip install .`, `pip wheel .`):
    auto (default)  compile; without a working C compiler install the plain Python core and the
                    torch copy path instead
    1               compile, and fail the build when that is not possible (the container image)
    0               never compile
An editable install (`pip install -e .`, what scripts/bootstrap makes) never compiles: the source
you edit must be what runs. scripts/build-compiled builds a compiled copy of this checkout.
Everything else is in pyproject.toml.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup

CORE = [f"server/kvdepotd/core/{m}.py" for m in ("slots", "rows", "ops", "pool", "registry", "disk", "records", "lookup", "plan", "audit", "depot")]


def extensions() -> list:
    mode = os.environ.get("KVDEPOT_COMPILE", "auto").strip().lower()
    if mode not in ("auto", "1", "0"):
        sys.exit(f"KVDEPOT_COMPILE must be auto, 1 or 0, not {mode!r}")
    if mode == "0" or "editable_wheel" in sys.argv:
        return []
    exts = [Extension("kvdepotd.transfer._blockcopy", ["server/kvdepotd/transfer/_blockcopy.c"], extra_compile_args=["-O2"])]
    try:
        from mypyc.build import mypycify
    except ImportError:
        if mode == "1":
            raise
        print("kvdepot: mypy/mypyc is not installed; the core stays plain Python", file=sys.stderr)
    else:
        exts += mypycify(CORE, opt_level="3")
    for ext in exts:
        ext.optional = mode == "auto"  # build_ext skips an optional extension its compiler cannot build
    return exts


setup(ext_modules=extensions())
