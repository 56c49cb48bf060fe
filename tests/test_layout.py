"""The package's structure stays what docs/ARCHITECTURE.md says: no import cycles, no hidden imports, an engine
that knows nothing of models, storage, the command line or the screen, and no reference to a missing file."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "specchat"
ENGINE_MAY_NOT_IMPORT = ("platformdirs", "click", "rich", "textual")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def imported(tree: ast.Module, known: set[str]) -> set[str]:
    """Every module an import statement names, anywhere in the file (function bodies and TYPE_CHECKING too)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, "relative import"
            for a in node.names:  # `from pkg import mod` imports the module pkg.mod
                out.add(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module)
    return out


def graph() -> dict[str, set[str]]:
    trees = modules()
    known = set(trees)
    return {name: {m for m in imported(tree, known) if m in known} for name, tree in trees.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_no_dynamic_imports():
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.split(".")[0] == "importlib" for n in names), name
            if isinstance(node, ast.Name):
                assert node.id != "__import__", name
        lazy = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"]
        assert not lazy, f"{name} resolves names lazily with a module __getattr__"


def test_engine_imports_only_the_engine_and_torch():
    known = set(modules())
    for name, tree in modules().items():
        if not name.startswith("specchat.engine"):
            continue
        for target in imported(tree, known):
            top = target.split(".")[0]
            assert top not in ENGINE_MAY_NOT_IMPORT, f"{name} imports {target}"
            if top == "specchat":
                assert target.startswith("specchat.engine"), f"{name} imports {target}"


def test_commands_import_options_never_the_reverse():
    edges = graph()
    assert not {m for m in edges["specchat.cli.options"] if m.startswith("specchat.cli.")}


def test_nothing_below_the_command_line_imports_it():
    """The commands hand down values (cli/options.Options stays in the CLI); only `python -m specchat` starts it."""
    for name, targets in graph().items():
        if name.startswith("specchat.cli") or name == "specchat.__main__":
            continue
        assert not {m for m in targets if m.startswith("specchat.cli")}, name


# a path in the repository, or a document named in capitals (README.md); lower-case names are outputs (report.md)
PATH = re.compile(r"(?<![\w/.-])((?:specchat|tests|benchmarks|docs)/[\w./*-]*\w|[A-Z][A-Z_-]*\.md)\b")


def test_every_file_the_repository_mentions_exists():
    """Comments, docstrings and docs name files of this repository only (nothing outside it)."""
    sources = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").glob("*"),
               ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    missing = []
    for source in sources:
        if source.is_dir() or source.suffix not in (".py", ".md", ".sh"):
            continue
        for match in PATH.finditer(source.read_text()):
            ref = match.group(1)
            candidates = [ROOT / ref, *(p for p in ROOT.rglob(ref) if ".venv" not in p.parts)] if "/" not in ref else [ROOT / ref]
            candidates.append(ROOT / f"{ref.rsplit('.', 1)[0]}.py")  # tests/support/models.tiny_model_dir: a name in a module
            if ref.startswith("tests/") and source.name == "RESULTS.md":  # the dated log names tests where they were then
                candidates += (ROOT / "tests").rglob(ref.removeprefix("tests/").removeprefix("**/"))
            if not any(c.exists() for c in candidates) and "*" not in ref:
                missing.append(f"{source.relative_to(ROOT)}: {ref}")
    assert not missing


def names_defined(tree: ast.Module) -> set[str]:
    """What `from module import name` finds in a module: its top-level definitions, assignments and imports."""
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            out |= {t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return out


def test_every_name_the_docs_examples_import_from_specchat_exists():
    """The README's and docs' Python examples import what the package defines (a reader copies them first)."""
    trees = modules()
    missing = []
    for doc in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        for line in re.findall(r"^from specchat[\w.]* import .*$", doc.read_text(), re.M):  # (sketches aside: not Python)
            for node in ast.parse(line.split("#")[0]).body:
                if isinstance(node, ast.ImportFrom):
                    for alias in node.names:
                        if node.module not in trees or (alias.name not in names_defined(trees[node.module])
                                                        and f"{node.module}.{alias.name}" not in trees):
                            missing.append(f"{doc.relative_to(ROOT)}: from {node.module} import {alias.name}")
    assert not missing
