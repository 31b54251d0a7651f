"""No module of the daemon or the client takes part in an import circle. Every import counts, a
deferred one inside a function and one under TYPE_CHECKING too: a circle hidden that way is still a
knot a reader has to untie (import-linter's layers see only imports across layers)."""

from __future__ import annotations

import grimp


def cycles(package: str) -> list[list[str]]:
    graph = grimp.build_graph(package)
    found = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            path = graph.find_shortest_chain(importer=imported, imported=module)
            if path is not None:
                found.append([module, *path])
    return found


def test_the_daemon_has_no_import_circle() -> None:
    assert cycles("kvdepotd") == []


def test_the_client_has_no_import_circle() -> None:
    assert cycles("kvdepot") == []
