"""Import boundaries: the layering ARCHITECTURE.md draws, enforced.

- tasks/ never imports Prefect or flows/; only tasks/tracking.py imports MLflow;
- each layer imports only its own and those below it (runtime imports anywhere in a module, at its
  top or inside a function; imports for type checking only do not run and do not count):
  flows/ > runner and graph > config and tracking > tasks/stages/ > the work (data, scaling, train,
  launch, evals) > the foundation (every other module at tasks/: stage, store, errors, ...);
- no cycle among module-level imports (a cycle works only by import order);
- keys, the CLI and cached reruns never load torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "tasks"
# top to bottom: each imports only its own layer and those below (ARCHITECTURE.md, "six layers")
LAYERS = ("flows", "orchestration", "config", "stages", "work", "foundation")
ORCHESTRATION = {"kiln.tasks.runner", "kiln.tasks.graph"}
CONFIG = {"kiln.tasks.config", "kiln.tasks.tracking"}
WORK = ("data", "scaling", "train", "launch", "evals")


def layer(module: str) -> str:
    parts = module.removeprefix("kiln.").split(".")
    if parts[0] == "flows":
        return "flows"
    if module in ORCHESTRATION:
        return "orchestration"
    if module in CONFIG:
        return "config"
    if len(parts) > 1 and parts[1] == "stages":
        return "stages"
    if len(parts) > 1 and parts[1] in WORK:
        return "work"
    return "foundation"


def module_name(path: Path) -> str:
    return "kiln." + ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def runtime_imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import that runs: not under `if TYPE_CHECKING:`.
    `from package import name` counts as the submodule when `name` is one."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        if _type_checking(node):
            for child in node.orelse:
                visit(child, top)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, top) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((sub if _is_module(sub) else node.module, top))
        for child in ast.iter_child_nodes(node):
            visit(child, top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), True)
    return found


def _is_module(name: str) -> bool:
    base = REPO.joinpath(*name.removeprefix("kiln.").split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def sources() -> list[Path]:
    return sorted([*TASKS.rglob("*.py"), *(REPO / "flows").rglob("*.py")])


def test_tasks_never_import_prefect_and_mlflow_only_in_tracking():
    offenders = []
    for path in sorted(TASKS.rglob("*.py")):
        roots = {name.removeprefix("kiln.").split(".")[0] for name, _ in runtime_imports(path)}
        if "prefect" in roots:
            offenders.append(f"{path.relative_to(TASKS)} imports prefect")
        if "mlflow" in roots and path.name != "tracking.py":
            offenders.append(f"{path.relative_to(TASKS)} imports mlflow")
        if "flows" in roots:
            offenders.append(f"{path.relative_to(TASKS)} imports flows")
    assert offenders == []


def test_each_layer_imports_only_itself_and_the_layers_below():
    offenders = []
    for path in sources():
        module = module_name(path)
        mine = LAYERS.index(layer(module))
        for imported, _ in runtime_imports(path):
            if imported.startswith(("kiln.tasks", "kiln.flows")) and LAYERS.index(layer(imported)) < mine:
                offenders.append(f"{module} ({layer(module)}) imports {imported} ({layer(imported)})")
    assert offenders == []


def test_no_module_level_import_cycle():
    graph = {module_name(path): {name for name, top in runtime_imports(path) if top and name.startswith(("kiln.tasks", "kiln.flows"))} for path in sources()}
    cycles, done, stack = [], set(), []

    def visit(module: str) -> None:
        if module in stack:
            cycles.append(" -> ".join([*stack[stack.index(module):], module]))
            return
        if module in done or module not in graph:
            return
        stack.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        stack.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    assert cycles == []


def test_the_layering_is_checked_against_real_modules():
    """The rules above bite: the runner is above the stages it runs, a stage module below it."""
    assert layer("kiln.tasks.runner") == "orchestration" and layer("kiln.tasks.stages.anneal_ablation") == "stages"
    assert LAYERS.index("orchestration") < LAYERS.index("stages") < LAYERS.index("work") < LAYERS.index("foundation")
    assert ("kiln.tasks.runner", True) not in runtime_imports(TASKS / "stages" / "anneal_ablation.py")
    assert ("kiln.tasks.stage", True) in runtime_imports(TASKS / "stages" / "anneal_ablation.py")
    # an import for type checking only does not count: stage.py names the runner's types that way
    assert all(name != "kiln.tasks.runner" for name, _ in runtime_imports(TASKS / "stage.py"))
    assert "kiln.tasks.runner" in (TASKS / "stage.py").read_text()


def test_config_keys_and_the_cli_load_no_torch():
    """A cached rerun, `kiln status` and `kiln --help` never pay torch's import: stage bodies import it."""
    probe = ("import sys, kiln.flows.cli, kiln.tasks.graph, kiln.tasks.runner, kiln.flows.pipeline; kiln.flows.cli.build_parser(); "
             "print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=TASKS.parent, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
