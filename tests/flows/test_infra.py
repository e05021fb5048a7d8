"""Launch files render and point at real flows: every stage, the pipeline and continuous eval have a deployment."""

import importlib
from pathlib import Path

import yaml
from prefect import Flow

from tasks.stages import REGISTRY

INFRA = Path(__file__).resolve().parents[2] / "infra"


def test_every_registered_stage_the_pipeline_and_continuous_eval_are_deployable():
    spec = yaml.safe_load((INFRA / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in spec["deployments"]}
    assert set(deployments) == {"pipeline", "continuous-eval", *REGISTRY.names()}
    for stage in REGISTRY:
        assert deployments[stage.name]["entrypoint"] == f"flows/stages.py:{stage.name.replace('-', '_')}"
    for name, deployment in deployments.items():
        module, attr = deployment["entrypoint"].split(":")
        target = getattr(importlib.import_module(module.removesuffix(".py").replace("/", ".")), attr)
        assert isinstance(target, Flow), f"{name}: {deployment['entrypoint']} is not a Prefect flow"
        assert deployment["work_pool"]["name"] == "kiln-process"
        assert set(deployment["parameters"]) <= set(target.parameters.properties)
    # Only continuous eval runs on its own, every 10 minutes, one run at a time.
    assert [name for name, d in deployments.items() if d.get("schedules")] == ["continuous-eval"]
    assert deployments["continuous-eval"]["schedules"] == [{"interval": 600, "active": False}]  # kiln deploy --continuous-eval
    assert deployments["continuous-eval"]["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}


def test_compose_services_share_the_database():
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    assert set(compose["services"]) == {"postgres", "prefect", "mlflow"}
    prefect_db = compose["services"]["prefect"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert prefect_db.startswith("postgresql+asyncpg://") and "@postgres:5432/" in prefect_db
    assert "postgresql://" in compose["services"]["mlflow"]["command"]
    assert "CREATE DATABASE mlflow" in (INFRA / "postgres-init.sql").read_text()


def test_compose_publishes_on_loopback_only_and_commits_no_password():
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    ports = [port for service in compose["services"].values() for port in service.get("ports", [])]
    assert ports and all(port.startswith("127.0.0.1:") for port in ports)
    assert compose["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD:?")
    assert "kiln:kiln@" not in (INFRA / "compose.yaml").read_text()
