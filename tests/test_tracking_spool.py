"""Recording never fails a stage nor loses a record: a write that hit SQLite's lock is retried; what
MLflow cannot take (the database locked past the retries, the server killed) is kept in the store's
spool and written once MLflow answers, by the same run or the next one. Real SQLite locks, a real
MLflow server killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from kiln.tasks.config import load_config
from kiln.tasks.keylock import KeyLock
from kiln.tasks.runner import run_pipeline
from kiln.tasks.stage import Registry
from kiln.tasks.stages import collect as collect_stage
from kiln.tasks.store import Store
from kiln.tasks.tracking import MlflowTracker
from kiln.tasks.tracking_spool import LOCAL_PREFIX, spool_dir
from tests.fixtures import toy_stage

REPO = Path(__file__).resolve().parents[1]
LOCKED_S = 24  # longer than MLflow's SQLite busy timeout (20 s), after which it raises `database is locked`


def lock_database(db: Path) -> sqlite3.Connection:
    """An exclusive lock on the MLflow database, as a long write of another process holds it."""
    connection = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    connection.execute("BEGIN EXCLUSIVE")
    return connection


@pytest.mark.slow  # waits out MLflow's 20 s SQLite busy timeout
def test_a_write_that_hits_the_lock_is_retried_until_it_goes_in(tmp_path):
    db = tmp_path / "mlflow.db"
    tracker = MlflowTracker(f"sqlite:///{db}", "kiln", tmp_path / "artifacts", spool_dir(tmp_path / "store"),
                            write_retry_s=60)
    run_id = tracker.start_run("stage")
    holder = lock_database(db)
    # MLflow's own SQLite busy timeout waits 20 s, then raises `database is locked`; Kiln tries again
    threading.Timer(LOCKED_S, lambda: (holder.execute("COMMIT"), holder.close())).start()
    started = time.monotonic()
    tracker.log_metrics(run_id, {"loss": 1.5})
    assert time.monotonic() - started >= LOCKED_S - 1
    assert MlflowClient(tracker.uri).get_run(run_id).data.metrics == {"loss": 1.5}
    assert not spool_dir(tmp_path / "store").exists()  # nothing had to be kept


@pytest.mark.slow  # waits out MLflow's 20 s SQLite busy timeout
def test_a_stage_committed_while_mlflow_is_locked_is_recorded_by_the_next_run(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    registry = Registry([collect_stage.STAGE, toy_stage.STAGE])
    cfg = load_config("tests/fixtures/toy.yaml", [f"work_dir={tmp_path}"], registry=registry)
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    tracker = MlflowTracker(uri, "kiln", tmp_path / "artifacts", spool_dir(cfg.store_root), write_retry_s=1)
    parent = tracker.start_run("pipeline")
    holder = lock_database(db)  # for the whole run: every write after the parent's creation is refused
    outcomes = run_pipeline(cfg, registry=registry, tracker=tracker, parent_run_id=parent)
    tracker.end_run(parent)
    holder.execute("COMMIT")
    holder.close()

    store = Store(cfg.store_root)
    assert [o.status for o in outcomes] == ["ran", "ran"] and all(store.is_complete(o.stage, o.key) for o in outcomes)
    assert all(o.mlflow_run_id.startswith(LOCAL_PREFIX) for o in outcomes)  # created while locked: local ids
    client = MlflowClient(uri)
    assert [r.info.run_name for r in client.search_runs([tracker.experiment_id])] == ["pipeline"]
    journals = sorted(p.name for p in spool_dir(cfg.store_root).glob("*.jsonl"))
    assert len(journals) == 3  # the parent's later writes and each stage's run

    # the next run's tracker writes them (MlflowTracker.shared replays when it is made)
    done = MlflowTracker(uri, "kiln", tmp_path / "artifacts", spool_dir(cfg.store_root)).replay()
    assert (done.runs, done.journals, done.left, done.refused) == (2, 3, [], [])
    assert not list(spool_dir(cfg.store_root).glob("*.jsonl"))
    ids = json.loads((spool_dir(cfg.store_root) / "ids.json").read_text())
    for outcome in outcomes:
        run = client.get_run(ids[outcome.mlflow_run_id])
        manifest = store.manifest(outcome.stage, outcome.key)
        assert run.info.status == "FINISHED" and run.info.run_name == outcome.stage
        assert run.data.tags["kiln.spooled_id"] == manifest["mlflow_run_id"] == outcome.mlflow_run_id
        assert run.data.tags["mlflow.parentRunId"] == parent and run.data.tags["kiln.key"] == outcome.key
        assert run.data.metrics["cost.wall_s"] > 0 and run.data.params
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"manifest.json", "stats.json"} <= artifacts
    toy = client.get_run(ids[outcomes[1].mlflow_run_id])
    assert toy.data.metrics["num_long"] == outcomes[1].headline["long"]
    assert client.get_run(parent).info.status == "FINISHED"


def test_a_journal_is_replayed_by_its_owner_or_once_its_run_ended_and_a_refused_one_is_kept(tmp_path):
    uri, spool = f"sqlite:///{tmp_path / 'mlflow.db'}", spool_dir(tmp_path / "store")
    tracker = MlflowTracker(uri, "kiln", tmp_path / "artifacts", spool)
    running, ended = tracker.start_run("running"), tracker.start_run("ended")
    # writes MLflow could not take, journaled by other processes: one alive, one that died
    journals = {"running": tracker.spool.append(running, "log_batch", {"params": {"a": "1"}}),
                "ended": tracker.spool.append(ended, "set_terminated", {"status": "FINISHED", "end_time": 1}),
                "gone": tracker.spool.append("0123456789abcdef0123456789abcdef", "log_batch", {"params": {"a": "1"}})}
    owners = {"running": f"{socket.gethostname()}:{os.getppid()}", "ended": f"{socket.gethostname()}:{os.getppid()}",
              "gone": f"{socket.gethostname()}:{dead_pid()}"}
    for name, path in journals.items():
        header, *ops = path.read_text().splitlines()
        path.write_text("\n".join([json.dumps({**json.loads(header), "owner": owners[name]}), *ops]) + "\n")

    done = MlflowTracker(uri, "kiln", tmp_path / "artifacts", spool).replay()  # as the next run's tracker does
    assert done.journals == 1 and done.left == [journals["running"].name]  # its owner may still write to it
    assert MlflowClient(uri).get_run(ended).info.status == "FINISHED"
    assert done.refused == [journals["gone"].name]  # no such run: MLflow will never take it
    refused = spool / "refused" / journals["gone"].name
    assert "RESOURCE_DOES_NOT_EXIST" in json.loads(refused.read_text().splitlines()[0])["refused"]  # kept, with why


def test_a_journal_another_process_holds_waits_and_a_dead_holders_lock_is_broken(tmp_path):
    """The spool locks journals with the run ledger's KeyLock: a replay skips a journal whose lock a live
    writer holds (it is replayed once free), and breaks the lock a killed writer left behind."""
    uri, spool = f"sqlite:///{tmp_path / 'mlflow.db'}", spool_dir(tmp_path / "store")
    tracker = MlflowTracker(uri, "kiln", tmp_path / "artifacts", spool)
    run = tracker.start_run("held")
    journal = tracker.spool.append(run, "set_terminated", {"status": "FINISHED", "end_time": 1})
    lock = journal.with_name(journal.name + ".lock")

    with KeyLock(lock):  # a live writer appending to it
        assert MlflowTracker(uri, "kiln", tmp_path / "artifacts", spool).replay().journals == 0
    assert journal.exists() and MlflowClient(uri).get_run(run).info.status == "RUNNING"

    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead_pid(), "token": "x", "since": 0}))
    assert MlflowTracker(uri, "kiln", tmp_path / "artifacts", spool).replay().journals == 1
    assert not journal.exists() and not lock.exists()
    assert MlflowClient(uri).get_run(run).info.status == "FINISHED"


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_mlflow(folder: Path, port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--workers", "1", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
                               "--artifacts-destination", str(folder / "mlartifacts")],
                              stdout=open(folder / "mlflow.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return server
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "the MLflow server did not start"
            time.sleep(0.5)


@pytest.mark.cluster
def test_writes_while_the_server_is_down_go_in_when_it_is_back(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's client would wait ~4 min per write
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_mlflow(tmp_path, port)
    try:
        tracker = MlflowTracker(uri, "kiln", spool=spool_dir(tmp_path / "store"))
        run_id = tracker.start_run("stage", params={"lr": 0.1})
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        tracker.log_metrics(run_id, {"loss": 2.0}, step=1)
        child = tracker.start_run("trial", parent_id=run_id, params={"width": 8})
        tracker.log_metrics(child, {"loss": 3.0})
        (tmp_path / "report.md").write_text("# report\n")
        tracker.log_artifact(child, tmp_path / "report.md")
        tracker.end_run(child)
        assert child.startswith(LOCAL_PREFIX) and len(list(spool_dir(tmp_path / "store").glob("*.jsonl"))) == 2

        server = start_mlflow(tmp_path, port)
        monkeypatch.setattr("kiln.tasks.tracking._DOWN_FOR_S", 0.0)  # look again at once, not after 15 s
        tracker._down_until = 0.0
        tracker.log_metrics(run_id, {"loss": 1.0}, step=2)  # MLflow answers: the journals go in first
        tracker.end_run(run_id)
        assert not list(spool_dir(tmp_path / "store").glob("*.jsonl"))
        client = MlflowClient(uri)
        history = [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")]
        assert sorted(history) == [(1, 2.0), (2, 1.0)]
        [trial] = client.search_runs([tracker.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'")
        assert (trial.info.status, trial.data.params, trial.data.metrics) == ("FINISHED", {"width": "8"}, {"loss": 3.0})
        assert [a.path for a in client.list_artifacts(trial.info.run_id)] == ["report.md"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


@pytest.mark.cluster
def test_training_does_not_wait_while_the_tracking_server_is_down(tmp_path):
    """The tracking server SIGKILLed during training and back after OUTAGE_S: no step waits on it more than a
    few seconds (the metric writes are made behind the training, `StageRecorder.metrics_behind`), and every
    step's metrics are in MLflow once, after."""
    from kiln.tasks.ledger import StageRecorder
    from kiln.tasks.train.loop import train_model
    from tests.tasks.train.test_train_loop import MODEL, OPTIM, RUN, write_mixture

    outage_s, steps = 15, 40
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_mlflow(tmp_path, port)
    servers = [server]
    tracker = MlflowTracker(uri, "kiln", spool=spool_dir(tmp_path / "store"))  # MLflow's own client retries
    recorder = StageRecorder(tracker, tracker.start_run("train"), "train", "abc")
    (tmp_path / "data").mkdir()
    mixture = write_mixture(tmp_path / "data")
    called: list[float] = []

    def restart() -> None:
        servers.append(start_mlflow(tmp_path, port))

    back = threading.Timer(outage_s, restart)

    try:
        with recorder.metrics_behind() as record:
            def on_metrics(step: int, metrics: dict[str, float]) -> None:
                called.append(time.monotonic())
                if step == 5:
                    os.killpg(server.pid, signal.SIGKILL)
                    server.wait()
                    back.start()
                record(step, metrics)  # every step, then the validation loss at the end

            train_model(MODEL, OPTIM, RUN.model_copy(update={"steps": steps, "log_every": 1}), mixture,
                        tmp_path / "out", on_metrics=on_metrics)
        stalls = [later - earlier for earlier, later in zip(called, called[1:])]
        assert len(called) == steps + 1 and max(stalls) <= 5.0, f"training waited {max(stalls):.1f} s on MLflow"
        tracker.replay()
        history = MlflowClient(uri).get_metric_history(recorder.run_id, "loss")
        assert sorted(m.step for m in history) == list(range(1, steps + 1))  # each step once
    finally:
        if back.is_alive():
            back.join()
        for running in servers:
            if running.poll() is None:
                os.killpg(running.pid, signal.SIGTERM)
                running.wait(timeout=60)
