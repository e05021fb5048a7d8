"""Launch files render and point at real flows: every stage, the pipeline and continuous eval have a
deployment, on the process work pool or on the Kubernetes one (whose Jobs are checked against the
Kubernetes OpenAPI schemas: there is no cluster here)."""

import asyncio
import importlib
import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from prefect import Flow

from kiln.tasks.errors import KilnError
from kiln.tasks.stages import REGISTRY

INFRA = Path(__file__).resolve().parents[2] / "infra"


def test_every_registered_stage_the_pipeline_and_continuous_eval_are_deployable():
    spec = yaml.safe_load((INFRA / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in spec["deployments"]}
    assert set(deployments) == {"pipeline", "continuous-eval", *REGISTRY.names()}
    for stage in REGISTRY:
        assert deployments[stage.name]["entrypoint"] == f"kiln.flows.stages:{stage.name.replace('-', '_')}"
    for name, deployment in deployments.items():
        module, attr = deployment["entrypoint"].split(":")  # a module of the installed package, not a file
        target = getattr(importlib.import_module(module), attr)
        assert isinstance(target, Flow), f"{name}: {deployment['entrypoint']} is not a Prefect flow"
        assert deployment["work_pool"]["name"] == "kiln-process"
        assert set(deployment["parameters"]) <= set(target.parameters.properties)
    # No schedule in the file: `kiln deploy --continuous-eval CONFIG` gives continuous eval one, every
    # continuous_eval.interval of that config (the one place the default lives); one run at a time.
    assert not any(d.get("schedules") for d in deployments.values())
    assert deployments["continuous-eval"]["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}


def test_compose_services_share_the_database():
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    assert set(compose["services"]) == {"postgres", "prefect", "mlflow"}
    prefect_db = compose["services"]["prefect"]["environment"]["PREFECT_SERVER_DATABASE_CONNECTION_URL"]
    assert prefect_db.startswith("postgresql+asyncpg://") and "@postgres:5432/prefect" in prefect_db
    mlflow_db = compose["services"]["mlflow"]["environment"]["MLFLOW_BACKEND_STORE_URI"]
    assert mlflow_db.startswith("postgresql+psycopg2://") and "@postgres:5432/mlflow" in mlflow_db
    assert "POSTGRES_PASSWORD" not in compose["services"]["mlflow"]["command"]  # `ps` would show it
    assert "CREATE DATABASE mlflow" in (INFRA / "postgres-init.sql").read_text()


def test_compose_publishes_on_loopback_only_and_commits_no_password():
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    ports = [port for service in compose["services"].values() for port in service.get("ports", [])]
    assert ports and all(port.startswith("127.0.0.1:") for port in ports)
    assert compose["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD:?")
    assert "kiln:kiln@" not in (INFRA / "compose.yaml").read_text()


# --- work pools: process (the default) and Kubernetes -------------------------------------------------

K8S_VERSION = "1.37"  # the newest Kubernetes whose OpenAPI schemas kubernetes-validate ships
IMAGE = "ghcr.io/kiln/kiln:0.1.0"


def test_both_work_pools_are_declared():
    pools = yaml.safe_load((INFRA / "prefect.yaml").read_text())["definitions"]["work_pools"]
    assert {kind: pool["name"] for kind, pool in pools.items()} == {"process": "kiln-process",
                                                                   "kubernetes": "kiln-kubernetes"}
    assert pools["kubernetes"]["job_variables"]["image"] == "{{ $KILN_IMAGE }}"  # resolved by `prefect deploy`
    # the same process settings, plus where Kiln lives in the image (the pull step's directory)
    assert pools["kubernetes"]["job_variables"]["env"] == {**pools["process"]["job_variables"]["env"],
                                                           "KILN_PROJECT_DIR": "/opt/kiln"}
    assert not (INFRA / "work-pools" / "process.json").exists()  # the process pool keeps Prefect's template


def test_kubernetes_pool_template_is_prefect_kubernetes_default_plus_the_store():
    """What Kiln changes in prefect-kubernetes' default base job template, and nothing else."""
    from prefect_kubernetes.worker import KubernetesWorker

    ours = json.loads((INFRA / "work-pools" / "kubernetes.json").read_text())
    default = KubernetesWorker.get_default_base_job_template()
    pod = ours["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    assert pod.pop("volumes") == [{"name": "store", "persistentVolumeClaim": {"claimName": "{{ store_claim }}"}}]
    assert pod["containers"][0].pop("volumeMounts") == [{"name": "store", "mountPath": "{{ store_path }}"}]
    variables = ours["variables"]["properties"]
    assert {variables.pop("store_claim")["default"], variables.pop("store_path")["default"]} == {"kiln-store", "/kiln"}
    assert variables["service_account_name"].pop("default") == "kiln"  # infra/k8s/cluster-setup.yaml
    variables["service_account_name"]["description"] = default["variables"]["properties"]["service_account_name"][
        "description"]
    default["variables"]["properties"]["service_account_name"].pop("default")
    assert ours == default


def test_cluster_setup_is_valid_kubernetes():
    docs = list(yaml.safe_load_all((INFRA / "k8s" / "cluster-setup.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["ServiceAccount", "Role", "RoleBinding", "PersistentVolumeClaim"]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    template = json.loads((INFRA / "work-pools" / "kubernetes.json").read_text())["variables"]["properties"]
    assert docs[0]["metadata"]["name"] == template["service_account_name"]["default"]
    assert docs[3]["metadata"]["name"] == template["store_claim"]["default"]
    assert docs[3]["spec"]["accessModes"] == ["ReadWriteMany"]  # flow-run pods and training pods share it
    # the launcher's kubectl verbs (tasks/launch/kubernetes.py) are all allowed
    allowed = {(resource, verb) for rule in docs[1]["rules"] for resource in rule["resources"] for verb in rule["verbs"]}
    assert {("jobs", "create"), ("jobs", "patch"), ("jobs", "get"), ("jobs", "delete"), ("services", "create"),
            ("services", "patch"), ("pods", "list"), ("pods/log", "get")} <= allowed


def test_every_deployment_heartbeats_at_the_cadence_the_crash_alert_assumes():
    """The unresponsive-run detector's window is three heartbeats of the deploying process's setting
    (flows/alerts.py); every deployment run gets that setting in its job env, on either pool, whatever
    the worker's own environment says. With heartbeats off there is no detector and nothing is set."""
    from datetime import timedelta

    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, get_current_settings, temporary_settings

    from kiln.flows.alerts import unresponsive_after
    from kiln.flows.deploy import prefect_file_for, work_pool

    for kind in ("process", "kubernetes"):
        with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 45}):
            spec = prefect_file_for(kind)
            assert unresponsive_after(get_current_settings().flows.heartbeat_frequency) == timedelta(seconds=135)
        envs = [d["work_pool"]["job_variables"]["env"] for d in spec["deployments"]]
        assert len(envs) == len(spec["deployments"]) > 10
        assert all(env == {**work_pool(kind)["job_variables"]["env"], "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "45"}
                   for env in envs)
        with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            assert unresponsive_after(get_current_settings().flows.heartbeat_frequency) is None
            assert all(d["work_pool"]["job_variables"]["env"] == work_pool(kind)["job_variables"]["env"]
                       for d in prefect_file_for(kind)["deployments"])
    assert "PREFECT_FLOWS_HEARTBEAT_FREQUENCY" not in work_pool("process")["job_variables"]["env"]  # the file is unchanged


def test_kiln_missed_heartbeats_sets_the_crash_window_and_a_bad_value_says_how_to_fix_it(monkeypatch):
    """$KILN_MISSED_HEARTBEATS changes how many heartbeats the detector's window holds (3 without it); fewer
    than 2, or not a number, is refused naming the variable."""
    from datetime import timedelta

    from kiln.flows.alerts import unresponsive_after
    from kiln.tasks.errors import KilnError

    monkeypatch.delenv("KILN_MISSED_HEARTBEATS", raising=False)
    assert unresponsive_after(30) == timedelta(seconds=90)
    monkeypatch.setenv("KILN_MISSED_HEARTBEATS", "2")
    assert unresponsive_after(30) == timedelta(seconds=60)
    assert unresponsive_after(None) is None
    for bad in ("1", "0", "two", "-3", "2.5"):
        monkeypatch.setenv("KILN_MISSED_HEARTBEATS", bad)
        with pytest.raises(KilnError, match=f"KILN_MISSED_HEARTBEATS='{bad}' is not a whole number of at least 2"):
            unresponsive_after(30)


@pytest.fixture
def api_url(prefect_api, monkeypatch):
    """The test Prefect API, also for the `prefect` subprocesses `kiln deploy` starts."""
    from prefect.settings import PREFECT_API_URL

    monkeypatch.setenv("PREFECT_API_URL", PREFECT_API_URL.value())
    return PREFECT_API_URL.value()


def test_kiln_deploy_on_the_kubernetes_pool_gives_a_valid_job_manifest(api_url):
    """Against a real Prefect API: both pools are created (from infra/work-pools/ where a template is
    declared), every deployment moves to the Kubernetes pool with its image, and the Job that
    prefect-kubernetes' worker would create for a flow run of it is valid Kubernetes. No cluster:
    nothing is submitted."""
    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings
    from prefect.workers.process import ProcessWorker
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    from kiln.flows.deploy import deploy, ensure_work_pool

    with pytest.raises(KilnError, match="--image"):
        deploy(pool="kubernetes")
    assert ensure_work_pool("process") == "kiln-process"
    summary = deploy(pool="kubernetes", image=IMAGE)
    assert summary.startswith(f"{len(REGISTRY.names()) + 2} deployments on work pool kiln-kubernetes") and IMAGE in summary
    assert ensure_work_pool("kubernetes") == "kiln-kubernetes"  # exists: left as it is

    async def read():
        async with get_client() as client:
            pools = {name: await client.read_work_pool(name) for name in ("kiln-process", "kiln-kubernetes")}
            deployment = await client.read_deployment_by_name("kiln-train/train")
            flow_run = await client.create_flow_run_from_deployment(deployment.id)
            config = await KubernetesWorkerJobConfiguration.resolve_for_flow_run(
                flow_run, client=client, work_pool=pools["kiln-kubernetes"], worker_name="kiln-test",
                deployment=deployment)
            return pools, deployment, config

    pools, deployment, config = asyncio.run(read())
    assert (pools["kiln-process"].type, pools["kiln-kubernetes"].type) == ("process", "kubernetes")
    assert pools["kiln-process"].base_job_template == ProcessWorker.get_default_base_job_template()
    assert pools["kiln-kubernetes"].base_job_template == json.loads(
        (INFRA / "work-pools" / "kubernetes.json").read_text())
    assert deployment.work_pool_name == "kiln-kubernetes"
    assert deployment.job_variables["image"] == IMAGE
    # `prefect deploy` resolves the pull step's directory: the project folder in the image, not this one
    assert deployment.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": "/opt/kiln"}}]

    job = config.job_manifest
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == IMAGE and pod["serviceAccountName"] == "kiln"
    assert {"name": "KILN_PROJECT_DIR", "value": "/opt/kiln"} in container["env"]
    heartbeat = str(get_current_settings().flows.heartbeat_frequency)  # what the crash alert assumes
    assert {"name": "PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "value": heartbeat} in container["env"]
    assert container["volumeMounts"] == [{"name": "store", "mountPath": "/kiln"}]
    assert pod["volumes"] == [{"name": "store", "persistentVolumeClaim": {"claimName": "kiln-store"}}]
    # prefect-kubernetes' own validator demands these two in the pod spec, where the Job API has no such
    # fields (the API server drops them, with a warning); everything else must be valid, strictly
    assert (pod.pop("parallelism"), pod.pop("completions")) == (1, 1)
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_kiln_deploy_gives_process_pool_runs_the_alerts_heartbeat(api_url, tmp_path, monkeypatch):
    """The flow-run process a process worker would start for a deployment run gets the heartbeat setting
    (job env wins over the worker's own environment), and starts in the folder `kiln deploy` ran in (the
    user's project), not in Kiln's checkout. Without a webhook the crashed-run detector is made all the
    same, and `--continuous-eval CONFIG --every 90s` gives continuous eval its schedule, switched on. A
    redeploy writes only the deployments that changed, and keeps the schedule."""
    from datetime import timedelta

    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings
    from prefect.workers.process import ProcessJobConfiguration

    from kiln.flows.alerts import UNRESPONSIVE
    from kiln.flows.deploy import CONTINUOUS_EVAL, deploy

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("continuous_eval: {interval: 10m}\n")  # a project's config, relative to it
    with pytest.raises(KilnError, match="--every sets the continuous-eval schedule's interval"):
        deploy(every="90s")
    with pytest.raises(KilnError, match="continuous_eval.interval: .*give seconds"):  # before anything is deployed
        deploy("mine.yaml", every="soon")
    summary = deploy("mine.yaml", every="90s")
    assert f"flows run in {tmp_path}" in summary and "prefect worker start" not in summary
    assert "continuous eval scores mine.yaml every 90 s" in summary
    assert f"crashed runs: {UNRESPONSIVE} marks a deployment run Crashed after 9 min without a heartbeat" in summary

    async def resolve():
        async with get_client() as client:
            pool = await client.read_work_pool("kiln-process")
            deployment = await client.read_deployment_by_name("kiln-pipeline/pipeline")
            flow_run = await client.create_flow_run_from_deployment(deployment.id)
            watching = await client.read_deployment_by_name(CONTINUOUS_EVAL)
            detectors = await client.read_automations_by_name(UNRESPONSIVE)
            return deployment, await ProcessJobConfiguration.resolve_for_flow_run(
                flow_run, client=client, work_pool=pool, worker_name="kiln-test", deployment=deployment), \
                watching, detectors

    deployment, config, watching, detectors = asyncio.run(resolve())
    assert len(detectors) == 1 and detectors[0].trigger.within == timedelta(seconds=540)
    assert watching.parameters == {"config_path": "mine.yaml", "overrides": ["continuous_eval.interval=90s"]}
    assert [(s.schedule.interval, s.active) for s in watching.schedules] == [(timedelta(seconds=90), True)]
    assert not watching.paused
    heartbeat = str(get_current_settings().flows.heartbeat_frequency)
    assert config.env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == heartbeat
    assert deployment.entrypoint == "kiln.flows.pipeline:pipeline"  # from the installed package, wherever it is
    assert deployment.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(tmp_path)}}]
    assert config.env["OMP_WAIT_POLICY"] == "PASSIVE"

    # a redeploy with nothing changed writes nothing (and keeps the schedule and the config it watches); from
    # another folder, each changes
    from kiln.flows.deploy import prefect_file_for

    every = len(prefect_file_for("process")["deployments"])
    assert f"{every} deployments on work pool kiln-process" in summary and "registered or changed" not in summary
    assert "; 0 registered or changed, the others as they were" in deploy()
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.chdir(other)
    assert "registered or changed" not in deploy()

    async def read():
        async with get_client() as client:
            return (await client.read_deployment_by_name("kiln-pipeline/pipeline"),
                    await client.read_deployment_by_name(CONTINUOUS_EVAL))

    deployment, watching = asyncio.run(read())
    assert deployment.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(other)}}]
    assert [(s.schedule.interval, s.active) for s in watching.schedules] == [(timedelta(seconds=90), True)]
    assert watching.parameters == {"config_path": "mine.yaml", "overrides": ["continuous_eval.interval=90s"]}

