"""A `kiln worker`'s life beside the runs it starts, on real `kiln up` servers: a run whose worker is
SIGKILLed goes on to complete (its console is not a pipe to the dead worker), `kiln down` stops the
workers of its servers and says so, and a worker whose Prefect server is gone stops on SIGTERM within
10 s.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from kiln.flows.cli import main
from kiln.flows.servers import read_servers, servers_dir
from tests.flows.test_operate import FINAL, Operated

# servers, deployments, a worker and one short pipeline run (collect, clean) of the tiny config
pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(900)]


def worker_processes(pid: int) -> list[psutil.Process]:
    """`kiln worker` and the Prefect worker under it: its session, not the flow runs it started in their own."""
    root = psutil.Process(pid)
    return [p for p in [root, *root.children(recursive=True)] if os.getsid(p.pid) == os.getsid(pid)]


@pytest.fixture
def operated(kiln_servers, tmp_path):
    ops = Operated(tmp_path)
    try:
        deployed = ops.kiln("deploy")
        assert deployed.returncode == 0, deployed.stderr[-3000:]
        yield ops
    finally:
        if ops.worker is not None and ops.worker.poll() is None:
            ops.kill_worker()
        ops.webhook.shutdown()


def test_a_run_outlives_its_killed_worker_and_workers_stop_on_sigterm(operated, capsys):
    ops = operated
    ops.start_worker()
    flow_run_id = ops.api.run_deployment("kiln-pipeline/pipeline", ops.parameters("run", until="clean"))
    deadline = time.monotonic() + 300
    while ops.api.call("GET", f"/flow_runs/{flow_run_id}")["state_type"] != "RUNNING":
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.5)
    for process in reversed(worker_processes(ops.worker.pid)):  # the worker only, as `kill -9` of it
        process.kill()
    ops.worker.wait(timeout=30)
    run = ops.api.wait(flow_run_id, FINAL, timeout_s=600)
    assert run["state_type"] == "COMPLETED", run["state"]
    console = (ops.root / "run" / "logs" / "flow-runs" / f"{flow_run_id}.log").read_text()
    assert "Finished in state Completed" in console  # its console, kept in its work dir
    status = ops.kiln("status", "configs/tiny.yaml", f"work_dir={ops.root / 'run'}")
    assert status.returncode == 0, status.stderr[-3000:]
    assert "continuous-eval schedule (kiln-continuous-eval/continuous-eval): none" in status.stdout

    # `kiln down` stops the workers of its servers first, and says which
    ops.start_worker()
    home = ops.root / "servers-home"
    deadline = time.monotonic() + 120
    while not (servers_dir(home) / "workers" / str(ops.worker.pid)).is_file():  # the killed one's is left
        assert ops.worker.poll() is None and time.monotonic() < deadline, "the worker never recorded itself"
        time.sleep(0.5)
    capsys.readouterr()
    assert main(["down", f"work_dir={home}"]) == 0
    said = capsys.readouterr().out
    assert f"stopped kiln worker(s): pid {ops.worker.pid}" in said and "stopped: prefect, mlflow" in said
    assert ops.worker.wait(timeout=5) is not None

    # a worker whose server is gone: SIGTERM stops it within 10 s
    assert main(["up", f"work_dir={home}", "--prefect-port", ops.api.url.rsplit(":", 1)[1].split("/")[0],
                 "--mlflow-port", ops.mlflow.rsplit(":", 1)[1]]) == 0
    log = ops.root / "worker.log"
    started = log.read_text().count("started!")
    ops.start_worker()
    deadline = time.monotonic() + 120  # polling its server: Prefect's worker says so once its loops run
    while log.read_text().count("started!") == started:
        assert ops.worker.poll() is None and time.monotonic() < deadline, "the worker never started polling"
        time.sleep(0.5)
    time.sleep(3)  # a few polls (PREFECT_WORKER_QUERY_SECONDS=1)
    assert ops.worker.poll() is None
    prefect = next(s for s in read_servers(home) if s.name == "prefect")
    os.killpg(prefect.pid, signal.SIGKILL)
    time.sleep(3)
    started = time.monotonic()
    ops.worker.send_signal(signal.SIGTERM)
    ops.worker.wait(timeout=60)
    assert time.monotonic() - started <= 10.5, f"the worker took {time.monotonic() - started:.1f} s to stop"
