"""Import circles that were broken stay broken, counting every import: those under ``if TYPE_CHECKING:`` and
inside functions too, which import-linter does not see here (``exclude_type_checking_imports``)."""

from __future__ import annotations

import ast
from itertools import permutations
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Modules that once imported one another. The attention backend now names the device it allocates on by a
# protocol (``engine.attention.backend.CacheMemory``); the request and beam search share ``FinishReason``
# from ``engine.core.finish_reason``, and rewriting beams' blocks lives with the scheduler (``beam_groups``).
GROUPS = [
    ("engine.attention.backend", "engine.device.base"),
    ("engine.core.request", "engine.core.beam", "engine.core.block_manager"),
]


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Each module of ``package`` (under ``root``) -> the modules of the package it imports, anywhere in its file."""
    files: dict[str, Path] = {}
    for path in (root / package).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:   # relative: from the module's package, less one level per extra dot
                    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)   # ``from pkg import module``
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def import_path(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A chain of imports from ``start`` to ``goal`` (both included), or None."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        module = frontier.pop()
        for target in sorted(graph.get(module, ())):
            if target == goal:
                chain = [goal, module]
                while chain[-1] != start:
                    chain.append(came_from[chain[-1]])
                return chain[::-1]
            if target not in came_from and target != start:
                came_from[target] = module
                frontier.append(target)
    return None


def circles(graph: dict[str, set[str]], group: tuple[str, ...]) -> list[str]:
    """Each import circle through two modules of ``group``, written ``a -> ... -> b -> ... -> a``."""
    found = []
    for a, b in permutations(group, 2):
        there, back = import_path(graph, a, b), import_path(graph, b, a)
        if a < b and there and back:
            found.append(" -> ".join(there + back[1:]))
    return found


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: " | ".join(m.rsplit(".", 1)[-1] for m in g))
def test_no_import_circle(group: tuple[str, ...]) -> None:
    graph = import_graph(ROOT, "engine")
    assert all(module in graph for module in group)   # a renamed module must not pass this test by vanishing
    assert circles(graph, group) == []


def test_a_circle_through_type_checking_imports_is_found(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from typing import TYPE_CHECKING\n"
                                           "if TYPE_CHECKING:\n    from pkg.b import B\n")
    (tmp_path / "pkg" / "b.py").write_text("from . import c\n")
    (tmp_path / "pkg" / "c.py").write_text("def f():\n    import pkg.a\n")
    graph = import_graph(tmp_path, "pkg")
    assert circles(graph, ("pkg.a", "pkg.b")) == ["pkg.a -> pkg.b -> pkg.c -> pkg.a"]
