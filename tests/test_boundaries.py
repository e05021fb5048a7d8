"""Import boundaries: tasks/ never imports Prefect; only tasks/tracking.py imports MLflow."""

import ast
import subprocess
import sys
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


def test_config_keys_and_the_cli_load_no_torch():
    """A cached rerun, `kiln status` and `kiln --help` never pay torch's import: stage bodies import it."""
    probe = ("import sys, flows.cli, tasks.graph, tasks.runner, flows.pipeline; flows.cli.build_parser(); "
             "print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=TASKS.parent, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
