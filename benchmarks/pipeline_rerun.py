"""How much a cached rerun saves, and how soon a Prefect UI Retry gets back to work.

Part 1: the tiny pipeline cold, then again with every stage cached: `kiln run` in fresh processes
(so Prefect's start-up is paid every time, as a user pays it) in a temporary working directory, the
cached rerun `--cached-repeats` times after each of `--repeats` cold runs; medians, the ratio, and
the load average (on a shared machine the seconds move with it).

Part 2 (skip with `--no-retry`), against real servers as an operator runs them: `kiln up`, `kiln
deploy`, `kiln worker` (Prefect's default 10 s work-queue poll), a pipeline deployment run that
fails at its 4th stage, the fix, then the UI Retry button's API call. Reported: the seconds from
the Retry (its AwaitingRetry state) to the first re-executed stage starting, against the baseline
of a brand-new deployment run's creation to its first stage starting; and the operator's timings
(server start, deploy, deployment run, retry to Completed). Server timestamps throughout.

Last lines: `RESULT pipeline_cached_rerun_s <s>`, `RESULT pipeline_cached_rerun_speedup <cold / cached>`, then (part 2)
`RESULT ui_retry_first_stage_s <s>` and `RESULT ui_retry_vs_new_run_first_stage <retry / new run>`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KILN = [sys.executable, "-m", "kiln.flows.cli"]


def timed_run(config: str, work_dir: Path) -> float:
    started = time.perf_counter()
    subprocess.run([*KILN, "run", config, f"work_dir={work_dir}"], cwd=REPO,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stamp(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def stop(worker: subprocess.Popen) -> None:
    """SIGTERM the worker's process group; SIGKILL it if it has not stopped after 30 s."""
    os.killpg(worker.pid, signal.SIGTERM)
    try:
        worker.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)


class Api:
    """The Prefect REST calls the UI makes."""

    def __init__(self, url: str):
        self.url = url

    def call(self, method: str, path: str, body: dict | None = None):
        request = urllib.request.Request(self.url + path, method=method, headers={"Content-Type": "application/json"},
                                         data=None if body is None else json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read() or "null")

    def run_deployment(self, parameters: dict) -> dict:
        deployment = self.call("GET", "/deployments/name/kiln-pipeline/pipeline")
        return self.call("POST", f"/deployments/{deployment['id']}/create_flow_run", {"parameters": parameters})

    def wait(self, flow_run_id: str, timeout_s: float = 900) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run = self.call("GET", f"/flow_runs/{flow_run_id}")
            if run["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                return run
            time.sleep(0.5)
        raise TimeoutError(f"flow run {flow_run_id} not finished after {timeout_s}s")

    def first_start_after(self, flow_run_id: str, after: float, timeout_s: float = 120) -> tuple[str, float]:
        """The first task run of the flow run that started after `after` (server time): (name, start)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            runs = self.call("POST", "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
            started = sorted((stamp(r["start_time"]), r["name"]) for r in runs
                             if r["start_time"] and stamp(r["start_time"]) > after and r["state_name"] != "Cached")
            if started:
                return started[0][1], started[0][0]
            time.sleep(0.5)
        raise TimeoutError(f"no task run of {flow_run_id} started after {after}")


def ui_retry(config: str, tmp: Path) -> dict[str, float]:
    """Part 2: the operator's path on real servers, timed."""
    timings: dict[str, float] = {}
    servers = tmp / "servers-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    started = time.perf_counter()
    subprocess.run([*KILN, "up", f"work_dir={servers}", "--prefect-port", str(free_port()),
                    "--mlflow-port", str(free_port())], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    timings["kiln up (both servers healthy)"] = time.perf_counter() - started
    for line in (servers / "servers" / "env").read_text().splitlines():
        name, value = line.removeprefix("export ").split("=", 1)
        env[name] = value
    api, worker = Api(env["PREFECT_API_URL"]), None
    try:
        started = time.perf_counter()
        subprocess.run([*KILN, "deploy"], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
        timings["kiln deploy"] = time.perf_counter() - started
        worker = subprocess.Popen([*KILN, "worker"], cwd=REPO, env=env, start_new_session=True,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        eval_file = tmp / "eval.jsonl"  # missing: decontaminate, the 4th stage, fails
        parameters = {"config_path": config, "until": "tokenize",
                      "overrides": [f"work_dir={tmp / 'work'}", f"evaluate.eval_files=[{eval_file}]"]}
        created = api.run_deployment(parameters)
        failed = api.wait(created["id"])
        assert failed["state_type"] == "FAILED", failed["state"]
        _, first = api.first_start_after(created["id"], 0)
        timings["new deployment run: created -> first stage starts"] = first - stamp(created["created"])
        timings["new deployment run: created -> Failed at stage 4"] = stamp(failed["end_time"]) - stamp(created["created"])

        eval_file.write_text((REPO / "data" / "evals" / "heldout.jsonl").read_text())  # the fix
        retried = api.call("POST", f"/flow_runs/{created['id']}/set_state", {  # the Retry button's call
            "state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}, "force": True})
        clicked = stamp(retried["state"]["timestamp"])
        name, first = api.first_start_after(created["id"], clicked)
        done = api.wait(created["id"])
        assert done["state_type"] == "COMPLETED" and name.startswith("decontaminate"), (done["state"], name)
        states = api.call("GET", f"/flow_run_states/?flow_run_id={created['id']}")
        for kind, what in (("PENDING", "the worker picks it up (Pending)"), ("RUNNING", "the flow run is Running")):
            timings[f"UI Retry -> {what}"] = min(stamp(s["timestamp"]) for s in states
                                                 if s["type"] == kind and stamp(s["timestamp"]) > clicked) - clicked
        timings["UI Retry -> first re-executed stage starts"] = first - clicked
        timings["UI Retry -> Completed"] = stamp(done["end_time"]) - clicked
    finally:
        try:
            if worker is not None:
                stop(worker)
        finally:
            subprocess.run([*KILN, "down", f"work_dir={servers}"], cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Expected duration: about 3 minutes per cold run of configs/tiny.yaml on 2 "
                                            "cores, 10-30 s per cached rerun, and a few minutes more for part 2 (servers, "
                                            "a worker, a Retry).")
    parser.add_argument("--config", default="configs/tiny.yaml", help="the pipeline to run (default: configs/tiny.yaml)")
    parser.add_argument("--repeats", type=int, default=1, help="cold runs, each in a fresh folder (default: 1)")
    parser.add_argument("--cached-repeats", type=int, default=1, help="cached reruns after each cold run (default: 1)")
    parser.add_argument("--no-retry", action="store_true", help="skip part 2 (real servers, UI Retry)")
    args = parser.parse_args()
    cold, cached = [], []
    load_before = os.getloadavg()[0]
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            cold.append(timed_run(args.config, Path(tmp)))
            cached += [timed_run(args.config, Path(tmp)) for _ in range(args.cached_repeats)]
    print(f"config {args.config}, {args.repeats} cold run(s), {args.cached_repeats} cached rerun(s) after each; "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} CPUs)")
    print(f"cold run      median {statistics.median(cold):7.1f}s  {[round(s, 1) for s in cold]}")
    print(f"cached rerun  median {statistics.median(cached):7.1f}s  {[round(s, 1) for s in cached]}")
    print(f"RESULT pipeline_cached_rerun_s {statistics.median(cached):.1f}")
    print(f"RESULT pipeline_cached_rerun_speedup {statistics.median(cold) / statistics.median(cached):.2f}")
    if args.no_retry:
        return
    with tempfile.TemporaryDirectory() as tmp:
        timings = ui_retry(args.config, Path(tmp))
    for name, seconds in timings.items():
        print(f"{name:<52} {seconds:7.1f}s")
    retry = timings["UI Retry -> first re-executed stage starts"]
    print(f"RESULT ui_retry_first_stage_s {retry:.1f}")
    print(f"RESULT ui_retry_vs_new_run_first_stage "
          f"{retry / timings['new deployment run: created -> first stage starts']:.2f}")


if __name__ == "__main__":
    main()
