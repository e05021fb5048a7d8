"""Import boundaries: the layering ARCHITECTURE.md draws, enforced.

ARCHITECTURE.md's "Layers" block lists every layer, top to bottom, with its files; it is the only
copy of the layering, and this test reads it. Every import of a Kiln module counts: at a module's top,
inside a function, and under `if TYPE_CHECKING:` (a type names a dependency of the design even when
the runtime never loads it). So:

- every Kiln file belongs to exactly one layer, and the listing names no file that is not there;
- a file imports only its own layer and the layers below it;
- no Kiln files import each other in a circle, in any layer;
- an import inside a function only defers a heavy third-party library, and says which with a
  `# defers <library>` comment on its line: the imported module loads that library at import time
  and the importing module does not;
- kiln.tasks never imports Prefect or kiln.flows; only kiln.tasks.tracking imports MLflow; only the
  stage layer and the flows name `KilnConfig`;
- keys, the CLI and cached reruns never load torch.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE_FOLDERS = ("kiln", "tasks", "flows")
DEFERS = re.compile(r"#.*?\bdefers\s+([\w.]+(?:\s*,\s*[\w.]+)*)")


@dataclass(frozen=True)
class Import:
    module: str  # the imported module (a submodule when `from package import submodule`)
    line: int
    where: str  # "top", "function" or "type"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    name = ".".join(parts if parts[0] == "kiln" else ("kiln", *parts))
    return name.removesuffix(".__init__")


def module_path(module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] != "kiln":
        return None
    rel = parts[1:] if len(parts) > 1 and parts[1] in ("tasks", "flows") else ["kiln", *parts[1:]]
    base = REPO.joinpath(*rel)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def sources() -> list[Path]:
    return sorted(p for folder in SOURCE_FOLDERS for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts)


@cache
def imports(path: Path) -> tuple[Import, ...]:
    """Every import in `path`, with where it sits. `from package import name` counts as the submodule
    when `name` is one."""
    found: list[Import] = []

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, "type")
            for child in node.orelse:
                visit(child, where)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, node.lineno, where) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append(Import(sub if module_path(sub) else node.module, node.lineno, where))
        inner = "function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else where
        for child in ast.iter_child_nodes(node):
            visit(child, inner if where == "top" else where)

    visit(ast.parse(path.read_text()), "top")
    return tuple(found)


def kiln_imports(path: Path) -> list[Import]:
    return [i for i in imports(path) if i.module.startswith("kiln.") and module_path(i.module) is not None]


def declared_layers() -> list[tuple[str, list[str]]]:
    """ARCHITECTURE.md's layers, top to bottom: (name, the files and folders listed for it)."""
    text = (REPO / "ARCHITECTURE.md").read_text()
    block = re.search(r"<!-- layers -->\n```\n(.*?)```", text, re.S)
    assert block, "ARCHITECTURE.md has no layer listing (a ``` block after <!-- layers -->)"
    layers: list[tuple[str, list[str]]] = []
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            layers.append((line.split()[0], []))
        else:
            layers[-1][1].extend(word for word in line.split() if "/" in word or word.endswith(".py"))
    return layers


@cache
def layer_of() -> dict[str, int]:
    """Each Kiln module -> its layer's index (0 is the top)."""
    owner: dict[str, int] = {}
    for index, (_, entries) in enumerate(declared_layers()):
        for entry in entries:
            paths = sorted((REPO / entry).rglob("*.py")) if entry.endswith("/") else [REPO / entry]
            for path in paths:
                if "__pycache__" in path.parts:
                    continue
                assert path.is_file(), f"ARCHITECTURE.md lists {entry}, which does not exist"
                assert module_name(path) not in owner, f"ARCHITECTURE.md lists {path.relative_to(REPO)} twice"
                owner[module_name(path)] = index
    return owner


@cache
def heavy_at_import(module: str) -> frozenset[str]:
    """The third-party libraries (not the standard library's) importing `module` loads: its own top-level
    imports', its packages', and those of every Kiln module they import at their top, transitively."""
    found: set[str] = set()
    todo, seen = [module], {module}
    while todo:
        current = todo.pop()
        parent = current.rpartition(".")[0]
        path = module_path(current)
        nexts = [parent] if parent.count(".") >= 1 else []
        for imp in imports(path) if path else ():
            if imp.where != "top":
                continue
            if imp.module.startswith("kiln."):
                nexts.append(imp.module)
            elif imp.module.split(".")[0] not in sys.stdlib_module_names:
                found.add(imp.module.split(".")[0])
        for name in nexts:
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return frozenset(found)


def test_every_file_has_exactly_one_layer():
    listed = set(layer_of())
    present = {module_name(path) for path in sources()}
    assert sorted(present - listed) == [], "files ARCHITECTURE.md's layer listing does not name"
    assert sorted(listed - present) == []


def test_each_file_imports_only_its_own_layer_and_those_below():
    names = [name for name, _ in declared_layers()]
    owner = layer_of()
    upward = []
    for path in sources():
        mine = owner[module_name(path)]
        for imp in kiln_imports(path):
            theirs = owner.get(module_name(module_path(imp.module)))
            if theirs is not None and theirs < mine:
                upward.append(f"{path.relative_to(REPO)}:{imp.line} ({names[mine]}) imports {imp.module} "
                              f"({names[theirs]}, {imp.where})")
    assert upward == []


def test_no_kiln_files_import_each_other_in_a_circle():
    graph = {module_name(path): {module_name(module_path(i.module)) for i in kiln_imports(path)} - {module_name(path)}
             for path in sources()}
    circles, done, stack = [], set(), []

    def visit(module: str) -> None:
        if module in stack:
            circles.append(" -> ".join([*stack[stack.index(module):], module]))
            return
        if module in done:
            return
        stack.append(module)
        for imported in sorted(graph.get(module, ())):
            visit(imported)
        stack.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    assert circles == []


def test_an_import_inside_a_function_defers_a_heavy_library_and_says_which():
    offenders = []
    for path in sources():
        lines = path.read_text().splitlines()
        mine = heavy_at_import(module_name(path))
        for imp in kiln_imports(path):
            if imp.where != "function":
                continue
            said = DEFERS.search(lines[imp.line - 1])
            deferred = heavy_at_import(imp.module) - mine
            where = f"{path.relative_to(REPO)}:{imp.line} imports {imp.module} in a function"
            if said is None:
                offenders.append(f"{where} without a `# defers <library>` comment (it would defer: "
                                 f"{sorted(deferred) or 'nothing: import it at the top'})")
                continue
            claimed = {name.strip() for name in said.group(1).split(",")}
            if not claimed <= deferred:
                offenders.append(f"{where}: says it defers {sorted(claimed)}, but it defers {sorted(deferred)}")
    assert offenders == []


def test_tasks_never_import_prefect_or_flows_and_only_tracking_imports_mlflow():
    offenders = []
    for path in sorted((REPO / "tasks").rglob("*.py")):
        roots = {imp.module.split(".")[0] for imp in imports(path)} | {
            ".".join(imp.module.split(".")[:2]) for imp in imports(path)}
        rel = path.relative_to(REPO)
        if "prefect" in roots or "kiln.flows" in roots:
            offenders.append(f"{rel} imports prefect or kiln.flows")
        if "mlflow" in roots and rel != Path("tasks/tracking.py"):
            offenders.append(f"{rel} imports mlflow")
    assert offenders == []


def test_only_the_stage_layer_and_the_flows_know_the_whole_config():
    names = [name for name, _ in declared_layers()]
    allowed = {names.index("flows"), names.index("stages")}
    owner = layer_of()
    offenders = []
    for path in sources():
        if owner[module_name(path)] in allowed:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any(alias.name == "KilnConfig" for alias in node.names):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == []


def test_the_rules_bite_on_real_files():
    """The listing puts the ledger in the foundation and the runner in the stage layer, and the checks see
    each kind of import: a function's, a type-only one's, one at the top."""
    names = [name for name, _ in declared_layers()]
    owner = layer_of()
    assert names[owner["kiln.tasks.ledger"]] == "foundation" and names[owner["kiln.tasks.runner"]] == "stages"
    assert names.index("stages") < names.index("scaling") < names.index("foundation")
    wheres = {imp.where for path in sources() for imp in kiln_imports(path)}
    assert wheres == {"top", "function", "type"}
    assert "torch" in heavy_at_import("kiln.tasks.train.model") and "torch" not in heavy_at_import("kiln.tasks.config")


def test_config_keys_and_the_cli_load_no_torch():
    """A cached rerun, `kiln status` and `kiln --help` never pay torch's import: stage bodies import it."""
    probe = ("import sys, kiln.flows.cli, kiln.tasks.graph, kiln.tasks.runner, kiln.flows.pipeline; "
             "kiln.flows.cli.build_parser(); "
             "print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
