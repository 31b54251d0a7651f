"""The docs say what the code does: every option, connector key and metric is documented, the
results table is what bench/report.py renders, the README stays a short guide, and every relative
link lands on a file and heading that exist. (The README's quickstart itself runs in
tests/integration/test_readme.py.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from kvdepot.connector.config import KEYS
from kvdepotd import config
from kvdepotd.core.depot import Depot, DepotConfig
from kvdepotd.core.records import COUNTERS
from kvdepotd.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))


def text(name: str) -> str:
    return (ROOT / name).read_text()


def test_the_readme_is_a_short_guide_that_starts_with_the_two_commands() -> None:
    lines = text("README.md").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move reference material to docs/"
    head = "\n".join(lines[:6])
    assert "scripts/kvdepotd" in head and "scripts/test" in head


def test_every_daemon_option_is_in_the_operations_table() -> None:
    ops = text("docs/operations.md")
    for name in config.HELP:
        assert f"| `{name}` |" in ops, f"docs/operations.md's configuration table lacks {name}"


def test_every_connector_key_is_in_the_vllm_table() -> None:
    doc = text("docs/vllm.md")
    for key in KEYS:
        assert f"| `{key}` |" in doc, key


def test_every_metric_is_in_the_operations_doc() -> None:
    ops = text("docs/operations.md")
    registry = Metrics(Depot(DepotConfig(host_bytes=1 << 20))).registry
    names = {m.name for m in registry.collect()}
    core = {f"kvdepot_{c}" for c in COUNTERS}
    assert core <= names
    for name in sorted(names - core):
        assert re.search(rf"`{name}(_total)?`", ops), f"docs/operations.md does not describe {name}"
    for c in COUNTERS:
        assert f"`{c}`" in ops, f"docs/operations.md's counter table lacks {c}"


def test_the_results_tables_are_what_report_renders() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import report
    finally:
        sys.path.pop(0)
    rendered = report.table()
    for path in report.DOCS:
        doc = path.read_text()
        start, end = doc.index(report.BEGIN) + len(report.BEGIN), doc.index(report.END)
        assert doc[start:end].strip() == rendered, f"{path.name}: run .venv/bin/python bench/report.py --write"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        assert dest.exists(), f"{doc.name} links to {target}, which does not exist"
        if anchor and dest.suffix == ".md":
            headings = {slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}
            assert anchor in headings, f"{doc.name} links to {target}: no such heading in {dest.name}"
