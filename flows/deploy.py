"""`kiln deploy`, `kiln worker`, `kiln serve`: Kiln's deployments on a real Prefect API.

`deploy` registers every deployment of infra/prefect.yaml (the pipeline, one per stage, continuous
eval) with `prefect deploy`, creating the process work pool first; `worker` starts a worker for
that pool with the process settings CLI runs get; `serve` serves the same flows from one process,
for a laptop. The continuous-eval schedule stays off until it is told which config to watch: a
schedule silently scoring `configs/default.yaml` every ten minutes helps no one.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from flows.environment import PROCESS_SETTINGS
from tasks.errors import KilnError

REPO = Path(__file__).resolve().parents[1]
PREFECT_FILE = REPO / "infra" / "prefect.yaml"
POOL = "kiln-process"
CONTINUOUS_EVAL = "kiln-continuous-eval/continuous-eval"


def _require_server() -> str:
    url = os.environ.get("PREFECT_API_URL")
    if not url:
        raise KilnError("no Prefect server: start one with `kiln up` and `source <work_dir>/servers/env`, "
                        "or set PREFECT_API_URL to your server's API (http://host:4200/api)")
    return url


def worker_environment() -> dict[str, str]:
    """The environment of a worker and of the flow-run processes it starts."""
    return {**PROCESS_SETTINGS, **os.environ, "KILN_REPO_DIR": str(REPO)}


def _prefect(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=REPO, env=worker_environment(),
                            capture_output=True, text=True)
    if check and result.returncode != 0:
        raise KilnError(f"`prefect {' '.join(args)}` failed ({result.returncode}):\n{result.stdout[-2000:]}"
                        f"{result.stderr[-2000:]}")
    return result


def deploy(continuous_eval_config: str | None = None, overrides: list[str] | None = None,
           alert_webhook: str | None = None) -> str:
    """Register every deployment; with `continuous_eval_config`, point the continuous-eval schedule
    at that config and switch it on; with `alert_webhook`, create the alert automations
    (`flows.alerts`). Returns `prefect deploy`'s summary."""
    _require_server()
    if _prefect("work-pool", "inspect", POOL, check=False).returncode != 0:
        _prefect("work-pool", "create", POOL, "--type", "process")
    summary = _prefect("--no-prompt", "deploy", "--prefect-file", str(PREFECT_FILE), "--all").stdout
    if continuous_eval_config is not None:
        asyncio.run(_watch(continuous_eval_config, list(overrides or [])))
    if alert_webhook:
        from flows.alerts import create_alerts

        summary += f"\nalerts to {alert_webhook}: {', '.join(create_alerts(alert_webhook))}"
    return summary


async def _watch(config_path: str, overrides: list[str]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate

    async with get_client() as client:
        deployment = await client.read_deployment_by_name(CONTINUOUS_EVAL)
        await client.update_deployment(deployment.id, DeploymentUpdate(
            parameters={"config_path": config_path, "overrides": overrides}))
        for schedule in deployment.schedules:
            await client.update_deployment_schedule(deployment.id, schedule.id, active=True)


def run_worker() -> None:
    """Replace this process with a Prefect worker for Kiln's pool."""
    _require_server()
    command = [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process"]
    os.chdir(REPO)
    os.execvpe(command[0], command, worker_environment())


def serve(continuous_eval_config: str | None = None, overrides: list[str] | None = None) -> None:
    """Serve the pipeline, every stage and (when given a config) continuous eval from this process."""
    from prefect import serve as prefect_serve

    from flows.continuous_eval import continuous_eval
    from flows.pipeline import pipeline
    from flows.stages import STAGE_FLOWS

    deployments = [pipeline.to_deployment("pipeline")]
    deployments += [stage_flow.to_deployment(name) for name, stage_flow in STAGE_FLOWS.items()]
    if continuous_eval_config is not None:
        deployments.append(continuous_eval.to_deployment(
            "continuous-eval", interval=600,
            parameters={"config_path": continuous_eval_config, "overrides": list(overrides or [])}))
    prefect_serve(*deployments)
