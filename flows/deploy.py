"""`kiln deploy`, `kiln worker`, `kiln serve`: Kiln's deployments on a real Prefect API.

`deploy` registers every deployment of infra/prefect.yaml (the pipeline, one per stage, continuous
eval) as `prefect deploy --all` would, but from its own process and all at once (a few seconds on a
warm server, where `prefect deploy` took 18-40 s: benchmarks/deploy.py), creating its work pool first: the process pool by default, or the
Kubernetes pool (base job template: infra/work-pools/kubernetes.json), onto which every deployment
then moves. The flows are imported from the installed Kiln package (module entrypoints) and run in
the *project directory*: the folder `kiln deploy` ran in (on Kubernetes, the image's project folder),
so a run's config path, its data paths and its `work_dir` resolve there, as they do for `kiln run`
in that folder, wherever Kiln itself is installed. Every deployment's job env gets the heartbeat
frequency of the deploying process, the one the unresponsive-run alert assumes, so a run whose
worker dies is marked Crashed on time. `worker` starts a worker for the process pool with the
process settings CLI runs get (a Kubernetes pool's worker runs in the cluster); `serve` serves the
same flows from one process, for a laptop. The continuous-eval deployment has no schedule until it is
told which config to watch (a schedule silently scoring `configs/default.yaml` helps no one):
`--continuous-eval CONFIG` gives it one, every `continuous_eval.interval` of that config (`--every
60s` sets it), and switches it on; the flow pauses it once its stages are complete and scored.
Every deploy also creates the detector that marks a dead worker's flow run Crashed (`flows.alerts`),
alerts or not: without it such a run would stay Running.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import yaml

from kiln.flows.alerts import UNRESPONSIVE, create_alerts, create_crash_detector
from kiln.flows.environment import PROCESS_SETTINGS
from kiln.flows.servers import WORKER_STOP_S, register_worker, servers_of
from kiln.tasks.bundled import shipped
from kiln.tasks.config import load_config
from kiln.tasks.errors import KilnError
from kiln.tasks.settings import TrackingConfig
from kiln.tasks.tracking import MlflowTracker

PREFECT_FILE = shipped("infra") / "prefect.yaml"  # Kiln's own files, not the user's project
WORK_POOL_TEMPLATES = shipped("infra") / "work-pools"  # {type}.json: a pool's base job template (none: Prefect's)
PROJECT_DIR_VARIABLE = "KILN_PROJECT_DIR"  # the pull step's working directory, resolved by `prefect deploy`
WORK_POOL_TYPES = ("process", "kubernetes")
POOL = "kiln-process"
CONTINUOUS_EVAL = "kiln-continuous-eval/continuous-eval"
HEARTBEAT_SETTING = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"


def _require_server() -> str:
    url = os.environ.get("PREFECT_API_URL")
    if not url:
        raise KilnError("no Prefect server: start one with `kiln up` and `source <work_dir>/servers/env`, "
                        "or set PREFECT_API_URL to your server's API (http://host:4200/api)")
    return url


def worker_environment() -> dict[str, str]:
    """The environment of a worker and of the flow-run processes it starts."""
    return {**PROCESS_SETTINGS, **os.environ}


def work_pool(kind: str) -> dict:
    """The work pool `kind` (process, kubernetes) as infra/prefect.yaml defines it: name, queue, job variables."""
    if kind not in WORK_POOL_TYPES:
        raise KilnError(f"work pool {kind!r} is not one of {', '.join(WORK_POOL_TYPES)}")
    return yaml.safe_load(PREFECT_FILE.read_text())["definitions"]["work_pools"][kind]


def ensure_work_pool(kind: str) -> str:
    """Create the work pool `kind` unless it exists (an existing pool is left as the operator made it),
    with its template from infra/work-pools/ or else Prefect's default for the type, as
    `prefect work-pool create` would; returns its name."""
    name = work_pool(kind)["name"]
    asyncio.run(_ensure_work_pool(name, kind))
    return name


async def _ensure_work_pool(name: str, kind: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.utilities import get_default_base_job_template_for_infrastructure_type

    async with get_client() as client:
        try:
            await client.read_work_pool(name)
            return
        except ObjectNotFound:
            pass
        path = WORK_POOL_TEMPLATES / f"{kind}.json"
        template = json.loads(path.read_text()) if path.is_file() else \
            await get_default_base_job_template_for_infrastructure_type(kind)
        await client.create_work_pool(WorkPoolCreate(name=name, type=kind, base_job_template=template))


def heartbeat_env() -> dict[str, str]:
    """The heartbeat the unresponsive-run detector (`flows.alerts`) assumes: this process's setting, which
    every deployment run gets in its job env, so a worker-run flow heartbeats at the cadence it is judged by
    whatever the worker's own environment says (CLI runs send none: see flows/cli.py)."""
    from prefect.settings import get_current_settings

    seconds = get_current_settings().flows.heartbeat_frequency
    return {} if seconds is None else {HEARTBEAT_SETTING: str(seconds)}


def prefect_file_for(kind: str) -> dict:
    """infra/prefect.yaml with every deployment on the work pool `kind`, its job env carrying `heartbeat_env`."""
    spec = yaml.safe_load(PREFECT_FILE.read_text())
    pool = copy.deepcopy(work_pool(kind))
    pool["job_variables"]["env"].update(heartbeat_env())
    for deployment in spec["deployments"]:
        deployment["work_pool"] = copy.deepcopy(pool)
    return spec


def continuous_eval_parameters(config_path: str, overrides: list[str], every: str | None) -> tuple[dict, int]:
    """The continuous-eval deployment's parameters for `config_path` and `overrides` (with `every`, as the
    override `continuous_eval.interval`: the config is the one place the interval lives) and the
    schedule's interval in seconds; the config is loaded, so a mistake in it stops `kiln deploy` at once."""
    if every is not None:
        overrides = [*overrides, f"continuous_eval.interval={every}"]
    cfg = load_config(config_path, overrides)
    return {"config_path": config_path, "overrides": overrides}, cfg.continuous_eval.interval


def duration(seconds: float) -> str:
    """`90 s`, `10 min`, `2 h`: an interval as a person reads it."""
    for unit, size in (("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size:.0f} {unit}"
    return f"{seconds:g} s"


def deploy(continuous_eval_config: str | None = None, overrides: list[str] | None = None,
           alert_webhook: str | None = None, pool: str = "process", image: str | None = None,
           every: str | None = None) -> str:
    """Register every deployment on the work pool `pool` (process or kubernetes; a Kubernetes pool
    runs flows in `image`, Kiln's image: infra/container/Dockerfile) and the crashed-run detector; with
    `continuous_eval_config`, give the continuous-eval deployment that config and a schedule every
    `continuous_eval.interval` (`every` overrides it), switched on; with `alert_webhook`, create the
    alert automations (`flows.alerts`). Returns a short summary (`prefect deploy`'s own output only when
    it fails)."""
    _require_server()
    if pool == "kubernetes" and not image:
        raise KilnError("the kubernetes work pool runs flows in a container: give its image with --image "
                        "(or KILN_IMAGE): Kiln's image, built from infra/container/Dockerfile (Kiln, kubectl and "
                        "the project folder /opt/kiln in it)")
    if every is not None and continuous_eval_config is None:
        raise KilnError("--every sets the continuous-eval schedule's interval: give the config it watches too, "
                        "--continuous-eval CONFIG.yaml")
    watched = None if continuous_eval_config is None else \
        continuous_eval_parameters(continuous_eval_config, list(overrides or []), every)
    name = ensure_work_pool(pool)
    spec = prefect_file_for(pool)
    # `prefect deploy` resolves the pull step's {{ $KILN_PROJECT_DIR }} now: this folder, or the image's
    project = str(Path.cwd()) if pool == "process" else work_pool(pool)["job_variables"]["env"][PROJECT_DIR_VARIABLE]
    env = {PROJECT_DIR_VARIABLE: project, **({"KILN_IMAGE": image} if image else {})}
    registered = {"pull": spec.get("pull") or [], "deployments": spec["deployments"]}  # not the unused definitions
    written = asyncio.run(register_deployments(resolve_placeholders(registered, env)))
    wanted = [d["name"] for d in spec["deployments"]]
    missing = sorted(set(wanted) - asyncio.run(_deployment_names(name)))
    if missing:
        raise KilnError(f"the Prefect server did not keep {', '.join(missing)} on {name}: deploy again, or look "
                        "at its log (work_dir/servers/prefect.log)")
    stages = sum(d["entrypoint"].startswith("kiln.flows.stages:") for d in spec["deployments"])
    summary = [f"{len(wanted)} deployments on work pool {name}: kiln-pipeline/pipeline, kiln-<stage>/<stage> for "
               f"each of {stages} stages, {CONTINUOUS_EVAL}" + (f" (image {image})" if image else "") +
               (f"; {written} registered or changed, the others as they were" if written < len(wanted) else ""),
               f"flows run in {project}: config paths, data paths and work_dir resolve there"]
    if watched is not None:
        summary.append(schedule_continuous_eval(continuous_eval_config, *watched))
    else:
        summary.append("continuous eval has no schedule (kiln deploy --continuous-eval CONFIG [--every 60s] "
                       "gives it one)")

    window = create_crash_detector()
    summary.append(f"crashed runs: {UNRESPONSIVE} marks a deployment run Crashed after {duration(window.total_seconds())} "
                   "without a heartbeat" if window is not None else
                   f"crashed runs: not detected ({HEARTBEAT_SETTING} is off here): a dead worker's run stays Running")
    if alert_webhook:
        summary.append(f"alerts to {alert_webhook}: {', '.join(create_alerts(alert_webhook))}")
    return "\n".join(summary)


def resolve_placeholders(value: Any, env: dict[str, str]) -> Any:
    """`value` with each `{{ $NAME }}` (prefect.yaml's environment placeholders) replaced by `env[NAME]`, as
    `prefect deploy` resolves them when it registers; a placeholder `env` lacks is an error naming it."""
    if isinstance(value, dict):
        return {k: resolve_placeholders(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_placeholders(v, env) for v in value]
    if isinstance(value, str):
        for name in re.findall(r"{{\s*\$(\w+)\s*}}", value):
            if name not in env:
                raise KilnError(f"{PREFECT_FILE} names ${name}, which kiln deploy does not set")
            value = re.sub(r"{{\s*\$" + name + r"\s*}}", env[name], value)
    return value


class PullSteps:
    """What a registered deployment's runs do before they start (prefect.yaml's `pull:`, resolved): the
    storage `RunnerDeployment` asks for its pull steps, with no code of its own to pull. `prefect deploy`
    passes the same kind of shim (its private `_PullStepStorage`)."""

    pull_interval = 60

    def __init__(self, steps: list[dict[str, Any]]) -> None:
        self.steps = steps
        self.destination = Path.cwd()

    def set_base_path(self, path: Path) -> None:
        self.destination = path

    async def pull_code(self) -> None:
        pass

    def to_pull_step(self) -> list[dict[str, Any]]:
        return self.steps


async def register_deployments(spec: dict) -> int:
    """Register every deployment of `spec` (prefect.yaml, placeholders resolved) as `prefect deploy --all`
    does, from this process: each flow is imported once (`prefect deploy` loads every entrypoint again for
    each deployment, and writes them one by one: 18-40 s for Kiln's 18). A deployment the server already
    holds as `spec` says is not written again (a redeploy with no change reads one list); an existing
    deployment's schedules are kept (continuous eval's), as `prefect deploy` keeps them, and so is the
    config continuous eval watches (`prefect deploy` reset it). Returns how many were written."""
    from prefect.client.orchestration import get_client
    from prefect.deployments.runner import EntrypointType, RunnerDeployment
    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema

    flows = {d["entrypoint"]: None for d in spec["deployments"]}
    for entrypoint in flows:
        flows[entrypoint] = load_flow_from_entrypoint(entrypoint)
    steps = spec.get("pull") or []
    async with get_client() as client:
        held = {(d.entrypoint, d.name): d for d in await client.read_deployments()}

    def parameters(d: dict) -> dict:
        """The spec's, but the config continuous eval watches (`schedule_continuous_eval`) stays: a redeploy
        that reset it would leave its schedule scoring Kiln's default config."""
        current = held.get((d["entrypoint"], d["name"]))
        watched = current is not None and f"{flows[d['entrypoint']].name}/{d['name']}" == CONTINUOUS_EVAL \
            and (current.parameters or {}).get("config_path")
        return dict(current.parameters) if watched else (d.get("parameters") or {})

    def unchanged(d: dict) -> bool:
        current, flow, pool = held.get((d["entrypoint"], d["name"])), flows[d["entrypoint"]], d["work_pool"]
        if current is None:
            return False
        wanted = {"pull_steps": steps, "parameter_openapi_schema": parameter_schema(flow).model_dump(exclude_unset=True),
                  "job_variables": pool.get("job_variables") or {}, "work_pool_name": pool["name"],
                  "work_queue_name": pool.get("work_queue_name"), "parameters": parameters(d),
                  "description": d.get("description") or flow.description, "tags": d.get("tags") or []}
        return _as_json(wanted) == _as_json({name: getattr(current, name) for name in wanted})

    async def register(d: dict) -> None:
        pool = d["work_pool"]
        deployment = RunnerDeployment.from_flow(
            flows[d["entrypoint"]], d["name"], parameters=parameters(d), description=d.get("description"),
            tags=d.get("tags"), work_pool_name=pool["name"], work_queue_name=pool.get("work_queue_name"),
            job_variables=pool.get("job_variables"), entrypoint_type=EntrypointType.MODULE_PATH)
        deployment.entrypoint = d["entrypoint"]  # module:attribute, as prefect.yaml names it
        deployment.storage = PullSteps(steps)
        # an empty list keeps an existing deployment's schedules, as `prefect deploy` passes it for a
        # deployment without any (no schedules at all would clear continuous eval's: from_flow sets them)
        await deployment.aapply(schedules=[])

    changed = [d for d in spec["deployments"] if not unchanged(d)]
    with warnings.catch_warnings():  # Prefect 3.9 warns that a later release will clear them: the test will say
        warnings.filterwarnings("ignore", "Preserving existing schedules", FutureWarning)
        await asyncio.gather(*(register(d) for d in changed))
    return len(changed)


def _as_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


async def _deployment_names(pool: str) -> set[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName

    async with get_client() as client:
        deployments = await client.read_deployments(
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])))
    return {d.name for d in deployments}


def schedule_continuous_eval(config_path: str, parameters: dict, interval: int) -> str:
    """Point the registered continuous-eval deployment at `parameters` (`continuous_eval_parameters`), give it
    one schedule every `interval` seconds, switched on; says so."""
    asyncio.run(_watch(parameters, interval))
    return (f"continuous eval scores {config_path} every {duration(interval)} (it pauses itself once train and "
            "anneal are complete and scored)")


async def _watch(parameters: dict, interval: int) -> None:
    """Point the continuous-eval deployment at `parameters`, replace its schedules with one every
    `interval` seconds, and switch it on (it may have paused itself after an earlier training run)."""
    from datetime import timedelta

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.client.schemas.schedules import IntervalSchedule

    async with get_client() as client:
        deployment = await client.read_deployment_by_name(CONTINUOUS_EVAL)
        await client.update_deployment(deployment.id, DeploymentUpdate(parameters=parameters))
        for schedule in deployment.schedules:
            await client.delete_deployment_schedule(deployment.id, schedule.id)
        await client.create_deployment_schedules(
            deployment.id, [(IntervalSchedule(interval=timedelta(seconds=interval)), True)])
        await client.resume_deployment(deployment.id)


def continuous_eval_schedule() -> str | None:
    """The continuous-eval deployment's schedule as `kiln status` shows it (active every ..., paused, or
    none), with the config it watches; None without a Prefect server or that deployment."""
    if not os.environ.get("PREFECT_API_URL"):
        return None
    return asyncio.run(_schedule_state())


async def _schedule_state() -> str | None:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    async with get_client() as client:
        try:
            deployment = await client.read_deployment_by_name(CONTINUOUS_EVAL)
        except ObjectNotFound:
            return None
    watched = (deployment.parameters or {}).get("config_path")
    schedules = [s for s in deployment.schedules if getattr(s.schedule, "interval", None) is not None]
    if not schedules:
        return f"continuous-eval schedule ({CONTINUOUS_EVAL}): none (kiln deploy --continuous-eval CONFIG gives it one)"
    every = duration(schedules[0].schedule.interval.total_seconds())
    on = not deployment.paused and any(s.active for s in schedules)
    state = f"active, every {every}" if on else f"paused (every {every}; it pauses itself once its stages are scored)"
    return f"continuous-eval schedule ({CONTINUOUS_EVAL}): {state}, watching {watched}"


def run_worker() -> None:
    """Run a Prefect worker for Kiln's pool, once what a crash left running (a dead worker's task runs, MLflow
    runs at $MLFLOW_TRACKING_URI) is marked crashed (`flows.crashes`); returns when it stops. Its flow runs
    start in the project directory each deployment names (see `deploy`), not in this process's folder.

    The worker is a child of this process, which stops it on SIGTERM or SIGINT within `WORKER_STOP_S`
    whatever the servers' state: Prefect's worker turns SIGTERM into a graceful stop that, with its server
    down, waits on its client's retries (observed: alive 80 s later); past the limit it is SIGKILLed. Its
    flow runs are not in its process group and write no output to it (the pool's `stream_output` is off),
    so they outlive it. A worker of a `kiln up`'s servers is recorded there, so `kiln down` stops it."""
    import signal

    api_url = _require_server()
    from kiln.flows.crashes import reap_crashed  # defers prefect

    uri = os.environ.get("MLFLOW_TRACKING_URI")  # the default experiment: a worker has no config of its own
    reap_crashed(MlflowTracker(uri, TrackingConfig().experiment) if uri else None)
    command = [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process"]
    worker = subprocess.Popen(command, env=worker_environment())
    stop_by: list[float] = []

    def stop(signum: int, _frame: object) -> None:
        if not stop_by:
            stop_by.append(time.monotonic() + WORKER_STOP_S)
            worker.send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    folder = servers_of(api_url)
    record = register_worker(folder, os.getpid()) if folder is not None else None
    try:
        while worker.poll() is None:
            if stop_by and time.monotonic() > stop_by[0]:
                print(f"kiln: the Prefect worker did not stop within {WORKER_STOP_S:.0f}s of SIGTERM (its server "
                      "may be down): killed; its flow runs go on", file=sys.stderr, flush=True)
                worker.kill()
            time.sleep(0.1)
    finally:
        if record is not None:
            record.unlink(missing_ok=True)
    if worker.returncode not in (0, -signal.SIGKILL, -signal.SIGTERM) and not stop_by:
        raise KilnError(f"the Prefect worker exited with status {worker.returncode}")


def serve(continuous_eval_config: str | None = None, overrides: list[str] | None = None,
          every: str | None = None) -> None:
    """Serve the pipeline, every stage and (when given a config) continuous eval, every
    `continuous_eval.interval` (`every` overrides it), from this process."""
    if every is not None and continuous_eval_config is None:
        raise KilnError("--every sets the continuous-eval schedule's interval: give --continuous-eval CONFIG.yaml too")
    from prefect import serve as prefect_serve

    from kiln.flows.continuous_eval import continuous_eval  # defers prefect
    from kiln.flows.pipeline import pipeline  # defers prefect
    from kiln.flows.stages import STAGE_FLOWS  # defers prefect

    deployments = [pipeline.to_deployment("pipeline")]
    deployments += [stage_flow.to_deployment(name) for name, stage_flow in STAGE_FLOWS.items()]
    if continuous_eval_config is not None:
        parameters, interval = continuous_eval_parameters(continuous_eval_config, list(overrides or []), every)
        deployments.append(continuous_eval.to_deployment("continuous-eval", interval=interval, parameters=parameters))
    prefect_serve(*deployments)
