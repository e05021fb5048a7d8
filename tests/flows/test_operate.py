"""Kiln operated as its users do: `kiln up`, `kiln deploy --alert-webhook`, `kiln worker`, deployment
runs, the Prefect UI's Retry (its exact API call, then its button in headless Chromium), the MLflow UI,
concurrent runs on one store, alerts, continuous eval on a short schedule while training writes
checkpoints, and a worker killed mid-stage.

All scenarios share one module fixture (servers, deployments, worker, webhook receiver), so the
fixed start-up is paid once; every process is stopped at the end. The killed-worker drill starts
with the fixture: the server's wait for three missed heartbeats then overlaps the other scenarios.
Screenshots, the timings and the alerts as the webhook got them land in build/test-artifacts/operate/.
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
import urllib.error
import urllib.request
from collections import Counter
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from kiln.flows.cli import main
from kiln.flows.servers import servers_dir
from kiln.tasks.scaling.plots import LAW_PLOT
from tests.processes import kill_tree

# `kiln up` starts Prefect and MLflow servers; the first test also pays for the module's servers, deployments
# and crash drill (~95 s measured with it on 2 busy cores)
pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "build" / "test-artifacts" / "operate"
CHROMIUM = "/usr/bin/chromium"  # Debian's package (infra/system-packages.sh); Playwright's download cannot work here
HEARTBEAT_S = 30  # Prefect's minimum: the unresponsive-run detector then waits 90 s
UPSTREAM = ("collect", "clean", "dedup")
RETRIED = ("decontaminate", "tokenize")
FINAL = {"FAILED", "CRASHED", "COMPLETED", "CANCELLED"}
SMALL_SWEEP = ["sweep.run.steps=4", "sweep.run.eval_batches=1", "sweep.isoflop=[{flops: 2.0e8, widths: [4]}]"]  # the browser run goes on to fit


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
        for attempt in range(10):
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return json.loads(response.read() or "null")
            except urllib.error.HTTPError as error:
                # SQLite busy under load answers 503, which Prefect's own client (and the UI) retry
                if error.code not in (429, 502, 503) or attempt == 9:
                    raise
                time.sleep(1 + attempt)

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
            final = all(r["state_type"] in FINAL for r in runs)
            if final or time.monotonic() > deadline:
                return [(r["name"].rsplit("-", 1)[0], r["state_name"])
                        for r in sorted(runs, key=lambda r: r["expected_start_time"])]
            time.sleep(0.5)

    def events(self, name: str, resource_id: str) -> list[dict]:
        return self.call("POST", "/events/filter", {"filter": {"event": {"name": [name]},
                                                               "resource": {"id": [resource_id]}}})["events"]


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

    def wait_for(self, *texts: str, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for body in self.received:
                if all(text in body.get("text", "") for text in texts):
                    return body["text"]
            time.sleep(0.5)
        raise AssertionError(f"no alert mentioning {texts} within {timeout_s}s; received {self.received}")


class Operated:
    """One working Kiln installation: servers, deployments with alerts, a worker, a webhook."""

    def __init__(self, root: Path):
        self.root = root
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
        for line in (servers_dir(root / "servers-home") / "env").read_text().splitlines():
            name, value = line.removeprefix("export ").split("=", 1)
            self.env[name] = value
        # where Kiln deploys and where its workers run: the same heartbeat (see flows/alerts.py)
        self.env.update(PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_FLOWS_HEARTBEAT_FREQUENCY=str(HEARTBEAT_S))
        self.api = PrefectApi(self.env["PREFECT_API_URL"])
        self.ui = self.env["PREFECT_API_URL"].removesuffix("/api")
        self.mlflow = self.env["MLFLOW_TRACKING_URI"]
        self.webhook = WebhookReceiver()
        self.worker: subprocess.Popen | None = None
        self.crashed_run = ""  # the crash drill's flow run
        self.timings: dict[str, float] = {}

    def kiln(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kiln.flows.cli", *args], env=self.env, cwd=REPO,
                              capture_output=True, text=True, timeout=timeout_s)

    def start_worker(self) -> None:
        log = open(self.root / "worker.log", "a")
        self.worker = subprocess.Popen([sys.executable, "-m", "kiln.flows.cli", "worker"], env=self.env, cwd=REPO,
                                       start_new_session=True, stdout=log, stderr=subprocess.STDOUT)

    def kill_worker(self) -> None:
        """SIGKILL the worker and every process under it (the flow runs it started), as when its machine dies."""
        kill_tree(self.worker.pid)
        self.worker.wait(timeout=30)

    def stop_worker(self) -> None:
        """SIGTERM, as an operator stops it; what has not stopped after 30 s is killed."""
        os.killpg(self.worker.pid, signal.SIGTERM)
        try:
            self.worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill_worker()

    def parameters(self, work: str, eval_file: Path | None = None, until: str = "tokenize",
                   extra: tuple[str, ...] = ()) -> dict:
        overrides = [f"work_dir={self.root / work}", *extra]
        if eval_file is not None:
            overrides.append(f"evaluate.eval_files=[{eval_file}]")
        return {"config_path": "configs/tiny.yaml", "until": until, "overrides": overrides}


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    root = tmp_path_factory.mktemp("operate")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    servers = root / "servers-home"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)
        patch.setenv("XDG_STATE_HOME", str(root / "state"))  # where `kiln up` records its work dirs
        started = time.perf_counter()
        assert main(["up", f"work_dir={servers}", "--prefect-port", str(free_port()),
                     "--mlflow-port", str(free_port())]) == 0
        operated = Operated(root)
        operated.timings["kiln_up_s"] = time.perf_counter() - started
        try:
            started = time.perf_counter()
            deployed = operated.kiln("deploy", "--alert-webhook", f"http://127.0.0.1:{operated.webhook.server_port}/hook")
            operated.timings["kiln_deploy_s"] = time.perf_counter() - started
            assert deployed.returncode == 0, deployed.stderr[-3000:]
            assert "continuous eval has no schedule" in deployed.stdout
            assert "kiln-stage-failed" in deployed.stdout and "kiln-crash-unresponsive-runs" in deployed.stdout
            operated.start_worker()
            operated.crashed_run = start_crash_drill(operated)
            yield operated
        finally:
            try:
                if operated.worker is not None and operated.worker.poll() is None:
                    operated.stop_worker()
                operated.webhook.shutdown()
                (ARTIFACTS / "timings.json").write_text(json.dumps(operated.timings, indent=2))
                (ARTIFACTS / "alerts.json").write_text(json.dumps(operated.webhook.received, indent=2))  # as posted
            finally:
                assert main(["down", f"work_dir={servers}"]) == 0


def start_crash_drill(ops: Operated) -> str:
    """A pipeline deployment run whose worker (and with it the run's process) is killed mid-stage,
    after the run's first heartbeat; a fresh worker takes over for the other scenarios."""
    flow_run_id = ops.api.run_deployment("kiln-pipeline/pipeline", ops.parameters("crash", until="dedup"))
    deadline = time.monotonic() + 300
    store = ops.root / "crash" / "store"
    while not (ops.api.events("prefect.flow-run.heartbeat", f"prefect.flow-run.{flow_run_id}")
               and list(store.glob("*/.*.partial"))):
        assert time.monotonic() < deadline, "the crash drill's run never got into a stage"
        assert ops.api.call("GET", f"/flow_runs/{flow_run_id}")["state_type"] not in FINAL
        time.sleep(0.5)
    ops.kill_worker()
    assert ops.api.call("GET", f"/flow_runs/{flow_run_id}")["state_type"] == "RUNNING"  # nobody left to say otherwise
    ops.timings["crash_drill_killed_at"] = time.time()
    ops.start_worker()
    return flow_run_id


def test_ui_retry_of_a_deployment_run_reuses_what_succeeded(ops, in_repo, tmp_path):
    eval_file = tmp_path / "eval.jsonl"  # missing at first: decontaminate, the 4th stage, fails
    parameters = ops.parameters("work", eval_file)
    started = time.perf_counter()
    flow_run_id = ops.api.run_deployment("kiln-pipeline/pipeline", parameters)
    assert ops.api.wait(flow_run_id, FINAL)["state_type"] == "FAILED"
    ops.timings["deployment_run_to_failure_s"] = time.perf_counter() - started
    store = ops.root / "work" / "store"
    before = {stage: digests(store / stage) for stage in UPSTREAM}
    # the automation posted the runner's event, as a sentence: stage, config, error, the run's page
    alert = ops.webhook.wait_for("Kiln: a stage failed", "Stage decontaminate (key ")
    assert f"of configs/tiny.yaml with work_dir={ops.root / 'work'} evaluate.eval_files=[{eval_file}] failed: " \
           f"InputError: eval file {eval_file}" in alert and "does not exist" in alert
    assert alert.endswith(f"Flow run: {ops.ui}/v2/runs/flow-run/{flow_run_id}")

    eval_file.write_text((REPO / "data" / "evals" / "heldout.jsonl").read_text())  # the fix
    started = time.perf_counter()
    ops.api.retry_like_the_ui(flow_run_id)
    run = ops.api.wait(flow_run_id, FINAL)
    ops.timings["api_retry_to_completed_s"] = time.perf_counter() - started
    assert (run["state_type"], run["run_count"]) == ("COMPLETED", 2)
    states = ops.api.task_states(flow_run_id)
    second_attempt = dict(states[len(UPSTREAM) + 1:])
    assert states[:len(UPSTREAM) + 1] == [*((s, "Completed") for s in UPSTREAM), ("decontaminate", "Failed")]
    assert second_attempt == {**{s: "Cached" for s in UPSTREAM}, **{s: "Completed" for s in RETRIED}}
    assert {stage: digests(store / stage) for stage in UPSTREAM} == before  # nothing recomputed

    client = MlflowClient(ops.mlflow)
    experiment = client.get_experiment_by_name("kiln").experiment_id
    parents = client.search_runs([experiment], filter_string="tags.`kiln.stage` = 'pipeline' and "
                                 f"tags.`kiln.prefect_flow_run_id` = '{flow_run_id}'")
    assert len(parents) == 1  # both attempts under one pipeline run
    children = client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
    assert sorted((c.data.tags["kiln.stage"], c.data.tags["kiln.status"]) for c in children) == sorted(
        [(s, "ran") for s in UPSTREAM] + [(s, "cached") for s in UPSTREAM]
        + [("decontaminate", "failed"), ("decontaminate", "ran"), ("tokenize", "ran")])

    # One stage again from its own deployment, with the same parameters: reused, shown as Cached.
    stage_run = ops.api.run_deployment("kiln-tokenize/tokenize", {k: parameters[k] for k in ("config_path", "overrides")})
    assert ops.api.wait(stage_run, FINAL)["state_type"] == "COMPLETED"
    assert ops.api.task_states(stage_run) == [("tokenize", "Cached")]


def test_retry_button_in_the_prefect_ui_then_the_run_in_the_mlflow_ui(ops, in_repo, tmp_path):
    """Through headless Chromium: find the failed run in the Prefect UI, click Retry, see it Completed
    with the upstream stages Cached; then find its pipeline run, stage children and the fit's plot
    in the MLflow UI."""
    from playwright.sync_api import sync_playwright

    eval_file = tmp_path / "eval.jsonl"  # missing at first; then a part of the held-out set (its own key)
    flow_run_id = ops.api.run_deployment("kiln-pipeline/pipeline",
                                         ops.parameters("work", eval_file, until="fit", extra=tuple(SMALL_SWEEP)))
    failed = ops.api.wait(flow_run_id, FINAL)
    assert failed["state_type"] == "FAILED"
    eval_file.write_text("".join((REPO / "data" / "evals" / "heldout.jsonl").read_text().splitlines(True)[:40]))

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.route(lambda url: not url.startswith("http://127.0.0.1"), lambda route: route.abort())  # offline
            page.set_default_timeout(60_000)
            page.goto(ops.ui)
            page.get_by_role("link", name="Runs", exact=True).first.click()
            page.get_by_role("link", name=failed["name"], exact=True).click()
            page.wait_for_url(f"**/runs/flow-run/{flow_run_id}**")
            page.get_by_role("tab", name="Job Variables").wait_for()  # the run's own page has rendered
            page.get_by_text("Failed", exact=True).first.wait_for()
            page.get_by_role("tab", name="Task Runs").click()
            page.get_by_text("decontaminate-", exact=False).first.wait_for()  # the stage that failed
            page.screenshot(path=ARTIFACTS / "prefect-failed-run.png")
            page.get_by_role("button", name="Open menu").click()
            page.get_by_role("menuitem", name="Retry").click()
            with page.expect_response(lambda r: r.url.endswith(f"/flow_runs/{flow_run_id}/set_state")) as response:
                page.get_by_role("alertdialog").get_by_role("button", name="Retry", exact=True).click()
            started = time.perf_counter()
            assert response.value.ok and response.value.json()["state"]["name"] == "AwaitingRetry"
            run_page = page.url
            page.close()  # the run page redraws its graph while it waits: leave the CPU to the run

            run = ops.api.wait(flow_run_id, FINAL)
            ops.timings["ui_retry_to_completed_s"] = time.perf_counter() - started
            assert (run["state_type"], run["run_count"]) == ("COMPLETED", 2)
            second_attempt = dict(ops.api.task_states(flow_run_id)[len(UPSTREAM) + 1:])
            assert second_attempt == {**{s: "Cached" for s in UPSTREAM},
                                      **{s: "Completed" for s in (*RETRIED, "sweep", "fit")}}

            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.route(lambda url: not url.startswith("http://127.0.0.1"), lambda route: route.abort())
            page.set_default_timeout(60_000)
            page.goto(run_page)
            page.get_by_text("Completed", exact=True).first.wait_for()
            page.get_by_role("tab", name="Task Runs").click()
            page.get_by_text("Cached", exact=True).first.wait_for()
            page.screenshot(path=ARTIFACTS / "prefect-retried-run.png")

            client = MlflowClient(ops.mlflow)
            experiment = client.get_experiment_by_name("kiln").experiment_id
            parent = client.search_runs([experiment], filter_string=f"tags.`kiln.prefect_flow_run_id` = '{flow_run_id}'"
                                        " and tags.`kiln.stage` = 'pipeline'")[0].info.run_name
            page.goto(f"{ops.mlflow}/#/experiments/{experiment}/runs")
            row = page.get_by_role("row").filter(has_text=parent)
            row.locator('[col-id="attributes.`Run Name`"]').get_by_role("button").click()  # expand: its stages
            # each attempt's stage runs: the first's by stage name, the Retry's as "<stage> (attempt 2)"
            retried = (f"{stage} (attempt 2)" for stage in (*UPSTREAM, *RETRIED, "sweep", "fit"))
            for stage in (*UPSTREAM, "decontaminate", *retried):
                page.get_by_role("link", name=stage, exact=True).first.wait_for()
            page.screenshot(path=ARTIFACTS / "mlflow-pipeline-run.png")
            page.get_by_role("link", name="fit (attempt 2)", exact=True).click()
            page.get_by_role("tab", name="Artifacts").click()
            page.get_by_text(LAW_PLOT, exact=True).click()  # the fit stage's loss-law plot
            # the preview is an <img> of the fetched bytes (a blob: URL): a loaded image as wide as a plot
            page.wait_for_function("() => [...document.images].some(i => i.complete && i.naturalWidth >= 400)")
            page.screenshot(path=ARTIFACTS / "mlflow-fit-plot.png")
        finally:
            browser.close()


def test_concurrent_deployment_runs_share_one_store_safely(ops, in_repo):
    """Three pipeline deployment runs at once on a fresh store through the worker: two of one config,
    one whose tokenizer differs. Every key is computed once; the configs' outputs stay apart."""
    from kiln.tasks.config import load_config
    from kiln.tasks.graph import stage_keys
    from kiln.tasks.store import Store

    same = ops.parameters("shared")
    other = ops.parameters("shared", extra=("tokenize.vocab_size=384",))
    run_ids = [ops.api.run_deployment("kiln-pipeline/pipeline", p) for p in (same, same, other)]
    runs = [ops.api.wait(run_id, FINAL) for run_id in run_ids]
    assert [r["state_type"] for r in runs] == ["COMPLETED"] * 3
    starts, ends = [r["start_time"] for r in runs], [r["end_time"] for r in runs]
    assert max(starts) < min(ends), "the three runs did not overlap"

    stages = (*UPSTREAM, *RETRIED)
    keys = [stage_keys(load_config("configs/tiny.yaml", p["overrides"])) for p in (same, other)]
    assert [k for k in stages if keys[0][k] != keys[1][k]] == ["tokenize"]
    store = Store(ops.root / "shared" / "store")
    for config_keys in keys:
        assert all(store.problems(s, config_keys[s], checksums=True) == [] for s in stages)
    assert not store.partial_folders()
    vocab = [store.manifest("tokenize", k["tokenize"])["identity"]["tokenize"]["vocab_size"] for k in keys]
    assert vocab == [512, 384]

    client = MlflowClient(ops.mlflow)
    experiment = client.get_experiment_by_name("kiln").experiment_id
    parents = [client.search_runs([experiment], filter_string=f"tags.`kiln.prefect_flow_run_id` = '{run_id}'"
                                  " and tags.`kiln.stage` = 'pipeline'")[0].info.run_id for run_id in run_ids]
    children = [c for p in parents
                for c in client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{p}'")]
    computed = Counter((c.data.tags["kiln.stage"], c.data.tags["kiln.key"]) for c in children
                       if c.data.tags["kiln.status"] == "ran")
    assert computed == Counter({(s, k[s]): 1 for k in keys for s in stages})  # each key once, whoever ran it
    assert len(children) == 3 * len(stages)


def test_an_event_without_its_sentence_still_reaches_the_webhook(ops):
    """An event emitted by hand (or by an older Kiln), with no `text`: the alert shows it raw."""
    emit = ("from prefect.events import emit_event\n"
            "emit_event(event='kiln.train.rollback', resource={'prefect.resource.id': 'kiln.train.abc123'},\n"
            "           payload={'step': '17', 'loss': '9.1', 'action': 'rollback'})\n")
    subprocess.run([sys.executable, "-c", emit], env=ops.env, check=True, timeout=120)
    assert "kiln.train.rollback on kiln.train.abc123: {'step': '17'" in ops.webhook.wait_for("Kiln: training rolled back")


SCHEDULE = """
import sys
from kiln.flows.deploy import continuous_eval_parameters, schedule_continuous_eval
config, every, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
print(schedule_continuous_eval(config, *continuous_eval_parameters(config, overrides, every)))
"""


def wait_until(ready, what: str, timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    while not (found := ready()):
        assert time.monotonic() < deadline, f"{what} within {timeout_s}s"
        time.sleep(1)
    return found


def test_continuous_eval_on_a_5s_schedule_scores_a_training_run_as_it_writes_checkpoints_then_pauses(ops, in_repo,
                                                                                                      tmp_path):
    """The schedule `kiln deploy --continuous-eval CONFIG --every 5s` makes (set as it sets it, without
    redeploying), run by the worker, while a real training run in this process writes checkpoints: each
    is scored once; a real regression (training goes on, at a high learning rate, on other text) reaches
    the webhook once, as a sentence with the run's page; once train and anneal are complete and scored,
    the schedule pauses itself and the runs Prefect had scheduled ahead are gone."""
    from kiln.tasks.config import load_config
    from kiln.tasks.constants import TOKENIZER_FILE
    from kiln.tasks.continuous_state import eval_targets
    from kiln.tasks.evals.continuous import read_recorded
    from kiln.tasks.graph import stage_keys
    from kiln.tasks.store import Store
    from kiln.tasks.train.loop import train_model
    from tests.fixtures.continuous_eval import (
        MODEL,
        RISING_OPTIM,
        RUN,
        other_mixture,
        write_eval_file,
        write_mixture,
        write_tokenizer,
    )

    started = time.perf_counter()
    eval_file = write_eval_file(tmp_path / "heldout.jsonl")
    overrides = [f"work_dir={ops.root / 'watched'}", f"evaluate.eval_files=[{eval_file}]",
                 "train.run.checkpoint_every=5", "train.run.keep_every=5",
                 "evaluate.suite.categories=[]"]  # the held-out task alone: one row a step, one regression
    cfg = load_config("configs/tiny.yaml", overrides)
    keys, store = stage_keys(cfg), Store(cfg.store_root)
    tokenizer = write_tokenizer(store.begin("tokenize", keys["tokenize"]) / TOKENIZER_FILE)
    store.commit("tokenize", keys["tokenize"], {"stats": {}, "wall_s": 0.0, "cost": {}})
    scheduled = subprocess.run([sys.executable, "-c", SCHEDULE, "configs/tiny.yaml", "5s", *overrides], env=ops.env,
                               cwd=REPO, capture_output=True, text=True, timeout=300)
    assert scheduled.returncode == 0, scheduled.stderr[-3000:]
    assert "continuous eval scores configs/tiny.yaml every 5 s" in scheduled.stdout
    deployment = ops.api.call("GET", "/deployments/name/kiln-continuous-eval/continuous-eval")
    assert [s["schedule"]["interval"] for s in deployment["schedules"]] == [5.0] and not deployment["paused"]
    train, anneal = eval_targets(cfg, keys)

    def scored(target):
        return sorted(step for step, _ in read_recorded(target.state_file))

    # training writes checkpoints 5 and 10 into its partial folder; the schedule scores them
    partial = store.begin("train", keys["train"], resumable=True)
    train_model(MODEL, RISING_OPTIM, RUN, write_mixture(tmp_path / "data", tokenizer), partial, stop_after=10)
    wait_until(lambda: scored(train) == [5, 10], "the schedule did not score steps 5 and 10")
    ops.timings["continuous_eval_first_scores_s"] = time.perf_counter() - started
    # it goes on, on other text (15 and 20 score far worse than 10), and commits; then a short anneal
    train_model(MODEL, RISING_OPTIM, RUN, other_mixture(tmp_path / "other", tokenizer), partial)
    store.commit("train", keys["train"], {"stats": {}, "wall_s": 0.0, "cost": {}})
    anneal_partial = store.begin("anneal", keys["anneal"], resumable=True)
    train_model(MODEL, RISING_OPTIM, RUN, write_mixture(tmp_path / "anneal", tokenizer), anneal_partial, stop_after=10)
    store.commit("anneal", keys["anneal"], {"stats": {}, "wall_s": 0.0, "cost": {}})
    wait_until(lambda: ops.api.call("GET", f"/deployments/{deployment['id']}")["paused"],
               "the schedule did not pause itself")
    ops.timings["continuous_eval_schedule_to_paused_s"] = time.perf_counter() - started

    assert (scored(train), scored(anneal)) == ([5, 10, 15, 20], [5, 10])
    assert len(train.state_file.read_text().splitlines()) == 4  # one row each: scored once
    runs = ops.api.call("POST", "/flow_runs/filter", {"deployments": {"id": {"any_": [deployment["id"]]}}})
    assert not [r for r in runs if r["state_type"] == "SCHEDULED"]  # Prefect deleted the runs scheduled ahead
    assert any(r["state_type"] == "COMPLETED" for r in runs)
    artifacts = ops.api.call("POST", "/artifacts/filter", {"artifacts": {"key": {"any_": ["kiln-continuous-eval-schedule"]}}})
    assert "this deployment's schedule is now paused" in artifacts[0]["data"]  # the run says so

    client = MlflowClient(ops.mlflow)
    experiment = client.get_experiment_by_name("kiln").experiment_id
    [train_run] = client.search_runs([experiment], filter_string=f"tags.`kiln.key` = '{keys['train']}' and "
                                                                 "tags.`kiln.stage` = 'continuous-eval'")
    assert train_run.info.run_name == f"continuous-eval/train/{keys['train']}"
    history = client.get_metric_history(train_run.info.run_id, "kiln_heldout.bits_per_byte")
    assert [m.step for m in history] == [5, 10, 15, 20]

    alert = ops.webhook.wait_for("Kiln: an eval score regressed", "kiln_heldout bits_per_byte regressed at train step 15")
    assert alert.startswith("Kiln: an eval score regressed\nContinuous eval of configs/tiny.yaml with work_dir=")
    assert f"Flow run: {ops.ui}/v2/runs/flow-run/" in alert
    assert sum("regressed at train step" in body.get("text", "") for body in ops.webhook.received) == 1  # once


def test_a_worker_killed_mid_stage_leaves_a_crashed_run_and_an_alert(ops):
    run = ops.api.wait(ops.crashed_run, FINAL, timeout_s=3 * HEARTBEAT_S + 120)
    crashed_at = datetime.fromisoformat(run["state"]["timestamp"]).timestamp()
    ops.timings["killed_worker_to_crashed_s"] = crashed_at - ops.timings.pop("crash_drill_killed_at")
    assert run["state_name"] == "Crashed" and "no heartbeat" in run["state"]["message"]
    alert = ops.webhook.wait_for("Kiln: a flow run crashed", f"{ops.ui}/v2/runs/flow-run/{ops.crashed_run}")
    assert f"Flow run {run['name']} (kiln-pipeline, config configs/tiny.yaml) crashed: no heartbeat for " in alert
