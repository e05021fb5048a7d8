"""A user's own project folder, operated with Kiln installed elsewhere: `kiln up --work-dir ops`, `kiln
deploy` and `kiln worker` against those real servers, a deployment run of the project's own config
(relative paths: its data, its work dir) that fails on a config setting, is fixed in the file and
retried as the UI's Retry does, loses its worker mid-stage and is retried again, and `kiln down`
from another folder. Checked: paths resolve in the project, not in Kiln's checkout; Prefect's results
stay in the run's work dir; a retry after a config fix is recorded as that config, each attempt's
stage runs named and tagged apart; what the dead worker left running is marked crashed in Prefect
and MLflow, with why; `kiln status` says why a stage failed.

Kiln's code comes from the installed package (the commands run in the project folder, where no
`flows/` exists); the project holds only its config and data.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.flows.test_operate import FINAL, PrefectApi, free_port
from tests.processes import kill_tree

# servers, deployments, a worker and three attempts of one flow run: 230 s at load average 7-10, 460 s at 12-17
pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
CONFIG = "kiln.yaml"
BLOCKLIST = "lists/blocked-domains.txt"  # the project's list; its config first names it wrongly
WRONG_BLOCKLIST = "lists/blocked_domains.txt"


class Project:
    """The project folder, its servers, its deployments and its worker."""

    def __init__(self, root: Path):
        self.root, self.folder, self.elsewhere = root, root / "project", root / "elsewhere"
        self.elsewhere.mkdir()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "KILN_"))}
        self.env.update(XDG_STATE_HOME=str(root / "state"), PREFECT_WORKER_QUERY_SECONDS="1")
        self.worker: subprocess.Popen | None = None

    def kiln(self, *args: str, cwd: Path | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "kiln.flows.cli", *args], env=self.env, cwd=cwd or self.folder,
                              capture_output=True, text=True, timeout=timeout_s)
        assert done.returncode == 0, f"kiln {' '.join(args)}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
        return done

    def source(self, env_file: Path) -> None:
        for line in env_file.read_text().splitlines():
            name, value = line.removeprefix("export ").split("=", 1)
            self.env[name] = value
        self.api = PrefectApi(self.env["PREFECT_API_URL"])
        self.mlflow = MlflowClient(self.env["MLFLOW_TRACKING_URI"])

    def start_worker(self) -> None:
        """`kiln worker`, started from another folder: the deployments say where flow runs start."""
        log = open(self.root / "worker.log", "a")
        self.worker = subprocess.Popen([sys.executable, "-m", "kiln.flows.cli", "worker"], env=self.env,
                                       cwd=self.elsewhere, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)

    def kill_worker(self) -> None:
        """SIGKILL the worker and every process under it (its flow run), as when its machine dies."""
        kill_tree(self.worker.pid)
        self.worker.wait(timeout=30)

    def runs(self, flow_run_id: str) -> list:
        experiment = self.mlflow.get_experiment_by_name("kiln").experiment_id
        return self.mlflow.search_runs([experiment], filter_string=f"tags.`kiln.prefect_flow_run_id` = '{flow_run_id}'")

    def task_runs(self, flow_run_id: str) -> list[tuple[str, str, str]]:
        """(stage, state, message) of the flow run's task runs, in start order."""
        runs = self.api.call("POST", "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
        return [(r["name"].rsplit("-", 1)[0], r["state_name"], r["state"]["message"] or "")
                for r in sorted(runs, key=lambda r: r["expected_start_time"])]


def write_project(folder: Path) -> None:
    """A project of its own: 15 manual pages as one jsonl file, a URL blocklist, and a config naming them
    (the blocklist by a wrong name: clean fails on its config), relative paths only."""
    (folder / "data").mkdir(parents=True)
    (folder / BLOCKLIST).parent.mkdir()
    (folder / BLOCKLIST).write_text("spam.example\n")
    pages = sorted((REPO / "data" / "sample" / "prose" / "coreutils-man").glob("*.txt"))[:15]
    (folder / "data" / "manpages.jsonl").write_text(
        "".join(json.dumps({"id": page.stem, "text": page.read_text()}) + "\n" for page in pages))
    (folder / CONFIG).write_text(  # one domain of its own: every setting naming a domain says it
        "work_dir: work\n"
        "collect:\n"
        "  sources:\n"
        "    - {name: manpages, path: data/manpages.jsonl, format: jsonl, domain: manuals, licence: GPL-3.0-or-later}\n"
        "clean:\n"
        f"  url_blocklist: {WRONG_BLOCKLIST}\n"
        "  language_domains: [manuals]\n"
        "  quality_domains: [manuals]\n"
        "  quality_model_domains: [manuals]\n"
        "  pii_domains: [manuals]\n"
        "  c4: {domains: [manuals]}\n"
        "  fineweb: {domains: [manuals]}\n"
        "  code: {domains: []}\n"
        "sweep:\n"
        "  mixtures: {uniform: {manuals: 1}}\n"
        "anneal:\n"
        "  mixture: {manuals: 1}\n")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("project")
    operated = Project(root)
    write_project(operated.folder)
    up = operated.kiln("up", "--work-dir", "ops", "--prefect-port", str(free_port()),
                       "--mlflow-port", str(free_port()))
    assert "source " in up.stdout
    try:
        operated.source(operated.folder / "ops" / "servers" / "env")
        assert operated.env["PREFECT_HOME"] == str(operated.folder / "ops" / "prefect")  # not ~/.prefect
        deployed = operated.kiln("deploy").stdout
        assert len(deployed.splitlines()) <= 6 and "prefect worker start" not in deployed and "kiln worker" in deployed
        assert f"flows run in {operated.folder}" in deployed
        operated.start_worker()
        yield operated
    finally:
        if operated.worker is not None and operated.worker.poll() is None:
            os.killpg(operated.worker.pid, signal.SIGTERM)
            operated.worker.wait(timeout=30)
        # from another folder, without --work-dir: the last `kiln up` is found
        down = operated.kiln("down", cwd=operated.elsewhere).stdout
        assert f"the last `kiln up`, for {operated.folder / 'ops'}" in down and "stopped: prefect, mlflow" in down


def test_a_project_run_fails_on_its_config_is_retried_after_the_fix_loses_its_worker_and_is_retried_again(project):
    """One flow run, three attempts: clean fails on the config (a wrong blocklist path); the file is fixed
    and the run retried as the UI's Retry does; its worker is killed mid-clean, and the run retried again.
    The flow run is marked Crashed through the API, as the unresponsive-run automation does after three
    missed heartbeats (tests/flows/test_operate.py waits for the automation itself)."""
    flow_run_id = project.api.run_deployment("kiln-pipeline/pipeline", {"config_path": CONFIG, "until": "clean"})
    assert project.api.wait(flow_run_id, FINAL)["state_type"] == "FAILED"
    work = project.folder / "work"
    assert (work / "store" / "collect").is_dir() and not (REPO / "work").exists()  # the project's work dir
    status = project.kiln("status", CONFIG).stdout
    assert f"failed (fix the config, then rerun): ConfigError: clean.url_blocklist: {WRONG_BLOCKLIST}" in status
    # the failed run's persisted exception: in the run's work dir, not in the worker's PREFECT_HOME
    assert [p.name for p in (work / "prefect" / "storage").iterdir()]
    assert not (project.folder / "ops" / "prefect" / "storage").exists()

    config = project.folder / CONFIG
    config.write_text(config.read_text().replace(WRONG_BLOCKLIST, BLOCKLIST))  # the fix, in the file
    failed_attempt = set((work / "store").glob("clean/.*.partial"))
    project.api.retry_like_the_ui(flow_run_id)
    deadline = time.monotonic() + 300
    while not set((work / "store").glob("clean/.*.partial")) - failed_attempt:
        assert time.monotonic() < deadline, "the retry never got into clean"
        assert project.api.call("GET", f"/flow_runs/{flow_run_id}")["state_type"] not in FINAL
        time.sleep(0.2)
    project.kill_worker()
    project.start_worker()  # which marks what the dead one left running in MLflow
    deadline = time.monotonic() + 120
    while any(r.info.status == "RUNNING" for r in project.runs(flow_run_id)):
        assert time.monotonic() < deadline, "the dead worker's MLflow runs are still RUNNING"
        time.sleep(1)
    runs = {r.info.run_name: r for r in project.runs(flow_run_id)}
    assert runs["clean (attempt 2)"].info.status == "FAILED"
    assert runs["clean (attempt 2)"].data.tags["kiln.status"] == "crashed"
    assert "died without ending it" in runs["clean (attempt 2)"].data.tags["kiln.error"]

    project.api.call("POST", f"/flow_runs/{flow_run_id}/set_state", {"state": {
        "type": "CRASHED", "name": "Crashed", "message": "no heartbeat: the worker or its machine died"}, "force": True})
    project.api.retry_like_the_ui(flow_run_id)
    run = project.api.wait(flow_run_id, FINAL)
    assert (run["state_type"], run["run_count"]) == ("COMPLETED", 3)
    tasks = project.task_runs(flow_run_id)
    assert [(stage, state) for stage, state, _ in tasks] == [
        ("collect", "Completed"), ("clean", "Failed"), ("collect", "Cached"), ("clean", "Crashed"),
        ("collect", "Cached"), ("clean", "Completed")]
    assert "attempt 2 of flow run" in tasks[3][2] and "its process died" in tasks[3][2]

    runs = {r.info.run_name: r for r in project.runs(flow_run_id)}
    [parent] = [r for r in runs.values() if r.data.tags["kiln.stage"] == "pipeline"]
    fixed_hash = parent.data.tags["kiln.config_hash"]
    assert parent.info.run_name == f"pipeline/kiln/{fixed_hash}" and parent.info.status == "FINISHED"
    assert parent.data.tags["kiln.attempt"] == "3" and "kiln.error" not in parent.data.tags
    resolved = json.loads(Path(project.mlflow.download_artifacts(
        parent.info.run_id, "resolved_config.json", str(project.root / "resolved"))).read_text())
    assert resolved["clean"]["url_blocklist"] == BLOCKLIST and resolved["work_dir"] == "work"
    children = sorted((name, r.data.tags["kiln.attempt"], r.data.tags["kiln.status"], r.info.status)
                      for name, r in runs.items() if r is not parent)
    assert children == [("clean", "1", "failed", "FAILED"), ("clean (attempt 2)", "2", "crashed", "FAILED"),
                        ("clean (attempt 3)", "3", "ran", "FINISHED"), ("collect", "1", "ran", "FINISHED"),
                        ("collect (attempt 2)", "2", "cached", "FINISHED"),
                        ("collect (attempt 3)", "3", "cached", "FINISHED")]
    assert "complete" in project.kiln("status", CONFIG).stdout.splitlines()[2]  # clean's row
