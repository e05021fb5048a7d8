"""Kiln operated on a PostgreSQL of Kiln's own (`kiln up --database postgres`): `kiln up` in a
project folder, `kiln deploy --alert-webhook`, `kiln worker`, a deployment run of the project's config
that fails at clean (a wrong blocklist path), the alert it sends, the fix and the UI's Retry (collect
Cached, clean Completed), each attempt's MLflow runs, then `kiln down` stopping every server (and, on
PostgreSQL, the database, whose records outlive it). On PostgreSQL the database is also SIGKILLed and
`kiln up` restarts it as it was.

The project (its config and data) is tests/flows/test_project.py's, run only to clean here. The same
scenario on the embedded SQLite (`kiln up`'s default) is test_project.py's and test_operate.py's; it is
kept as a parameter so that `-k sqlite` can still run it here.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

import psycopg
import pytest

from kiln.flows.database import SECRETS_FILE
from kiln.flows.servers import read_servers
from tests.flows.test_operate import FINAL, WebhookReceiver, free_port
from tests.flows.test_project import BLOCKLIST, CONFIG, WRONG_BLOCKLIST, Project, write_project

# servers, deployments, a worker and two attempts of one flow run, per database: measured in the closing note
pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(900)]


@pytest.fixture
def reachable_root():
    """A folder PostgreSQL's account can enter (pytest's own are root's, mode 0700): as root, Kiln runs
    the database as the `postgres` account, in the work dir's servers/ folder."""
    root = Path(tempfile.mkdtemp(prefix="kiln-servers-"))
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("database", ["postgres"])
def test_deploy_worker_failure_alert_and_retry_on_each_database(database, reachable_root):
    project = Project(reachable_root)
    write_project(project.folder)
    webhook = WebhookReceiver()
    ports = {"--prefect-port": str(free_port()), "--mlflow-port": str(free_port())}
    up = [arg for option in ports.items() for arg in option] + ["--database", database]
    ops = project.folder / "ops"
    try:
        started = time.perf_counter()
        shown = project.kiln("up", "--work-dir", "ops", *up, timeout_s=600).stdout
        up_s = time.perf_counter() - started
        servers = {s.name: s for s in read_servers(ops)}
        assert set(servers) == {"prefect", "mlflow"} | ({"postgres"} if database == "postgres" else set())
        assert project.kiln("up", "--work-dir", "ops", *up).stdout == shown  # running: reported, not restarted
        for private in ("env", "servers.json", *([SECRETS_FILE] if database == "postgres" else [])):
            assert (ops / "servers" / private).stat().st_mode & 0o077 == 0, f"{private} is readable by others"
        project.source(ops / "servers" / "env")
        project.kiln("deploy", "--alert-webhook", f"http://127.0.0.1:{webhook.server_port}/hook")
        project.start_worker()

        flow_run_id = project.api.run_deployment("kiln-pipeline/pipeline", {"config_path": CONFIG, "until": "clean"})
        assert project.api.wait(flow_run_id, FINAL)["state_type"] == "FAILED"
        alert = webhook.wait_for("Kiln: a stage failed", "clean")  # the automation, run by this database's server
        assert WRONG_BLOCKLIST in alert
        config = project.folder / CONFIG
        config.write_text(config.read_text().replace(WRONG_BLOCKLIST, BLOCKLIST))
        project.api.retry_like_the_ui(flow_run_id)
        run = project.api.wait(flow_run_id, FINAL)
        assert (run["state_type"], run["run_count"]) == ("COMPLETED", 2)
        assert project.api.task_states(flow_run_id) == [("collect", "Completed"), ("clean", "Failed"),
                                                        ("collect", "Cached"), ("clean", "Completed")]
        runs = project.runs(flow_run_id)  # in this database's MLflow
        assert sorted((r.info.run_name, r.data.tags["kiln.status"]) for r in runs if "kiln.status" in r.data.tags) == [
            ("clean", "failed"), ("clean (attempt 2)", "ran"), ("collect", "ran"), ("collect (attempt 2)", "cached")]
        assert [r.info.status for r in runs if r.data.tags["kiln.stage"] == "pipeline"] == ["FINISHED"]
        assert not list((project.folder / "work").glob("store/.tracking-spool/*.jsonl"))  # MLflow took every write

        if database == "postgres":
            assert not (ops / "servers" / "mlflow.db").exists() and not (ops / "servers" / "prefect" / "prefect.db").exists()
            assert count_rows(ops, "mlflow", "runs") == 5 and count_rows(ops, "prefect", "flow_run") == 1
    finally:
        if project.worker is not None and project.worker.poll() is None:
            os.killpg(project.worker.pid, signal.SIGTERM)
            project.worker.wait(timeout=30)
        webhook.shutdown()
        down = project.kiln("down", "--work-dir", "ops").stdout
    expected = "stopped: prefect, mlflow" + (", postgres" if database == "postgres" else "")
    assert expected in down
    assert read_servers(ops) == []
    for port in ports.values():
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", int(port))) != 0
    assert (database == "postgres") == (ops / "servers" / "postgres" / "PG_VERSION").is_file()  # its records, kept
    print(f"\n{database}: kiln up {up_s:.1f}s")


def count_rows(ops: Path, database: str, table: str) -> int:
    """Rows of `table` in Kiln's PostgreSQL, read with the role and password `kiln up` keeps."""
    secrets = {k: v for k, v in (line.removeprefix("export ").split("=", 1)
                                 for line in (ops / "servers" / SECRETS_FILE).read_text().splitlines()
                                 if line.startswith("export "))}
    with psycopg.connect(host=secrets["PGHOST"], port=int(secrets["PGPORT"]), user=secrets["PGUSER"],
                         password=secrets["PGPASSWORD"], dbname=database, connect_timeout=10) as connection:
        return connection.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
