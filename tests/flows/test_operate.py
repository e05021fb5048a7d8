"""Kiln operated as its users do: `kiln up`, `kiln deploy`, `kiln worker`, a pipeline deployment run
that fails in a middle stage, and the Prefect UI's Retry (the exact API call its button makes).

A failed stage posts an alert to a webhook through the automation `kiln deploy` created.
The retry must reuse the upstream stages (Cached, same keys and files), run the failed stage and
what follows, end Completed as the same flow run, and keep one MLflow pipeline run. A single stage
re-run from its own deployment with the same parameters is Cached. Every process is stopped at
the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.cli import main
from flows.servers import servers_dir

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
UPSTREAM = ("collect", "clean", "dedup")
RETRIED = ("decontaminate", "tokenize")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class PrefectApi:
    """The REST calls the Prefect UI makes."""

    def __init__(self, url: str):
        self.url = url

    def call(self, method: str, path: str, body: dict | None = None):
        request = urllib.request.Request(self.url + path, method=method, headers={"Content-Type": "application/json"},
                                         data=None if body is None else json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or "null")

    def run_deployment(self, name: str, parameters: dict) -> str:
        deployment = self.call("GET", f"/deployments/name/{name}")
        return self.call("POST", f"/deployments/{deployment['id']}/create_flow_run", {"parameters": parameters})["id"]

    def wait(self, flow_run_id: str, states: set[str], timeout_s: float = 600) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run = self.call("GET", f"/flow_runs/{flow_run_id}")
            if run["state_type"] in states:
                return run
            time.sleep(1)
        raise AssertionError(f"flow run {flow_run_id} still {run['state_type']} after {timeout_s}s")

    def retry_like_the_ui(self, flow_run_id: str) -> None:
        self.call("POST", f"/flow_runs/{flow_run_id}/set_state", {
            "state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}, "force": True})

    def task_states(self, flow_run_id: str, timeout_s: float = 60) -> list[tuple[str, str]]:
        """The flow run's task runs (stage, state) in start order, once all are final: task-run
        states reach the server as events, so they may lag the flow run's own final state."""
        deadline = time.monotonic() + timeout_s
        while True:
            runs = self.call("POST", "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
            final = all(r["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for r in runs)
            if final or time.monotonic() > deadline:
                return [(r["name"].rsplit("-", 1)[0], r["state_name"])
                        for r in sorted(runs, key=lambda r: r["expected_start_time"])]
            time.sleep(0.5)


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


class WebhookReceiver(ThreadingHTTPServer):
    """A chat webhook on loopback that keeps every JSON body posted to it."""

    def __init__(self):
        self.received: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                receiver.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def wait_for(self, text: str, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for body in self.received:
                if text in body.get("text", ""):
                    return body["text"]
            time.sleep(0.5)
        raise AssertionError(f"no alert mentioning {text!r} within {timeout_s}s; received {self.received}")


def test_ui_retry_of_a_deployment_run_reuses_what_succeeded(in_repo, tmp_path, capsys):
    servers = tmp_path / "servers-home"
    eval_file = tmp_path / "eval.jsonl"  # missing at first: decontaminate, the 4th stage, fails
    assert main(["up", f"work_dir={servers}", "--prefect-port", str(free_port()),
                 "--mlflow-port", str(free_port())]) == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    for line in (servers_dir(servers) / "env").read_text().splitlines():
        name, value = line.removeprefix("export ").split("=", 1)
        env[name] = value
    env["PREFECT_WORKER_QUERY_SECONDS"] = "1"
    api = PrefectApi(env["PREFECT_API_URL"])
    kiln = [sys.executable, "-m", "flows.cli"]
    worker = None
    webhook = WebhookReceiver()
    try:
        deployed = subprocess.run([*kiln, "deploy", "--alert-webhook", f"http://127.0.0.1:{webhook.server_port}/hook"],
                                  env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert deployed.returncode == 0, deployed.stderr[-3000:]
        assert "schedule off" in deployed.stdout and "kiln-stage-failed" in deployed.stdout
        worker = subprocess.Popen([*kiln, "worker"], env=env, cwd=REPO, start_new_session=True,
                                  stdout=open(tmp_path / "worker.log", "w"), stderr=subprocess.STDOUT)

        parameters = {"config_path": "configs/tiny.yaml", "until": "tokenize",
                      "overrides": [f"work_dir={tmp_path / 'work'}", f"evaluate.eval_files=[{eval_file}]"]}
        flow_run_id = api.run_deployment("kiln-pipeline/pipeline", parameters)
        assert api.wait(flow_run_id, {"FAILED", "CRASHED", "COMPLETED"})["state_type"] == "FAILED"
        store = tmp_path / "work" / "store"
        before = {stage: digests(store / stage) for stage in UPSTREAM}
        alert = webhook.wait_for("Kiln: a stage failed")  # the automation posted the runner's event
        assert "kiln.stage.failed" in alert and "decontaminate" in alert and "does not exist" in alert

        eval_file.write_text((REPO / "data" / "evals" / "heldout.jsonl").read_text())  # the fix
        api.retry_like_the_ui(flow_run_id)
        run = api.wait(flow_run_id, {"FAILED", "CRASHED", "COMPLETED"})
        assert (run["state_type"], run["run_count"]) == ("COMPLETED", 2)
        states = api.task_states(flow_run_id)
        second_attempt = dict(states[len(UPSTREAM) + 1:])
        assert states[:len(UPSTREAM) + 1] == [*((s, "Completed") for s in UPSTREAM), ("decontaminate", "Failed")]
        assert second_attempt == {**{s: "Cached" for s in UPSTREAM}, **{s: "Completed" for s in RETRIED}}
        assert {stage: digests(store / stage) for stage in UPSTREAM} == before  # nothing recomputed

        client = MlflowClient(env["MLFLOW_TRACKING_URI"])
        experiment = client.get_experiment_by_name("kiln").experiment_id
        parents = client.search_runs([experiment], filter_string="tags.`kiln.stage` = 'pipeline'")
        assert [p.data.tags["kiln.prefect_flow_run_id"] for p in parents] == [flow_run_id]
        children = client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
        assert sorted((c.data.tags["kiln.stage"], c.data.tags["kiln.status"]) for c in children) == sorted(
            [(s, "ran") for s in UPSTREAM] + [(s, "cached") for s in UPSTREAM]
            + [("decontaminate", "failed"), ("decontaminate", "ran"), ("tokenize", "ran")])

        # One stage again from its own deployment, with the same parameters: reused, shown as Cached.
        stage_run = api.run_deployment("kiln-tokenize/tokenize", {k: parameters[k] for k in ("config_path", "overrides")})
        assert api.wait(stage_run, {"FAILED", "CRASHED", "COMPLETED"})["state_type"] == "COMPLETED"
        assert api.task_states(stage_run) == [("tokenize", "Cached")]
    finally:
        if worker is not None:
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(timeout=60)
        webhook.shutdown()
        assert main(["down", f"work_dir={servers}"]) == 0
