"""Import boundaries: tasks/ never imports Prefect; only tasks/tracking.py imports MLflow."""

import ast
from pathlib import Path

TASKS = Path(__file__).resolve().parent.parent / "tasks"


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_tasks_never_import_prefect_and_mlflow_only_in_tracking():
    offenders = []
    for path in sorted(TASKS.rglob("*.py")):
        roots = imported_roots(path)
        if "prefect" in roots:
            offenders.append(f"{path.relative_to(TASKS)} imports prefect")
        if "mlflow" in roots and path.name != "tracking.py":
            offenders.append(f"{path.relative_to(TASKS)} imports mlflow")
        if "flows" in roots:
            offenders.append(f"{path.relative_to(TASKS)} imports flows")
    assert offenders == []
