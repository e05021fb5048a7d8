"""The unresponsive-run detector `kiln deploy` creates (`flows.alerts.create_crash_detector`), on a real
`kiln up` server: 20 short flow runs that heartbeat and complete in a second stay Completed (a short
run's heartbeat may reach the server after its Completed event, so the detector's trigger can fire for
it: its action must not overwrite a final state), while a run whose process is SIGKILLed after its
first heartbeat is marked Crashed, and, with no worker nor any flow started since, the reaper `kiln up`
started beside the servers marks its task run Crashed and its MLflow run FAILED, each with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from kiln.flows.servers import servers_dir
from tests.flows.test_operate import REPO, PrefectApi
from tests.processes import kill_tree

# the detector waits two heartbeats of 30 s (Prefect's minimum; KILN_MISSED_HEARTBEATS=2, the fewest it takes,
# rather than the default 3: 30 s less to wait), then its proactive check runs
pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(600)]
HEARTBEAT_S = 30
MISSED = 2
WINDOW_S = MISSED * HEARTBEAT_S
SHORT_RUNS = 20
PARALLEL = 4  # processes at a time

DETECTOR = f"""
from kiln.flows.alerts import create_crash_detector

assert create_crash_detector().total_seconds() == {WINDOW_S}
"""
# one run per process, as a worker starts them: the process ends right after its run, so its heartbeat
# (sent by the events client it has just started) may reach the server after the Completed event
SHORT = """
from prefect import flow

@flow(name="kiln-short")
def short() -> None:
    pass

print(short(return_state=True).state_details.flow_run_id)
"""
# a stage as the runner records one: a task run, and an MLflow run owned by this process
HANGS = """
import os
import time
from prefect import flow, task
from kiln.tasks.crashes import OWNER_TAG, process_owner
from kiln.tasks.tracking import MlflowTracker

@task(name="train")
def train() -> None:
    tracker = MlflowTracker(os.environ["MLFLOW_TRACKING_URI"], "kiln")
    tracker.start_run("train/hangs", tags={OWNER_TAG: process_owner()})
    time.sleep(600)

@flow(name="kiln-hangs")
def hangs() -> None:
    train()

hangs()
"""


@pytest.fixture
def server(kiln_servers):
    """The servers' environment, as `source servers/env` gives it, with a 30 s heartbeat, two of which may be missed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    for line in (servers_dir(kiln_servers) / "env").read_text().splitlines():
        name, value = line.removeprefix("export ").split("=", 1)
        env[name] = value
    env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = str(HEARTBEAT_S)
    env["KILN_MISSED_HEARTBEATS"] = str(MISSED)
    return env


def python(env: dict, code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs)


def test_short_runs_stay_completed_and_a_killed_run_is_crashed(server, tmp_path: Path):
    api = PrefectApi(server["PREFECT_API_URL"])
    detector = python(server, DETECTOR)
    assert detector.wait(timeout=120) == 0, detector.stderr.read()[-3000:]
    ids = []
    for _ in range(SHORT_RUNS // PARALLEL):
        batch = [python(server, SHORT) for _ in range(PARALLEL)]
        for short in batch:
            out, err = short.communicate(timeout=300)
            assert short.returncode == 0, err[-3000:]
            ids.append(out.strip().splitlines()[-1])
    assert len(set(ids)) == SHORT_RUNS

    hangs = python(server, HANGS)
    deadline = time.monotonic() + 120
    while True:
        runs = api.call("POST", "/flow_runs/filter", {"flows": {"name": {"any_": ["kiln-hangs"]}}})
        if runs and api.events("prefect.flow-run.heartbeat", f"prefect.flow-run.{runs[0]['id']}"):
            break
        assert time.monotonic() < deadline, "the hanging run sent no heartbeat"
        time.sleep(0.5)
    killed = runs[0]["id"]
    kill_tree(hangs.pid)
    hangs.wait(timeout=30)

    crashed = api.wait(killed, {"CRASHED", "COMPLETED", "FAILED", "CANCELLED"}, timeout_s=WINDOW_S + 120)
    assert crashed["state_name"] == "Crashed" and f"no heartbeat for {WINDOW_S}s" in crashed["state"]["message"]
    time.sleep(15)  # every short run's window closed before the killed run's: let any late action land
    states = {run["id"]: run["state_name"] for run in
              api.call("POST", "/flow_runs/filter", {"flow_runs": {"id": {"any_": ids}}})}
    assert sorted(states) == sorted(ids)
    assert set(states.values()) == {"Completed"}, states

    # server-side reaping: no worker runs here, no flow starts; the reaper passes every 30 s
    mlflow = MlflowClient(server["MLFLOW_TRACKING_URI"])
    deadline = time.monotonic() + 120
    while True:
        task_runs = api.call("POST", "/task_runs/filter", {"flow_runs": {"id": {"any_": [killed]}}})
        runs = mlflow.search_runs([mlflow.get_experiment_by_name("kiln").experiment_id],
                                  filter_string="attributes.run_name = 'train/hangs'")
        if [t["state_type"] for t in task_runs] == ["CRASHED"] and [r.info.status for r in runs] == ["FAILED"]:
            break
        assert time.monotonic() < deadline, (f"not reaped 120 s after the crash: {[t['state'] for t in task_runs]}, "
                                             f"{[r.info.status for r in runs]}")
        time.sleep(2)
    assert task_runs[0]["state"]["message"].startswith(f"its flow run {crashed['name']} ended Crashed while this "
                                                       f"task ran: no heartbeat for {WINDOW_S}s")
    assert runs[0].data.tags["kiln.status"] == "crashed"
    assert runs[0].data.tags["kiln.error"].startswith(f"its process (pid {hangs.pid} on ")
