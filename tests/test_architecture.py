"""The layers of docs/architecture.md, checked from the code: which package may import which, no
import cycle, small modules, no history and no measured figures in the code, every file or module
a comment names exists; and the docs that keep the code honest: docs/benchmarks.md a page of
results, every script under benchmarks/ and scripts/ named in a doc, the client's public names
and modules those docs/client.md lists, its other modules private, and their old names (deprecated)
used by nothing of ours.

The import graph is read from the source (``ast``): every ``import`` counts, at module level or
inside a function, so a lazy import cannot hide a cycle or an upward edge.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROOTS = {"streamer_service": ROOT / "streamer_service", "streamer_client": ROOT / "client" / "streamer_client"}

# The parts of streamer_service, bottom to top: each may import the ones of a lower rank (and the
# client); parts of one rank do not import each other. A new package or top-level module gets a
# row here and in docs/architecture.md.
LAYERS = {
    "sizing": 0,
    "uri": 0,
    "settings": 1,
    "logs": 2,
    "access": 2,  # the foundation: modules
    "storage": 3,
    "readers": 3,
    "metadata": 4,
    "checkpoint": 5,
    "load": 6,
    "embedded": 7,
    "daemon": 7,
    "sample": 8,
    "demo": 9,
    "bench": 9,
    "cli": 10,
    "__main__": 11,  # the tools
}
MAX_LINES = 450


def _module_name(package: str, path: Path) -> str:
    parts = [package, *path.relative_to(ROOTS[package]).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p, path): path for p, root in ROOTS.items() for path in sorted(root.rglob("*.py"))}


MODULES = _modules()


def _defines(module: str, name: str) -> bool:
    tree = ast.parse(MODULES[module].read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n for t in targets for n in (t.elts if isinstance(t, ast.Tuple) else [t])]
            if any(isinstance(n, ast.Name) and n.id == name for n in names):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name.split(".")[0]) == name for a in node.names):
            return True
    return False


def _imports(name: str, path: Path) -> set[str]:
    """The modules of ours that ``name`` imports (a name imported from a package counts as its
    submodule where there is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            # A name that is neither a module of ours nor defined by the package it comes from
            # is an extension module (streamer_client._copier): no edge to the package.
            targets = [
                f"{module}.{alias.name}"
                for alias in node.names
                if f"{module}.{alias.name}" in MODULES or module not in MODULES or _defines(module, alias.name)
            ]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _extension(module: str) -> bool:
    """A native extension of ours (built from a C source beside the package's modules)."""
    package, _, name = module.rpartition(".")
    return package in MODULES and (MODULES[package].parent / f"{name}.c").exists()


def test_every_name_imported_from_our_packages_exists():
    """``from package import name``: a module of ours, an extension, or defined by the package."""
    wrong = []
    for name, path in MODULES.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")
                module = ".".join([*base[: len(base) - node.level + 1], *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if module not in MODULES:
                if module.split(".")[0] in ROOTS and not _extension(module):
                    wrong.append(f"{name}: {module}")
                continue
            for alias in node.names:
                target = f"{module}.{alias.name}"
                if target not in MODULES and not _extension(target) and not _defines(module, alias.name):
                    wrong.append(f"{name}: {target}")
    assert wrong == []


def _part(module: str) -> str | None:
    """The part of streamer_service a module belongs to (its first name below the package)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "streamer_service" and len(parts) > 1 else None


def test_every_part_of_the_service_has_a_layer():
    parts = {_part(m) for m in MODULES} - {None}
    assert parts - set(LAYERS) == set(), "add the new part to LAYERS and docs/architecture.md"
    assert set(LAYERS) - parts == set(), "LAYERS names a part that is gone"


def test_no_part_imports_a_higher_one_or_its_sibling():
    wrong = []
    for module, targets in GRAPH.items():
        here = _part(module)
        if here is None:
            continue
        for target in targets:
            there = _part(target)
            if there is not None and there != here and LAYERS[there] >= LAYERS[here]:
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_the_client_does_not_import_the_service():
    """The client finds its in-process backend through the entry point group
    ``streamer_client.backends`` (streamer_client/_in_process.py), never by importing the service."""
    wrong = [
        f"{m} -> {t}"
        for m, ts in GRAPH.items()
        if m.startswith("streamer_client")
        for t in ts
        if t.startswith("streamer_service")
    ]
    assert wrong == []


def test_the_service_registers_its_in_process_backend():
    import tomllib

    from streamer_client import _in_process as in_process

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == in_process.PROVIDER  # the distribution the client looks in first
    target = project["entry-points"][in_process.GROUP][in_process.NAME]
    assert target in MODULES
    tree = ast.parse(MODULES[target].read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"stream", "pull"} <= defined


def _cycle() -> list[str] | None:
    """One import cycle among our modules, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(GRAPH):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_no_import_cycle():
    # A package's __init__ that re-exports its modules is imported by them only through the
    # import system, not as a cycle of concepts: the edge from a submodule to its own package
    # is not counted.
    cycle = _cycle()
    assert cycle is None, " -> ".join(cycle)


def _package_files() -> list[Path]:
    return sorted(MODULES.values())


@pytest.mark.parametrize("path", _package_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_over_the_size_limit(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines: split it by concept (docs/contributing.md)"


def test_no_history_in_the_package_code():
    pattern = re.compile(r"\b[Ii]ssue[ #]*\d+|DESIGN\.md|STYLE\.md")
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _package_files()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


# A path into the repository, as comments and docstrings write them.
_PATH = re.compile(
    r"(?<![\w./-])((?:docs|tests|benchmarks|scripts|examples|deploy|client|streamer_service|streamer_client)/[\w./-]*\w)"
)
# A dotted name of ours.
_DOTTED = re.compile(r"(?<![\w.])((?:streamer_service|streamer_client)(?:\.\w+)+)")


def _entry_point_groups() -> set[str]:
    import tomllib

    groups = set()
    for pyproject in (ROOT / "pyproject.toml", ROOT / "client" / "pyproject.toml"):
        groups |= set(tomllib.loads(pyproject.read_text())["project"].get("entry-points", {}))
    return groups


def _exists(path: str) -> bool:
    if path.startswith("streamer_client/"):
        path = "client/" + path
    return (ROOT / path).exists()


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in MODULES:
            rest = parts[cut:]
            return (
                not rest
                or _defines(module, rest[0])
                or (MODULES[module].name == "__init__.py" and module + "." + rest[0] in MODULES)
            )
    return False


def _named(text: str) -> list[str]:
    missing = [p for p in _PATH.findall(text) if not _exists(p.rstrip("."))]
    missing += [d for d in _DOTTED.findall(text) if not _resolves(d) and d not in _entry_point_groups()]
    return missing


@pytest.mark.parametrize("path", _package_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_and_module_the_code_names_exists(path):
    assert _named(path.read_text()) == []


DOCS = [ROOT / "README.md", ROOT / "client" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_and_module_the_docs_name_exists(path):
    # "Changes for integrators" names the paths that were, beside the ones that are.
    assert _named(path.read_text().split("## Changes for integrators")[0]) == []


# Measured figures go stale in code: a docstring or comment says what the code does and why, and
# the numbers live in docs/benchmarks.md with their machine and date. A number with a unit of time
# or of rate is a measurement, unless its line defines a default or a limit.
_MEASURED = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)?(?:\s*[-–]\s*\d+(?:[.,]\d+)?)?\s*(?:[GMKk]i?B/s|s/GiB|ms|µs|us|ns|s)(?![\w/])")
_DEFAULT_OR_LIMIT = re.compile(r"\b(?:default|limit|at most|at least|timeout)\b", re.I)


def _prose(path: Path) -> list[tuple[int, str]]:
    """The lines of ``path``'s comments and docstrings (every string that is a statement of its
    own), with their line numbers; for a C source, its comments."""
    text = path.read_text()
    if path.suffix == ".c":
        return [
            (text.count("\n", 0, m.start()) + i, line)
            for m in re.finditer(r"/\*.*?\*/|//[^\n]*", text, flags=re.S)
            for i, line in enumerate(m.group().splitlines(), 1)
        ]
    lines = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(text).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            lines += [(node.lineno + i, line) for i, line in enumerate(node.value.value.splitlines())]
    return lines


def _measured(path: Path) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for number, line in _prose(path)
        if _MEASURED.search(line) and not _DEFAULT_OR_LIMIT.search(line)
    ]


def test_the_prose_rule_finds_measurements_and_lets_defaults_be():
    assert _MEASURED.search("registering costs 0.05 s/GiB on 4 KiB pages")
    assert _MEASURED.search("copies at 55 GB/s, 21-24 GB/s with Python threads")
    assert _MEASURED.search("the zero-fill (about 60 ms per 256 MiB)")
    assert _MEASURED.search("took 0.20 s on an H200 host")
    assert not _MEASURED.search("slots of 256 MiB, 8 segments, 100 Gbit/s, 30 seconds")
    assert not _MEASURED.search("4 KiB pages, 12 threads, STREAMER_JOIN_TIMEOUT_S, sizes 2 MiB")
    assert _DEFAULT_OR_LIMIT.search("(30 s by default)")


@pytest.mark.parametrize(
    "path",
    [*_package_files(), *sorted(ROOTS["streamer_client"].rglob("*.c"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_measured_figure_in_a_docstring_or_comment(path):
    assert _measured(path) == [], "measurements go in docs/benchmarks.md, with their machine and date"


BENCHMARKS_PAGE = ROOT / "docs" / "benchmarks.md"
# A heading that tells how a number was found, not what it is.
_NARRATIVE = re.compile(r"\blooks?\b|\btried\b|\bnot kept\b|\bissue \d+|\bsession\b", re.I)


def _headings(lines: list[str]) -> list[str]:
    """The Markdown headings of ``lines``, outside fenced code blocks."""
    found, fenced = [], False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.append(line)
    return found


def test_the_benchmarks_page_is_a_results_page():
    lines = BENCHMARKS_PAGE.read_text().splitlines()
    assert len(lines) <= 400, f"docs/benchmarks.md has {len(lines)} lines: results, not the story (commit messages)"
    headings = _headings(lines)
    assert [h for h in headings if _NARRATIVE.search(h)] == []
    for section in ("## Method", "## Not measured yet"):
        assert section in headings


def _scripts() -> list[Path]:
    return sorted(
        p
        for top in ("benchmarks", "scripts")
        for p in (ROOT / top).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.startswith(".")
    )


def test_every_script_is_named_in_the_docs():
    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    unnamed = [str(p.relative_to(ROOT)) for p in _scripts() if str(p.relative_to(ROOT)) not in docs]
    assert unnamed == [], "say in docs/benchmarks.md (or the doc it serves) what each is for, with its command"


def _documented_public_api() -> list[str]:
    """The names docs/client.md lists under "Public API" as ``streamer_client.__all__``."""
    page = (ROOT / "docs" / "client.md").read_text()
    assert "\n## Public API\n" in page, 'docs/client.md lists the public API under "## Public API"'
    section = page.split("\n## Public API\n", 1)[1].split("\n## ", 1)[0]
    assert "`streamer_client.__all__`:\n" in section, "the section's list of the package's names"
    listing = section.split("`streamer_client.__all__`:\n", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^- `(\w+)", listing, flags=re.M)


def test_the_public_api_is_the_documented_one():
    import streamer_client

    documented = _documented_public_api()
    assert len(documented) == len(set(documented))
    assert sorted(streamer_client.__all__) == sorted(documented)
    assert all(hasattr(streamer_client, name) for name in streamer_client.__all__)


# The client's public surface (docs/client.md, "Public API"): its other modules' names start with
# "_"; their old names are modules of three lines (streamer_client/_deprecated.py) until REMOVED_IN.
def _documented_public_modules() -> set[str]:
    """The modules docs/client.md lists under "Public API" as "Public modules besides"."""
    section = (ROOT / "docs" / "client.md").read_text().split("\n## Public API\n", 1)[1].split("\n## ", 1)[0]
    assert "Public modules besides:\n" in section, "the section's list of the public modules"
    listing = section.split("Public modules besides:\n", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"`(streamer_client(?:\.\w+)+)`", listing))


def _is_old_name(path: Path) -> bool:
    """Whether the module at ``path`` is an old name: its docstring, then exactly
    ``from ._deprecated import moved`` and ``moved(__name__)``."""
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return [ast.dump(node) for node in body] == [
        ast.dump(node) for node in ast.parse("from ._deprecated import moved\nmoved(__name__)").body
    ]


def _old_names() -> dict[str, str]:
    from streamer_client._deprecated import MOVED

    return {f"streamer_client.{old}": f"streamer_client.{new}" for old, new in MOVED.items()}


def test_every_module_of_the_client_is_public_private_or_an_old_name():
    public_looking = {m for m in MODULES if m.startswith("streamer_client.") and not any(p.startswith("_") for p in m.split("."))}
    old = {m for m in public_looking if _is_old_name(MODULES[m])}
    documented = _documented_public_modules()
    assert documented - set(MODULES) == set(), "docs/client.md lists a public module that does not exist"
    assert public_looking - old == documented, (
        "a module that is not public gets a name starting with _ (docs/client.md, Public API)"
    )
    assert old == set(_old_names()), "every old name in streamer_client._deprecated.MOVED has its module, and only those"
    for target in _old_names().values():
        assert target in MODULES and target.rpartition(".")[2].startswith("_"), target


def _imported(name: str, path: Path) -> set[str]:
    """Every module ``path`` (module ``name``, or None outside our packages) may import: the
    modules of its imports, and for ``from module import x`` also ``module.x``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level and name is not None:
                base = (name if path.name == "__init__.py" else name.rpartition(".")[0]).split(".")
                module = ".".join([*base[: len(base) - node.level + 1], *([module] if module else [])])
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return found


def _source_files() -> list[Path]:
    """The repository's code, scripts and configuration (its docs may name the old names)."""
    tops = ["client", "streamer_service", "tests", "benchmarks", "scripts", "examples", "deploy", ".ci"]
    files = [ROOT / "Dockerfile", ROOT / "pyproject.toml"]
    for top in tops:
        files += [
            p
            for p in sorted((ROOT / top).rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".so", ".pyc", ".md")
        ]
    return files


def test_nothing_of_ours_uses_an_old_module_name():
    """The package, the service, the tests, benchmarks, scripts and examples import the private
    modules; only the old names' own modules (and the tests below, by a computed name) reach an
    old name."""
    old = set(_old_names())
    by_path = {path: name for name, path in MODULES.items()}
    written = re.compile(r"\bstreamer_client\.(" + "|".join(sorted(n.rpartition(".")[2] for n in old)) + r")\b")
    wrong = []
    for path in _source_files():
        if path in by_path and _is_old_name(path):
            continue
        text = path.read_text(errors="replace")
        wrong += [f"{path.relative_to(ROOT)}: {m.group()}" for m in written.finditer(text)]
        if path.suffix == ".py":
            imported = _imported(by_path.get(path), path)
            wrong += [
                f"{path.relative_to(ROOT)}: imports {m}"
                for m in sorted(imported)
                if any(m == o or m.startswith(o + ".") for o in old)
            ]
    assert wrong == [], "import the private module (streamer_client._deprecated.MOVED names it)"


@pytest.mark.parametrize("old", sorted(_old_names()))
def test_an_old_module_name_warns_and_gives_the_private_module(old):
    import importlib
    import sys

    new = importlib.import_module(_old_names()[old])
    sys.modules.pop(old, None)  # as in a process that has not imported it yet
    with pytest.warns(DeprecationWarning) as warned:
        module = importlib.import_module(old)
    assert len(warned) == 1
    message = str(warned[0].message)
    assert f"{old} is an internal module, now {new.__name__}" in message and "docs/client.md" in message
    assert warned[0].filename == __file__, "the warning names the line that imported the old name"
    assert module is new and sys.modules[old] is new  # the same objects, private names and patches too
    names = getattr(new, "__all__", None) or [n for n in vars(new) if not n.startswith("_")]
    assert all(getattr(module, n) is getattr(new, n) for n in names)


def test_an_old_module_name_reached_through_the_package_warns_once():
    """``from streamer_client import <old>`` and ``streamer_client.<old>`` import the old name too;
    the default filters show its warning where the importer is ``__main__``, once per name."""
    import subprocess
    import sys

    _, first, second = sorted(_old_names())[:3]
    code = "\n".join(
        [
            f"import {first}",
            f"from streamer_client import {second.rpartition('.')[2]}",
            "import streamer_client",
            f"streamer_client.{second.rpartition('.')[2]}, {first}",
            f"import {first}, {second}",
        ]
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    said = re.findall(r"^<string>:(\d+): DeprecationWarning: (\S+) is an internal module", result.stderr, flags=re.M)
    assert said == [("1", first), ("2", second)], result.stderr[-3000:]


def test_the_old_module_names_go_in_the_release_the_docs_name():
    from packaging.version import Version

    import streamer_client
    from streamer_client._deprecated import REMOVED_IN

    assert f"removed in streamer-client {REMOVED_IN}" in (ROOT / "docs" / "client.md").read_text()
    assert Version(streamer_client.__version__) < Version(REMOVED_IN), (
        "remove the old names' modules (streamer_client._deprecated.MOVED), _deprecated.py and the package's __getattr__"
    )
