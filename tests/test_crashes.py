"""Tracked runs a crash ended are found by their owner (a dead process on this host) or, for an owner
another host has, by their orchestrator run having ended; a live owner's run is never touched. Real
MLflow runs in a real (SQLite) store."""

from __future__ import annotations

import socket
import subprocess
import sys

from mlflow.tracking import MlflowClient

from kiln.tasks.crashes import FLOW_RUN_TAG, OWNER_TAG, process_owner, reap_tracked
from kiln.tasks.tracking import MlflowTracker


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_only_runs_whose_owner_died_or_whose_flow_run_ended_are_failed_with_the_reason(tmp_path):
    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "kiln", tmp_path / "artifacts")
    here = socket.gethostname()
    owners = {"dead": f"{here}:{dead_pid()}", "alive": process_owner(), "elsewhere-ended": "gpu-node-7:4242",
              "elsewhere-running": "gpu-node-7:4343", "alive-but-flow-ended": process_owner()}
    flow_runs = {"elsewhere-ended": "flow-a", "elsewhere-running": "flow-b", "alive-but-flow-ended": "flow-a"}
    runs = {name: tracker.start_run(name, tags={OWNER_TAG: owner, FLOW_RUN_TAG: flow_runs.get(name, "none")})
            for name, owner in owners.items()}
    finished = tracker.start_run("finished", tags={OWNER_TAG: owners["dead"]})
    tracker.end_run(finished)
    asked = []

    def ended(flow_run_ids: set[str]) -> dict[str, str]:
        asked.append(flow_run_ids)
        return {"flow-a": "its flow run ended Crashed"}

    reaped = reap_tracked(tracker, ended)

    assert asked == [{"flow-a", "flow-b"}]  # only the owners this host cannot check
    assert reaped == {runs["dead"]: f"its process (pid {owners['dead'].split(':')[1]} on {here}) died without "
                                    "ending it: the worker or machine was killed or crashed",
                      runs["elsewhere-ended"]: "its flow run ended Crashed"}
    client = MlflowClient(tracker.uri)
    status = {name: client.get_run(run_id).info.status for name, run_id in runs.items()}
    assert status == {"dead": "FAILED", "alive": "RUNNING", "elsewhere-ended": "FAILED",
                      "elsewhere-running": "RUNNING", "alive-but-flow-ended": "RUNNING"}
    assert client.get_run(runs["dead"]).data.tags["kiln.status"] == "crashed"
    assert client.get_run(finished).info.status == "FINISHED"
