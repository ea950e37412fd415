"""The import graph of guard, journal and cli: no circle anywhere, and one direction, cli -> journal -> guard."""

from __future__ import annotations

import itertools

import grimp
import pytest

PACKAGES = ("guard", "journal", "cli")

# What each package must never import, at any depth: guard is the pure core, journal is storage under it.
FORBIDDEN = {"guard": ("journal", "cli"), "journal": ("cli",)}


def build(*, type_checking: bool) -> grimp.ImportGraph:
    # Imports inside functions count: a circle closed when a function runs is still a circle.
    # cache_dir=None: nothing written beside the checkout.
    return grimp.build_graph(*PACKAGES, exclude_type_checking_imports=not type_checking, cache_dir=None)


@pytest.fixture(scope="module")
def run_time_graph() -> grimp.ImportGraph:
    """The imports Python runs: an import under ``if TYPE_CHECKING:`` never does, so it closes no circle."""
    return build(type_checking=False)


@pytest.fixture(scope="module")
def whole_graph() -> grimp.ImportGraph:
    """Every import, the type-only ones too: guard naming a type of journal's still leans on journal."""
    return build(type_checking=True)


def circles(graph: grimp.ImportGraph) -> list[set[str]]:
    """The sets of modules that import each other: a module is in one with each module it imports,
    at any depth, that imports it back, at any depth (or alone, when it imports itself)."""
    found: list[set[str]] = []
    for module in sorted(graph.modules):
        if any(module in members for members in found):
            continue
        members = graph.find_upstream_modules(module) & graph.find_downstream_modules(module)
        if members or graph.direct_import_exists(importer=module, imported=module):
            found.append(members | {module})
    return found


def loops(graph: grimp.ImportGraph, members: set[str]) -> list[tuple[str, ...]]:
    """Shortest circles through ``members`` until each of them is on one shown: the imports that close
    each circle, without every other way round it. A circle starts at its first module by name."""
    every: set[tuple[str, ...]] = set()
    for importer in members:
        for imported in graph.find_modules_directly_imported_by(importer) & members:
            back = graph.find_shortest_chain(importer=imported, imported=importer) or ()
            chain = (importer, *back[:-1])  # the chain back ends where this import starts
            start = chain.index(min(chain))
            every.add(chain[start:] + chain[:start])
    shown: list[tuple[str, ...]] = []
    for chain in sorted(every, key=lambda chain: (len(chain), chain)):
        if not set(chain) <= {module for kept in shown for module in kept}:
            shown.append(chain)
    return shown


def described(graph: grimp.ImportGraph, importer: str, imported: str) -> str:
    """``importer:LINE  import statement  -> imported``, for each line that makes the import."""
    details = graph.get_import_details(importer=importer, imported=imported)
    return "\n".join(f"    {importer}:{d['line_number']}  {d['line_contents']}  -> {imported}" for d in details)


def test_no_module_imports_itself_through_others(run_time_graph: grimp.ImportGraph) -> None:
    report = []
    for members in sorted(circles(run_time_graph), key=min):
        for chain in loops(run_time_graph, members):
            closed = (*chain, chain[0])
            lines = (described(run_time_graph, a, b) for a, b in itertools.pairwise(closed))
            report.append("\n".join((" -> ".join(closed), *lines)))
    assert not report, "import circles, each with the lines that make its imports:\n" + "\n".join(report)


def test_imports_run_one_way_cli_journal_guard(whole_graph: grimp.ImportGraph) -> None:
    report = []
    for importer in sorted(whole_graph.modules):
        forbidden = FORBIDDEN.get(importer.partition(".")[0], ())
        for imported in sorted(whole_graph.find_modules_directly_imported_by(importer)):
            # A chain through another module starts with a direct import out of the package, which is
            # itself one of these: checking each direct import checks every chain.
            if imported.partition(".")[0] in forbidden:
                report.append(described(whole_graph, importer, imported))
    assert not report, "imports against cli -> journal -> guard:\n" + "\n".join(report)


def test_a_circle_is_found_and_shown_with_its_lines() -> None:
    graph = grimp.ImportGraph()
    for module in ("pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d"):
        graph.add_module(module)
    for importer, imported, line in (("pkg.a", "pkg.b", 3), ("pkg.b", "pkg.c", 4), ("pkg.c", "pkg.a", 9),
                                     ("pkg.c", "pkg.d", 5)):
        graph.add_import(importer=importer, imported=imported, line_number=line,
                         line_contents=f"from . import {imported[-1]}")

    assert circles(graph) == [{"pkg.a", "pkg.b", "pkg.c"}]
    assert loops(graph, {"pkg.a", "pkg.b", "pkg.c"}) == [("pkg.a", "pkg.b", "pkg.c")]
    assert described(graph, "pkg.c", "pkg.a") == "    pkg.c:9  from . import a  -> pkg.a"
