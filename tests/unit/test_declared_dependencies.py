"""Every module that ``src/`` or ``tests/`` imports comes from a dependency that pyproject.toml
declares: ``src/`` from ``[project] dependencies``, ``tests/`` from those plus the ``dev`` extra.

A module that only the developer's own site-packages happens to provide (numpy once did) would
pass here and fail on a fresh machine; this test fails on the developer's machine instead. It reads
every import statement, at module level or inside a function, with ``ast``.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCAL = {"aivedio", "tests"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    assert match, f"unreadable requirement {spec!r}"
    return canonical(match.group(1))


def declared() -> tuple[set[str], set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {requirement_name(s) for s in project["dependencies"]}
    dev = {requirement_name(s) for s in project["optional-dependencies"]["dev"]}
    return runtime, runtime | dev


def imported_modules(files: Iterable[Path]) -> Iterator[tuple[str, Path, int]]:
    """(top-level module, file, line) of every absolute import."""
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield alias.name.split(".")[0], path, node.lineno
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                yield node.module.split(".")[0], path, node.lineno


def third_party(folder: str) -> dict[str, tuple[Path, int]]:
    found: dict[str, tuple[Path, int]] = {}
    for module, path, line in imported_modules(sorted((ROOT / folder).rglob("*.py"))):
        if module in LOCAL or module in sys.stdlib_module_names or module == "__future__":
            continue
        found.setdefault(module, (path.relative_to(ROOT), line))
    return found


def providers(module: str) -> set[str]:
    return {canonical(d) for d in importlib.metadata.packages_distributions().get(module, [])}


@pytest.mark.parametrize(
    ("folder", "which"),
    [("src", "dependencies"), ("tests", "dependencies + the dev extra")],
)
def test_every_import_is_provided_by_a_declared_dependency(folder: str, which: str) -> None:
    runtime, with_dev = declared()
    allowed = runtime if folder == "src" else with_dev
    problems = []
    for module, (path, line) in sorted(third_party(folder).items()):
        dists = providers(module)
        if not dists:
            problems.append(f"{path}:{line}: {module} is not provided by any installed package")
        elif not dists & allowed:
            problems.append(
                f"{path}:{line}: {module} comes from {sorted(dists)}, which {which} do not name"
            )
    assert not problems, "\n".join(problems)


def test_the_scan_sees_imports_inside_functions(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    import numpy.linalg\n    from yaml import safe_load\n")
    assert [m for m, _, _ in imported_modules([source])] == ["numpy", "yaml"]
