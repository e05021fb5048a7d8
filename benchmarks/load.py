"""What the servers' database holds under load and faults: the embedded SQLite against PostgreSQL.

For each backend, in one run and against real servers as an operator starts them (`kiln up
[--database postgres]`, `kiln deploy`, two `kiln worker`s):
- `--runs` (8) concurrent pipeline deployment runs of configs/tiny.yaml up to `--until` (collect),
  each in its own work dir, picked up by the two workers;
- once two runs are Running, `--records` (200) short records written concurrently by one flow in
  another process (8 threads): per record a Prefect task run that starts an MLflow run through Kiln's tracker, logs
  its params and metrics, ends it and publishes a Prefect table artifact;
- during that load the Prefect server is SIGKILLed and restarted (`kiln up` restarts what died) once an
  eighth of the records are written, then the database once a quarter are (early, so that the
  pipeline runs are still going): PostgreSQL itself, or, on SQLite, the MLflow server that owns its
  file. The table says how far the load was at each kill.
At the end, after the next run's replay of anything Kiln kept in a spool: flow runs completed,
failed and crashed; MLflow runs expected and present with their metrics; Prefect task runs and
artifacts of the records; store keys committed; `database is locked` lines in every log; p50/p95 of
Kiln's API calls (the tracker's and Prefect's, timed where Kiln makes them). One table per backend.

Records lost = MLflow runs (records and pipeline stages of completed flow runs) missing or without
their metrics, plus records whose Prefect artifact is missing: what Kiln writes. The records' Prefect
task runs are Prefect's own (its server records them from the clients' events, and drops an event it
failed to write five times): counted and shown, not in that sum. Last line:
`RESULT load_records_lost_postgres <n>` (goal 0, with no failed flow run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KILN = [sys.executable, "-m", "kiln.flows.cli"]
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
EXPERIMENT = "kiln"


class Api:
    """Prefect's REST API, each call timed (the benchmark's own calls, reported apart from Kiln's)."""

    def __init__(self, url: str):
        self.url, self.timings = url, []

    def call(self, method: str, path: str, body: dict | None = None, attempts: int = 60):
        request = urllib.request.Request(self.url + path, method=method, headers={"Content-Type": "application/json"},
                                         data=None if body is None else json.dumps(body).encode())
        for attempt in range(attempts):  # the server may be down: it is killed on purpose
            started = time.perf_counter()
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    self.timings.append(time.perf_counter() - started)
                    return json.loads(response.read() or "null")
            except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
                if isinstance(error, urllib.error.HTTPError) and error.code < 500 or attempt == attempts - 1:
                    raise
                time.sleep(2)

    def flow_runs(self, ids: list[str]) -> list[dict]:
        return self.call("POST", "/flow_runs/filter", {"flow_runs": {"id": {"any_": ids}}})


def percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
    return f"{statistics.median(ordered) * 1000:.0f} / {p95 * 1000:.0f} ms"


def server_pid(ops: Path, name: str) -> int:
    return next(s["pid"] for s in json.loads((ops / "servers" / "servers.json").read_text()) if s["name"] == name)


def written(root: Path) -> int:
    progress = root / "records.progress"
    return len(progress.read_text().splitlines()) if progress.is_file() else 0


def fault_when(root: Path, records: subprocess.Popen, at: int, api: Api, run_ids: list[str]) -> str:
    """Wait until `at` records are written (or the records' process ended); how far the load is."""
    while written(root) < at and records.poll() is None:
        time.sleep(0.5)
    states = [r["state_type"] for r in api.flow_runs(run_ids)]
    return (f"{written(root)} records written, flow runs {states.count('RUNNING')} running, "
            f"{sum(s in FINAL for s in states)} final")


def kill_and_restart(ops: Path, name: str, env: dict) -> float:
    """SIGKILL a server's process group, then `kiln up`, which starts what died as it was; returns the
    seconds from the kill to `kiln up` returning with every server healthy."""
    os.killpg(server_pid(ops, name), signal.SIGKILL)
    killed = time.perf_counter()
    subprocess.run([*KILN, "up", "--work-dir", str(ops)], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL,
                   timeout=600)
    return time.perf_counter() - killed


def write_records(count: int, store: Path, out: Path, tag: str) -> None:
    """The records' process: one flow, `count` task runs on 8 threads, each a tracked MLflow run and a
    Prefect artifact; the seconds of each call Kiln makes are written to `out`."""
    from prefect import flow, task
    from prefect.artifacts import create_table_artifact
    from prefect.task_runners import ThreadPoolTaskRunner

    from kiln.tasks.tracking import MlflowTracker
    from kiln.tasks.tracking_spool import spool_dir

    tracker = MlflowTracker(os.environ["MLFLOW_TRACKING_URI"], EXPERIMENT, spool=spool_dir(store))
    timings: dict[str, list[float]] = {}
    lock = threading.Lock()
    progress = out.with_suffix(".progress")  # one line per record written: when the faults come

    def timed(kind: str, call):
        started = time.perf_counter()
        result = call()
        with lock:
            timings.setdefault(kind, []).append(time.perf_counter() - started)
        return result

    @task(task_run_name="record-{index}")
    def record(index: int) -> str:
        run_id = timed("mlflow start_run + params", lambda: tracker.start_run(
            f"record-{index}", tags={"kiln.load": tag, "kiln.record": index},
            params={"index": index, "kind": "short", "width": 8 * (1 + index % 4)}))
        timed("mlflow log_metrics", lambda: tracker.log_metrics(run_id, {"loss": 1.0 / (1 + index), "step_s": 0.01},
                                                                  step=index))
        timed("mlflow end_run", lambda: tracker.end_run(run_id))
        timed("prefect artifact", lambda: create_table_artifact([{"record": index, "run": run_id}],
                                                                key=f"load-record-{index}"))
        with lock, open(progress, "a") as written:
            written.write(f"{index}\n")
        return run_id

    @flow(name="kiln-load-records", task_runner=ThreadPoolTaskRunner(max_workers=8))
    def records() -> list[str]:
        futures = [record.submit(i) for i in range(count)]
        return [f.result() for f in futures]

    started = time.perf_counter()
    state = records(return_state=True)
    out.write_text(json.dumps({"timings": timings, "state": state.type.value, "wall_s": time.perf_counter() - started,
                               "message": str(state.message)[:500]}))


def run_backend(database: str, args: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"kiln-load-{database}-", dir=args.tmp))
    os.chmod(root, 0o711)  # as root, PostgreSQL runs as its own account and must reach servers/
    ops = root / "ops"
    from kiln.flows.environment import PROCESS_SETTINGS

    # every process here is a Kiln process, the records' included: Kiln's settings, as deploy gives them
    env = {**PROCESS_SETTINGS,
           **{k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "KILN_"))}}
    env.update(XDG_STATE_HOME=str(root / "state"), PYTHONPATH=str(REPO), PREFECT_WORKER_QUERY_SECONDS="2")
    report: dict = {"database": database, "root": str(root)}
    workers, records = [], None
    started = time.perf_counter()
    subprocess.run([*KILN, "up", "--work-dir", str(ops), "--database", database, "--prefect-port", str(free_port()),
                    "--mlflow-port", str(free_port())], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL,
                   timeout=600)
    report["kiln up s"] = time.perf_counter() - started
    try:
        for line in (ops / "servers" / "env").read_text().splitlines():
            name, value = line.removeprefix("export ").split("=", 1)
            env[name] = value
        api = Api(env["PREFECT_API_URL"])
        subprocess.run([*KILN, "deploy"], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, timeout=900)
        for n in range(args.workers):
            log = open(root / f"worker-{n}.log", "ab")
            workers.append(subprocess.Popen([*KILN, "worker"], cwd=REPO, env=env, start_new_session=True,
                                            stdout=log, stderr=subprocess.STDOUT))
        deployment = api.call("GET", "/deployments/name/kiln-pipeline/pipeline")
        load_started = time.perf_counter()
        run_ids = [api.call("POST", f"/deployments/{deployment['id']}/create_flow_run", {"parameters": {
            "config_path": "configs/tiny.yaml", "until": args.until, "overrides": [f"work_dir={root / 'runs' / str(i)}"]}}
        )["id"] for i in range(args.runs)]
        deadline = time.monotonic() + 600
        while sum(r["state_type"] == "RUNNING" for r in api.flow_runs(run_ids)) < min(2, args.runs):
            assert time.monotonic() < deadline, "no flow run started within 10 minutes"
            time.sleep(2)
        # the records, and the faults, once the runs are under way
        records = subprocess.Popen([sys.executable, __file__, "_records", str(args.records), str(root / "records"),
                                    str(root / "records.json"), database], cwd=REPO, env=env, start_new_session=True,
                                   stdout=open(root / "records.log", "ab"), stderr=subprocess.STDOUT)
        report["prefect server killed at"] = fault_when(root, records, args.records // 8, api, run_ids)
        report["prefect server down s"] = kill_and_restart(ops, "prefect", env)
        victim = "postgres" if database == "postgres" else "mlflow"
        report[f"{victim} killed at"] = fault_when(root, records, args.records // 4, api, run_ids)
        report[f"{victim} down s"] = kill_and_restart(ops, victim, env)

        deadline = time.monotonic() + args.timeout_s
        while True:
            runs = api.flow_runs(run_ids)
            if all(r["state_type"] in FINAL for r in runs) and records.poll() is not None:
                break
            if time.monotonic() > deadline:
                print(f"{database}: gave up waiting after {args.timeout_s:.0f}s", file=sys.stderr)
                break
            time.sleep(3)
        report["load wall s"] = time.perf_counter() - load_started
        report.update(count(database, root, api, run_ids, args))
    finally:
        if records is not None and records.poll() is None:
            os.killpg(records.pid, signal.SIGKILL)
        for worker in workers:
            os.killpg(worker.pid, signal.SIGTERM)
        for worker in workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
        subprocess.run([*KILN, "down", "--work-dir", str(ops)], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                       timeout=300)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return report


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def count(database: str, root: Path, api: Api, run_ids: list[str], args: argparse.Namespace) -> dict:
    """What made it, once the next run's tracker has replayed what Kiln kept in the spools."""
    from mlflow.tracking import MlflowClient

    from kiln.tasks.config import load_config
    from kiln.tasks.graph import stage_keys
    from kiln.tasks.store import Store
    from kiln.tasks.tracking import MlflowTracker
    from kiln.tasks.tracking_spool import spool_dir

    uri = os.environ["MLFLOW_TRACKING_URI"] = (root / "ops" / "servers" / "env").read_text().split(
        "MLFLOW_TRACKING_URI=")[1].split()[0]
    stores = [root / "records", *(root / "runs" / str(i) / "store" for i in range(args.runs))]
    kept = sum(len(list(spool_dir(s).glob("*.jsonl"))) for s in stores)
    replayed = [MlflowTracker(uri, EXPERIMENT, spool=spool_dir(s)).replay() for s in stores if spool_dir(s).exists()]
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(EXPERIMENT).experiment_id
    runs = client.search_runs([experiment], max_results=5000)

    states = [r["state_type"] for r in api.flow_runs(run_ids)]
    out = {f"flow runs {s.lower()}": states.count(s) for s in ("COMPLETED", "FAILED", "CRASHED")}
    out["flow runs other"] = len(states) - sum(states.count(s) for s in ("COMPLETED", "FAILED", "CRASHED"))
    out["flow run retries"] = sum(max(r["run_count"] - 1, 0) for r in api.flow_runs(run_ids))

    records = [r for r in runs if r.data.tags.get("kiln.record") is not None]
    with_metrics = {r.data.tags["kiln.record"] for r in records if {"loss", "step_s"} <= r.data.metrics.keys()}
    stages = ["collect", "clean", "dedup", "decontaminate", "tokenize"]
    stages = stages[:stages.index(args.until) + 1] if args.until in stages else [args.until]
    completed = [r["id"] for r in api.flow_runs(run_ids) if r["state_type"] == "COMPLETED"]
    stage_runs = [r for r in runs if r.data.tags.get("kiln.prefect_flow_run_id") in completed]
    expected_stages = {(f, s) for f in completed for s in stages}
    # a stage run that computed carries its cost metrics; a reuse (cached) has none to carry
    present_stages = {(r.data.tags["kiln.prefect_flow_run_id"], r.data.tags["kiln.stage"]) for r in stage_runs
                      if r.data.tags.get("kiln.status") == "cached"
                      or r.data.tags.get("kiln.status") == "ran" and "cost.wall_s" in r.data.metrics}
    parents = {r.data.tags["kiln.prefect_flow_run_id"] for r in stage_runs
               if r.data.tags.get("kiln.stage") == "pipeline" and "wall_s" in r.data.metrics}
    out["mlflow records expected / present with metrics"] = f"{args.records} / {len(with_metrics)}"
    out["mlflow stage runs expected / present with metrics"] = (f"{len(expected_stages) + len(completed)} / "
                                                                f"{len(expected_stages & present_stages) + len(parents)}")

    result = json.loads((root / "records.json").read_text()) if (root / "records.json").is_file() else {}
    out["records flow"] = f"{result.get('state', 'died')} in {result.get('wall_s', 0):.0f}s"
    record_flow = api.call("POST", "/flow_runs/filter", {"flows": {"name": {"any_": ["kiln-load-records"]}}})
    task_runs = settled_task_runs(api, [r["id"] for r in record_flow]) if record_flow else []
    artifacts = api.call("POST", "/artifacts/filter", {"artifacts": {"key": {"like_": "load-record-"}}, "limit": 200})
    artifacts += api.call("POST", "/artifacts/filter", {"artifacts": {"key": {"like_": "load-record-"}},
                                                         "offset": 200, "limit": 200})
    completed_tasks = sum(t["state_type"] == "COMPLETED" for t in task_runs)
    out["prefect record task runs completed (Prefect's own)"] = (f"{completed_tasks} / {args.records}, "
                                                                 f"{len(task_runs) - completed_tasks} in another state")
    out["prefect record artifacts"] = f"{len({a['key'] for a in artifacts})} / {args.records}"

    committed = 0
    for i in range(args.runs):
        cfg = load_config(str(REPO / "configs" / "tiny.yaml"), [f"work_dir={root / 'runs' / str(i)}"])
        keys, store = stage_keys(cfg), Store(cfg.store_root)
        committed += sum(store.is_complete(s, keys[s]) for s in stages)
    out["store keys committed"] = f"{committed} / {args.runs * len(stages)}"
    locked: dict[str, int] = {}
    spooled = caught_up = dropped = 0
    for log in [*root.glob("*.log"), *(root / "ops" / "servers").glob("*.log")]:
        text = log.read_text(errors="replace")
        if found := len(re.findall(r"database is locked", text)):
            locked[log.name] = found
        spooled += len(re.findall(r"could not take a write", text))
        caught_up += sum(int(n) for n in re.findall(r"wrote (\d+) records \(\d+ runs created\) that MLflow", text))
        # Prefect's server: its event persister's and its task-run recorder's writes it gave up on
        dropped += sum(int(n) for n in re.findall(r"Max flush retries \(\d+\) reached, dropping (\d+) events", text))
        dropped += len(re.findall(r"Dropping event \S+ after \d+ failed attempts", text))
    out["Kiln's spool: outages met, writes replayed by their run"] = f"{spooled}, {caught_up}"
    out["Kiln's spool: left at the end, replayed by the next run"] = (f"{kept} journals, "
                                                                       f"{sum(r.writes for r in replayed)} writes")
    out["events Prefect's server dropped"] = dropped
    out["'database is locked' lines, by log"] = ", ".join(f"{name} {n}" for name, n in locked.items()) or "0"

    timings = result.get("timings", {})
    for kind, values in sorted(timings.items()):
        out[f"p50 / p95 {kind}"] = percentiles(values)
    out["p50 / p95 all Kiln calls"] = percentiles([v for values in timings.values() for v in values])
    out["p50 / p95 Prefect API (benchmark's reads)"] = percentiles(api.timings)

    missing_records = args.records - len(with_metrics)
    missing_artifacts = args.records - len({a["key"] for a in artifacts})
    missing_stages = len(expected_stages - present_stages) + len(completed) - len(parents)
    out["records lost"] = missing_records + missing_artifacts + missing_stages
    return out


def settled_task_runs(api: Api, flow_run_ids: list[str], quiet_s: float = 20.0, limit_s: float = 300.0) -> list:
    """The records' task runs once Prefect has recorded what it will: its server writes task runs from the
    clients' events, in the background and behind after an outage; wait until their states stop changing."""
    deadline, seen, since = time.monotonic() + limit_s, None, time.monotonic()
    while True:
        task_runs = [t for offset in (0, 200) for t in api.call("POST", "/task_runs/filter", {
            "flow_runs": {"id": {"any_": flow_run_ids}}, "offset": offset, "limit": 200})]
        now = sorted((t["id"], t["state_type"]) for t in task_runs)
        if now != seen:
            seen, since = now, time.monotonic()
        if time.monotonic() - since > quiet_s or time.monotonic() > deadline:
            return task_runs
        time.sleep(5)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_records":
        count_, store, out, tag = sys.argv[2:6]
        write_records(int(count_), Path(store), Path(out), tag)
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Expected duration: minutes per backend (its servers start, the deployments register, the runs "
               "and records go through two kills), at most --timeout-s per backend for the runs and records.")
    parser.add_argument("--backends", default="sqlite,postgres",
                        help="the servers' databases to load, comma-separated: sqlite, postgres (default: both)")
    parser.add_argument("--runs", type=int, default=8,
                        help="concurrent pipeline deployment runs of configs/tiny.yaml (default: 8)")
    parser.add_argument("--workers", type=int, default=2, help="`kiln worker`s that run them (default: 2)")
    parser.add_argument("--records", type=int, default=200,
                        help="tracked records written at once during the runs (default: 200)")
    parser.add_argument("--until", default="collect", help="the last stage of each pipeline run (default: collect)")
    parser.add_argument("--timeout-s", type=float, default=1800.0,
                        help="how long to wait for the runs and records of one backend (default: 1800)")
    parser.add_argument("--tmp", default=None, help="where the work dirs go (default: the system's temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep each backend's folder (logs, stores)")
    args = parser.parse_args()

    reports = []
    for database in args.backends.split(","):
        print(f"--- {database}: load average {os.getloadavg()[0]:.1f} at start", flush=True)
        report = run_backend(database, args)
        reports.append(report)
        width = max(len(k) for k in report)
        for key, value in report.items():
            shown = f"{value:.1f}" if isinstance(value, float) else value
            print(f"{key:<{width}}  {shown}", flush=True)
    lost = {r["database"]: r.get("records lost", "n/a") for r in reports}
    failed = {r["database"]: r.get("flow runs failed", 0) + r.get("flow runs crashed", 0) for r in reports}
    tasks = {r["database"]: r.get("prefect record task runs completed (Prefect's own)", "n/a") for r in reports}
    print(f"records lost: {lost}; failed or crashed flow runs: {failed}; the records' task runs in Prefect: {tasks}; "
          f"load average {os.getloadavg()[0]:.1f} at end")
    if "postgres" in lost:
        print(f"RESULT load_records_lost_postgres {lost['postgres']}")


if __name__ == "__main__":
    main()
