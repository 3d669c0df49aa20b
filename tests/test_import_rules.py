"""The import rules of docs/architecture.md ("Import rules"), checked on the source.

Every ``import`` of every module under ``aioexperts/`` counts, at module level, inside functions and
under ``TYPE_CHECKING`` alike. Each module belongs to one layer; a layer may import only the layers
listed for it. The optional extras are never imported at module level by the core.

The bench package ``aioexperts_bench`` lives beside ``aioexperts``: no module of ``aioexperts`` but the
bench command's own three imports it; it reaches into ``aioexperts`` through public names but for the
private modules :data:`BENCH_PRIVATE` lists with their reasons; and the bench command and the
``bench/`` scripts take it through the names of its ``__init__`` only.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "aioexperts"
BENCH_PACKAGE = REPO / "aioexperts_bench"

#: the layer of each top-level name under ``aioexperts`` (a module or a package)
LAYER_OF = {
    "_errors": "base",
    "_checks": "base",
    "_json": "base",
    "_cgroups": "base",
    "_timeline": "base",
    "_format": "format",
    "_io": "store",
    "_cache": "store",
    "_sources": "store",
    "_store": "store",
    "_rows": "store",
    "_options": "store",
    "_compute": "compute",
    "_quant": "compute",
    "_predict": "predict",
    "_batch": "runner",
    "_batcher": "runner",
    "_pipeline": "runner",
    "_runner": "runner",
    "_router": "runner",
    "_executor": "runner",
    "_tier_policy": "runner",
    "_model": "model",
    "_text": "model",
    "__init__": "public",
    "backends": "public",
    "policies": "public",
    "predictors": "public",
    "traces": "public",
    "testing": "testing",
    "cli": "commands",
    "distributed": "distributed",
    "serve": "serve",
}

#: which layers each layer may import (besides itself)
ALLOWED = {
    "base": set(),
    "format": {"base"},
    "store": {"base", "format"},
    "compute": {"base", "format"},
    "predict": {"base", "format", "compute"},
    "runner": {"base", "format", "store", "compute", "predict"},
    "model": {"base", "format", "store", "compute", "predict", "runner"},
    "public": {"base", "format", "store", "compute", "predict", "runner", "model"},
    "testing": {"base", "format", "store", "public"},
    # expert shards on Ray: a runner and a store per shard, over everything below the public face
    "distributed": {"base", "format", "store", "compute", "predict", "runner", "model", "public"},
    # the HTTP server (an optional extra) is a user of the public API
    "serve": {"public"},
    # the user commands use the public API, the server and the shards (the bench command also the bench
    # package aioexperts_bench, outside these layers: BENCH_ENTRY_POINTS)
    "commands": {"public", "testing", "distributed", "serve"},
}

#: single modules a layer may import from a layer it otherwise may not, with the reason
EXCEPTIONS = {
    # the compute pool waits on the running event loop (asyncio or trio) like the store does
    ("compute", "aioexperts._io.loop"),
    # cache simulations replay a routing trace through the store's eviction policies
    ("predict", "aioexperts._cache.eviction"),
    # the commands write JSON through the project's one strict writer (NaN and inf become null)
    ("commands", "aioexperts._json"),
    # the server writes its JSON through the same writer (a -inf logprob becomes null)
    ("serve", "aioexperts._json"),
}

#: the modules of aioexperts that may import the bench package: the bench command and its generate and timeline modes
BENCH_ENTRY_POINTS = {"aioexperts/cli/bench.py", "aioexperts/cli/bench_generate.py", "aioexperts/cli/bench_timeline.py"}

#: the public modules of aioexperts, the bench package's way in
PUBLIC_MODULES = (
    "aioexperts",
    "aioexperts.backends",
    "aioexperts.policies",
    "aioexperts.predictors",
    "aioexperts.traces",
    "aioexperts.testing",
    "aioexperts.distributed",
)

#: the private names of aioexperts the bench package still imports, by module, and why no public name serves
BENCH_PRIVATE = {
    # the bench's own JSON: the library's one strict writer (NaN and inf become null), as the commands use
    "aioexperts._json": "the strict JSON writer of the results files",
    # --queue-depth's range is the store's own bounds; the commands' model inputs name split sets as the store does
    "aioexperts._options": "MIN_QUEUE_DEPTH and MAX_QUEUE_DEPTH: the range of --queue-depth",
    "aioexperts._format.model": "split_shard_paths: the shards a model path names (fio and the replays read them all)",
    # ReadRecorder wraps the backend the store would choose itself, to record the reads it issues
    "aioexperts._io.select": "create_backend: the store's own backend selection, wrapped by ReadRecorder",
    # the generate bench's page-cache residency of the model file (mincore through the store's mapping)
    "aioexperts._io.mapping": "MappedShards, PAGE_SIZE: how much of the model is in the page cache",
    # which kernels the figures were measured with, and the int8 engine's precision switch
    "aioexperts._compute": "fused.backend(), precision(), set_precision(): the kernels measured",
    "aioexperts._compute.fused": "set_precision('int8'): the aioexperts-int8 engine of --mode generate",
    # fio's rate in the generate bench reads random experts as the store plans them (its alignment)
    "aioexperts._io.plan": "plan_expert: the aligned reads of an expert, as the store issues them",
    # --miss-tier checked against the model before a generate or timeline run (the store's own reader)
    "aioexperts._format.tier_sidecar": "read_tier_sidecar: a stale or mismatched --miss-tier refused before a run",
}

#: optional extras the core must not import at module level (one clear line when missing, at use)
OPTIONAL = ("rich", "matplotlib", "tokenizers", "jinja2", "aiohttp", "ray", "blockbuster", "llguidance")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 2:
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "public"
    layer = LAYER_OF.get(parts[1])
    if layer is None and not (PACKAGE / parts[1]).exists() and not (PACKAGE / f"{parts[1]}.py").exists():
        return "public"  # a name of aioexperts/__init__.py, such as __version__
    assert layer is not None, f"{module} is in no layer: add it to LAYER_OF and docs/architecture.md"
    return layer


def _imports(path: Path, text: str | None = None) -> Iterator[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, relative ones resolved."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    source = path.read_text() if text is None else text
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:  # ``from . import quant`` imports a module
                yield node.lineno, f"{module}.{alias.name}"


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _violations(extra: dict[Path, str] | None = None) -> list[str]:
    found = []
    sources: dict[Path, str | None] = dict.fromkeys(_sources())
    sources.update(extra or {})
    for path, text in sources.items():
        mine = _layer(_module_name(path))
        for line, target in _imports(path, text):
            if target != "aioexperts" and not target.startswith("aioexperts."):
                continue
            theirs = _layer(target)
            if theirs == mine or theirs in ALLOWED[mine] or (mine, target) in EXCEPTIONS:
                continue
            if any(target.startswith(module + ".") for layer, module in EXCEPTIONS if layer == mine):
                continue
            found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {mine} imports {theirs} ({target})")
    return found


def test_every_import_follows_the_layer_rules() -> None:
    assert _violations() == []


def test_the_store_layer_never_imports_the_compute_layer() -> None:
    """The rule docs/architecture.md leads with, spelled out on its own."""
    for path in _sources():
        if _layer(_module_name(path)) != "store":
            continue
        for line, target in _imports(path):
            assert not target.startswith(
                (
                    "aioexperts._compute",
                    "aioexperts._predict",
                    "aioexperts._runner",
                    "aioexperts._router",
                    "aioexperts._executor",
                )
            ), f"{path}:{line} imports {target}"


@pytest.mark.parametrize(
    ("where", "line"),
    [
        ("_io/probe.py", "from .._compute import fused"),
        ("_cache/probe.py", "from aioexperts._compute.fused import linear"),
        ("_format/probe.py", "from .. import _store"),
        ("_compute/probe.py", "from .._cache.cache import ExpertCache"),
    ],
)
def test_the_rules_catch_an_upward_import(where: str, line: str) -> None:
    """The checker itself: a module that imports upwards is reported (relative or absolute)."""
    found = _violations({PACKAGE / where: f"def f():\n    {line}\n"})
    assert [v for v in found if v.startswith(f"aioexperts/{where}:2:")], found


def _top_level_imports(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield node.lineno, node.module or ""


def test_the_core_imports_no_optional_extra_at_module_level() -> None:
    for path in _sources():
        if _layer(_module_name(path)) in {"commands", "bench", "serve"}:
            continue
        for line, target in _top_level_imports(path):
            assert target.split(".")[0] not in OPTIONAL, f"{path}:{line} imports the optional {target}"


@pytest.mark.parametrize("module", ["aioexperts", "aioexperts.backends", "aioexperts.testing"])
def test_the_core_imports_without_the_optional_extras(module: str) -> None:
    """With every optional extra made unimportable, the public modules still import."""
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in OPTIONAL)
    code = f"import sys; {blocked}; import {module}"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr


def _bench_sources() -> list[Path]:
    return sorted(BENCH_PACKAGE.rglob("*.py"))


def _imports_of(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module) of every import of ``path`` (under the repository), relative ones resolved."""
    rel = path.relative_to(REPO).with_suffix("")
    package = list(rel.parts[:-1])  # the package a relative import starts from (a module's or __init__'s own)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                module = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def _public_name(name: str) -> bool:
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))  # __version__ is public


def _is_bench(module: str) -> bool:
    return module == "aioexperts_bench" or module.startswith("aioexperts_bench.")


def test_no_module_of_aioexperts_imports_the_bench_package_but_the_bench_command() -> None:
    found = [
        f"{path.relative_to(REPO)}:{line}: {target}"
        for path in _sources()
        if str(path.relative_to(REPO)) not in BENCH_ENTRY_POINTS
        for line, target in _imports(path)
        if _is_bench(target)
    ]
    assert found == []


def test_the_bench_package_imports_aioexperts_through_public_names() -> None:
    """Public modules and their public names; a private one only where BENCH_PRIVATE gives the reason."""
    found = []
    for path in _bench_sources():
        for line, target in _imports_of(path):
            if target != "aioexperts" and not target.startswith("aioexperts."):
                continue
            if any(target == m or target.startswith(m + ".") for m in BENCH_PRIVATE):
                continue
            public = any(target == m for m in PUBLIC_MODULES) or any(
                target.startswith(m + ".") and _public_name(target[len(m) + 1 :]) for m in PUBLIC_MODULES
            )
            if not public:
                found.append(f"{path.relative_to(REPO)}:{line}: {target}")
    assert found == [], "a private import of the bench package: use a public name, or list it in BENCH_PRIVATE"


def test_every_listed_private_import_of_the_bench_is_still_needed() -> None:
    used = {target for path in _bench_sources() for _line, target in _imports_of(path)}
    stale = [m for m in BENCH_PRIVATE if not any(t == m or t.startswith(m + ".") for t in used)]
    assert stale == []


def _bench_users() -> list[Path]:
    return [REPO / p for p in sorted(BENCH_ENTRY_POINTS)] + sorted((REPO / "bench").glob("*.py"))


def test_the_bench_command_and_scripts_take_the_bench_package_through_its_public_names() -> None:
    """``from aioexperts_bench import NAME`` of a name of its ``__all__``; no module of it by path."""
    import aioexperts_bench

    exported = set(aioexperts_bench.__all__)
    found = []
    for path in _bench_users():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [f"{path.name}:{node.lineno}: import {a.name}" for a in node.names if _is_bench(a.name)]
            elif isinstance(node, ast.ImportFrom) and not node.level and _is_bench(node.module or ""):
                if node.module != "aioexperts_bench":
                    found.append(f"{path.name}:{node.lineno}: from {node.module}")
                found += [f"{path.name}:{node.lineno}: {a.name}" for a in node.names if a.name not in exported]
    assert found == []


def test_the_bench_package_exports_what_it_says() -> None:
    import aioexperts_bench

    assert len(set(aioexperts_bench.__all__)) == len(aioexperts_bench.__all__)
    assert [n for n in aioexperts_bench.__all__ if not hasattr(aioexperts_bench, n)] == []
