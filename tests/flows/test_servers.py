"""`kiln up` / `kiln down` start and stop real Prefect and MLflow servers on loopback, and a pipeline
run finds them through PREFECT_API_URL and MLFLOW_TRACKING_URI."""

import json
import os
import socket
import subprocess
import sys
import urllib.request

import pytest
from mlflow.tracking import MlflowClient

from flows.cli import main
from flows.servers import read_servers, servers_dir

# `kiln up` starts Prefect and MLflow servers; a tiny run to collect through them may take 300 s on a busy machine
pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(600)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_up_serves_both_uis_a_run_records_there_and_down_stops_them(in_repo, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # where `kiln up` records its work dirs
    work = tmp_path / "work"
    prefect_port, mlflow_port = free_port(), free_port()
    args = [f"work_dir={work}", "--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port)]
    try:
        assert main(["up", *args]) == 0
        out = capsys.readouterr().out
        assert f"http://127.0.0.1:{prefect_port}" in out and f"http://127.0.0.1:{mlflow_port}" in out
        servers = read_servers(work)
        assert {s.name for s in servers} == {"prefect", "mlflow"}
        assert main(["up", *args]) == 0  # idempotent: reports the running servers
        assert {s.pid for s in read_servers(work)} == {s.pid for s in servers}

        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
        for line in (servers_dir(work) / "env").read_text().splitlines():
            name, value = line.removeprefix("export ").split("=", 1)
            env[name] = value
        run = subprocess.run([sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", f"work_dir={work}",
                              "--until", "collect"], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        assert f"http://127.0.0.1:{mlflow_port}" in run.stdout  # the hint points at the running UIs

        client = MlflowClient(f"http://127.0.0.1:{mlflow_port}")
        runs = client.search_runs([client.get_experiment_by_name("kiln").experiment_id])
        assert {r.data.tags["kiln.stage"] for r in runs} == {"pipeline", "collect"}
        request = urllib.request.Request(f"http://127.0.0.1:{prefect_port}/api/flow_runs/filter", data=b"{}",
                                         headers={"Content-Type": "application/json"})
        flow_runs = json.loads(urllib.request.urlopen(request, timeout=10).read())
        assert [r["state_type"] for r in flow_runs] == ["COMPLETED"]
        assert not (work / "mlflow.db").exists()  # nothing fell back to the embedded store
    finally:
        assert main(["down", f"work_dir={work}"]) == 0
    assert "stopped: prefect, mlflow" in capsys.readouterr().out
    assert read_servers(work) == []
    for port in (prefect_port, mlflow_port):
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0
