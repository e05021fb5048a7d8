"""What a crash left RUNNING, with no worker or flow started since: `kiln status` lists it with the reason,
and `kiln reap` marks it FAILED (tagged crashed, with the reason), on a real MLflow store (SQLite), with
no Prefect server (MLflow's runs only). A live owner's run and a finished run are left alone."""

from __future__ import annotations

import socket

from mlflow.tracking import MlflowClient

from kiln.flows.cli import main
from kiln.tasks.config import load_config
from kiln.tasks.crashes import OWNER_TAG, process_owner
from kiln.tasks.settings import open_tracker
from tests.test_crashes import dead_pid


def test_status_lists_a_dead_owners_run_and_reap_marks_it_failed(in_repo, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    args = ["configs/tiny.yaml", f"work_dir={tmp_path}"]
    tracker = open_tracker(load_config(args[0], args[1:]))
    pid = dead_pid()
    here = socket.gethostname()
    dead = tracker.start_run("train/0123abcd", tags={OWNER_TAG: f"{here}:{pid}"})
    alive = tracker.start_run("clean/4567", tags={OWNER_TAG: process_owner()})
    finished = tracker.start_run("collect/89ab", tags={OWNER_TAG: f"{here}:{pid}"})
    tracker.end_run(finished)
    reason = f"its process (pid {pid} on {here}) died without ending it: the worker or machine was killed or crashed"

    capsys.readouterr()
    assert main(["status", *args]) == 0
    out = capsys.readouterr().out
    stale = [line.strip() for line in out.splitlines() if line.strip().startswith("stale:")]
    assert stale == [f"stale: MLflow run train/0123abcd ({dead}) still RUNNING: {reason}"], out
    assert "1 record(s) a crash left running (kiln reap marks them" in out

    assert main(["reap", *args]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [f"marked FAILED: MLflow run {dead}: {reason}",
                                "marked 0 Prefect task run(s) and 1 MLflow run(s) that a crash left running "
                                "(no Prefect server: MLflow's runs only)"]
    client = MlflowClient(tracker.uri)
    assert {run: client.get_run(run).info.status for run in (dead, alive, finished)} == {
        dead: "FAILED", alive: "RUNNING", finished: "FINISHED"}
    assert {k: v for k, v in client.get_run(dead).data.tags.items() if k in ("kiln.status", "kiln.error")} == {
        "kiln.status": "crashed", "kiln.error": reason}

    assert main(["status", *args]) == 0
    assert "stale:" not in capsys.readouterr().out
    assert main(["reap", *args]) == 0  # nothing left: a second pass marks nothing
    assert capsys.readouterr().out.startswith("marked 0 Prefect task run(s) and 0 MLflow run(s)")


def test_a_task_run_its_crashed_flow_run_left_running_is_listed_then_marked(prefect_api, in_repo, tmp_path, capsys,
                                                                           monkeypatch):
    """The Prefect side, on a real Prefect API with no worker: a task run still Running in a flow run that
    ended Crashed is listed by `kiln status` with why, and `kiln reap` marks it Crashed with that reason."""
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL
    from prefect.states import Crashed, Running

    monkeypatch.setenv("PREFECT_API_URL", PREFECT_API_URL.value())
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    @flow(name="kiln-reap-test")
    def pipeline() -> None:
        pass

    @task(name="train")
    def train() -> None:
        pass

    died = "no heartbeat for 90s: the worker or its machine died"
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(pipeline, state=Running())
        task_run = client.create_task_run(train, flow_run.id, dynamic_key="0", state=Running())
        client.set_flow_run_state(flow_run.id, Crashed(message=died), force=True)
    why = f"its flow run {flow_run.name} ended Crashed while this task ran: {died}"
    args = ["configs/tiny.yaml", f"work_dir={tmp_path}"]  # no MLflow store there: Prefect's records only

    capsys.readouterr()
    assert main(["status", *args]) == 0
    stale = [line.strip() for line in capsys.readouterr().out.splitlines() if str(task_run.id) in line]
    assert stale == [f"stale: Prefect task run {task_run.name} ({task_run.id}) still Running: {why}"]

    assert main(["reap", *args]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if str(task_run.id) in line] == [
        f"marked Crashed: Prefect task run {task_run.name} ({task_run.id}): {why}"]
    with get_client(sync_client=True) as client:
        state = client.read_task_run(task_run.id).state
    assert (state.type.value, state.message) == ("CRASHED", why)
    assert main(["status", *args]) == 0
    assert str(task_run.id) not in capsys.readouterr().out


def test_kiln_up_keeps_one_reaper_restarts_a_dead_one_and_down_stops_it(tmp_path):
    """The reaper's life beside the servers' record (its passes are tested above and in
    test_crash_detector.py): one per work dir, started again if it died (and said so), stopped by down."""
    import json
    import os
    import signal

    from kiln.flows.servers import REAPER_FILE, servers_dir, start_reaper, stop_reaper
    from kiln.tasks.keylock import pid_alive

    folder = servers_dir(tmp_path)
    folder.mkdir(parents=True)
    (folder / "servers.json").write_text(json.dumps([  # servers nobody answers for: the reaper's passes wait
        {"name": "prefect", "pid": 0, "url": "http://127.0.0.1:9/api", "ui": "", "health": "", "log": ""},
        {"name": "mlflow", "pid": 0, "url": "http://127.0.0.1:9", "ui": "", "health": "", "log": ""}]))
    first, restarted = start_reaper(tmp_path, ["configs/tiny.yaml"])
    try:
        assert not restarted and pid_alive(first)
        assert start_reaper(tmp_path, ["configs/tiny.yaml"]) == (first, False)  # running: the same one
        os.kill(first, signal.SIGKILL)
        os.waitpid(first, 0)
        second, restarted = start_reaper(tmp_path, ["configs/tiny.yaml"])
        assert restarted and second != first and pid_alive(second)
        assert json.loads((folder / REAPER_FILE).read_text())["command"][-5:] == [
            "reap", "--every", "30s", "configs/tiny.yaml", f"work_dir={tmp_path.resolve()}"]
        assert stop_reaper(tmp_path) == second and not pid_alive(second) and not (folder / REAPER_FILE).exists()
        assert stop_reaper(tmp_path) is None
        third, restarted = start_reaper(tmp_path, [])  # after down: a start, not a restart
        assert not restarted
        assert stop_reaper(tmp_path) == third
    finally:
        stop_reaper(tmp_path)
