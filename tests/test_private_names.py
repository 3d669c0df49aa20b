"""No package of ``aioexperts`` uses another package's private (``_``-prefixed) names.

A *package* is a folder of ``aioexperts`` (``_io``, ``_format``, ``_model``, ``serve``, ...; its
sub-folders belong to it); the modules directly in ``aioexperts/`` (``_runner.py``, ``_store.py``,
...) form the root package. Found statically (``ast``), in every module of ``aioexperts/``:

- ``from M import _name`` (relative imports resolved) where ``M`` is in another package;
- ``alias._name`` where ``alias`` is bound to a module of another package (``import M as alias``,
  ``from P import module``);
- ``obj._name`` on any other object (not ``self`` or ``cls``) where ``_name`` is defined (a def, a
  class, an assignment, a ``self._name =``) only in other packages: ``executor._run_calls`` in
  ``_model`` would use the root package's ``LocalExecutor._run_calls``.

A package's own module-private names (``from .x import _y`` inside ``_format``) are its business, and
a module is not a name here (``from aioexperts import _json``: the layout's ``_`` modules are what
the import rules of tests/test_import_rules.py govern).
Today's uses are listed in ``tests/private_names_allowed.txt``, one per line with its reason; a new
one fails :func:`test_no_new_private_name_across_packages`, and an entry that no longer occurs fails
:func:`test_the_allow_list_has_no_stale_entry` (the list only shrinks).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "aioexperts"
ALLOW_LIST = Path(__file__).resolve().parent / "private_names_allowed.txt"
ROOT = "aioexperts"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of_module(module: str) -> str | None:
    """The package of a dotted module name under ``aioexperts``; None outside ``aioexperts``."""
    parts = module.split(".")
    if parts[0] != ROOT:
        return None
    if len(parts) > 1 and (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return ROOT


def _package_of_path(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else ROOT


def _is_module(module: str) -> bool:
    rel = Path(*module.split(".")[1:]) if "." in module else Path()
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _defined_private_names(tree: ast.AST) -> Iterator[str]:
    """Private names a module defines: defs, classes, assignment targets, ``self._x = ...``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if _is_private(node.name):
                yield node.name
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            if _is_private(node.id):
                yield node.id
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if _is_private(node.attr):
                yield node.attr
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if _is_private(node.target.id):
                yield node.target.id


@functools.cache
def _parse(path: Path, text: str) -> ast.AST:
    return ast.parse(text, str(path))


def _sources(extra: dict[Path, str] | None = None) -> dict[Path, ast.AST]:
    texts = {p: p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
    texts.update(extra or {})
    return {p: _parse(p, t) for p, t in texts.items()}


def _uses(extra: dict[Path, str] | None = None) -> set[str]:
    """Every cross-package use, as ``"file: package.name"`` (the package whose private name it is)."""
    trees = _sources(extra)
    defined: dict[str, set[str]] = {}  # private name -> packages that define it
    for path, tree in trees.items():
        for name in _defined_private_names(tree):
            defined.setdefault(name, set()).add(_package_of_path(path))
    found: set[str] = set()
    for path, tree in trees.items():
        mine = _package_of_path(path)
        where = path.relative_to(PACKAGE.parent).as_posix()
        modules: dict[str, str] = {}  # local alias -> package of the module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    package = _package_of_module(alias.name)
                    if package is not None and alias.asname is not None:
                        modules[alias.asname] = package
            elif isinstance(node, ast.ImportFrom):
                module = _resolve(path, node)
                package = _package_of_module(module)
                if package is None:
                    continue
                for alias in node.names:
                    if _is_module(f"{module}.{alias.name}"):  # a module, private ones (_json) included
                        modules[alias.asname or alias.name] = _package_of_module(f"{module}.{alias.name}") or package
                    elif _is_private(alias.name) and package != mine:
                        found.add(f"{where}: {package}.{alias.name}")
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in modules:
                if modules[value.id] != mine:
                    found.add(f"{where}: {modules[value.id]}.{node.attr}")
                continue
            if isinstance(value, ast.Name) and value.id in {"self", "cls"}:
                continue
            owners = defined.get(node.attr, set())
            if owners and mine not in owners:
                found.add(f"{where}: {'|'.join(sorted(owners))}.{node.attr}")
    return found


def _allowed() -> dict[str, str]:
    """The allow-list: ``"file: package.name"`` -> its reason (``  # reason`` after the entry)."""
    allowed: dict[str, str] = {}
    for number, line in enumerate(ALLOW_LIST.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        entry, sep, reason = line.partition("  # ")
        assert sep and reason.strip(), f"{ALLOW_LIST.name}:{number}: an entry needs a reason after '  # '"
        assert entry not in allowed, f"{ALLOW_LIST.name}:{number}: {entry} is listed twice"
        allowed[entry.strip()] = reason.strip()
    return allowed


def test_no_new_private_name_across_packages() -> None:
    new = sorted(_uses() - set(_allowed()))
    assert not new, (
        "a package uses another package's private names (give it a public name, or move the code; "
        f"an exception goes into {ALLOW_LIST.name} with its reason):\n" + "\n".join(new)
    )


def test_the_allow_list_has_no_stale_entry() -> None:
    stale = sorted(set(_allowed()) - _uses())
    assert not stale, f"no longer used: remove from {ALLOW_LIST.name}:\n" + "\n".join(stale)


def test_the_checker_finds_each_kind_of_use() -> None:
    """The checker itself: an import, a module attribute and an object attribute are each reported."""
    probe = PACKAGE / "serve" / "_probe.py"
    source = (
        "from aioexperts._model.model import _record_of_probe\n"
        "from aioexperts._model import model as m\n"
        "import aioexperts._runner as r\n"
        "def f(runner, x):\n"
        "    m._private_probe\n"
        "    r._other_probe\n"
        "    return runner._run_calls(x)\n"
    )
    found = {u for u in _uses({probe: source}) if u.startswith("aioexperts/serve/_probe.py:")}
    assert found == {
        "aioexperts/serve/_probe.py: _model._record_of_probe",
        "aioexperts/serve/_probe.py: _model._private_probe",
        "aioexperts/serve/_probe.py: aioexperts._other_probe",
        "aioexperts/serve/_probe.py: aioexperts._run_calls",
    }


def test_a_package_s_own_private_names_are_its_business() -> None:
    probe = PACKAGE / "_model" / "_probe.py"
    source = "from aioexperts._model.model import _x\nfrom . import residual\ndef f(w):\n    return residual._y, w._z\n"
    assert not {u for u in _uses({probe: source}) if u.startswith("aioexperts/_model/_probe.py:")}
