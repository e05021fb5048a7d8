"""The continuous-eval flow through the real Prefect API and MLflow store, while a real tiny training run
writes checkpoints into the store's partial folder and then commits, and then an anneal run does the
same: scores land in MLflow at the checkpoint steps, each step once, a run with nothing new changes
nothing, a regressed score is a `kiln.eval.regression` event, and the ECG is drawn."""

import json
import os
import time

from mlflow.tracking import MlflowClient

from flows.cli import main
from flows.continuous_eval import continuous_eval, ecg_path, up_to_date
from tasks.config import load_config
from tasks.data.tokenize import TOKENIZER_FILE
from flows.continuous_eval import eval_targets
from tasks.evals.continuous import read_recorded
from tasks.graph import stage_keys
from tasks.store import Store
from tasks.train.loop import train_model
from tests.fixtures.continuous_eval import MODEL, OPTIM, RUN, write_eval_file, write_mixture, write_tokenizer

TINY = "configs/tiny.yaml"


def test_checkpoints_are_scored_in_mlflow_at_their_steps_once(prefect_api, in_repo, tmp_path, capsys):
    eval_file = write_eval_file(tmp_path / "evals" / "heldout.jsonl")
    overrides = [f"work_dir={tmp_path / 'work'}", f"evaluate.eval_files=[{eval_file}]",
                 "train.run.checkpoint_every=5", "continuous_eval.every=10"]
    cfg = load_config(TINY, overrides)
    keys, store = stage_keys(cfg), Store(cfg.store_root)
    # The stages before train, as far as continuous eval reads them: a committed tokenizer.
    tokenizer = write_tokenizer(store.begin("tokenize", keys["tokenize"]) / TOKENIZER_FILE)
    store.commit("tokenize", keys["tokenize"], {"stage": "tokenize"})

    assert continuous_eval(TINY, overrides)["train"]["evaluated"] == []  # training has not started: nothing to do
    assert not up_to_date(cfg, keys)  # but no ECG either: a pipeline's after-run pass still runs the flow

    # Training is running: checkpoints 5, 10, 15 in the partial folder; 10 is due.
    mixture = write_mixture(tmp_path / "data", tokenizer)
    partial = store.begin("train", keys["train"], resumable=True)
    train_model(MODEL, OPTIM, RUN, mixture, partial, stop_after=15)
    first = continuous_eval(TINY, overrides)["train"]
    assert (first["evaluated"], first["skipped"], first["missed"]) == ([10], {}, [])
    assert first["mlflow_steps_logged"] == [10] and first["regressions"] == []
    assert first["ecg"] == str(ecg_path(cfg, keys)) and ecg_path(cfg, keys).read_bytes()[:4] == b"\x89PNG"

    # Pretend step 10 scored far better than it did: step 20 then regresses from that best.
    state_file = eval_targets(cfg, keys)[0].state_file
    step10 = json.loads(state_file.read_text())
    logged_bits = step10["metrics"]["kiln_heldout/bits_per_byte"]
    step10["metrics"]["kiln_heldout/bits_per_byte"] = 0.5
    state_file.write_text(json.dumps(step10) + "\n")

    # Training resumes to step 20 and the stage commits: 20 is read from the final folder.
    train_model(MODEL, OPTIM, RUN, mixture, partial)
    store.commit("train", keys["train"], {"stage": "train"})
    second = continuous_eval(TINY, overrides)["train"]
    assert (second["evaluated"], second["recorded"], second["mlflow_steps_logged"]) == ([20], [10, 20], [20])
    assert second["mlflow_run_id"] == first["mlflow_run_id"]
    [regression] = second["regressions"]
    assert (regression["task"], regression["step"], regression["best"], regression["best_step"]) == ("kiln_heldout", 20, 0.5, 10)
    assert regression["current"] > 0.5 + regression["tolerance"] and regression["tolerance"] == 0.05
    event = _wait_for_event("kiln.eval.regression", regression["current"])  # emitted to the Prefect API, for the alert automation
    assert event.resource.id == "kiln.eval.tiny"
    assert {k: event.payload[k] for k in ("task", "step", "best", "tolerance")} == {
        "task": "kiln_heldout", "step": 20, "best": 0.5, "tolerance": 0.05}
    assert event.payload["current"] == regression["current"]

    # Nothing new: the CLI's run evaluates nothing and logs nothing.
    capsys.readouterr()
    environ = dict(os.environ)
    try:
        assert main(["continuous-eval", TINY, *overrides]) == 0
    finally:  # the CLI pins PREFECT_HOME, MLFLOW_TRACKING_URI, ... for its process; later tests get theirs back
        os.environ.clear()
        os.environ.update(environ)
    assert f"train {keys['train']}: evaluated steps none new; 2 steps recorded" in capsys.readouterr().out
    assert up_to_date(cfg, keys)  # what lets a cached pipeline rerun skip the after-run pass

    target = eval_targets(cfg, keys)[0]
    rows = {step: row for (step, _), row in read_recorded(target.state_file).items()}
    client = MlflowClient(cfg.tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("kiln").experiment_id],
                              filter_string="tags.`kiln.stage` = 'continuous-eval'")
    assert [r.info.run_name for r in runs] == [f"continuous-eval/train/{keys['train']}"]
    assert runs[0].data.tags["kiln.eval_key"] == target.eval_key
    history = client.get_metric_history(runs[0].info.run_id, "kiln_heldout.bits_per_byte")
    assert [(m.step, m.value) for m in history] == [
        (10, logged_bits), (20, rows[20]["metrics"]["kiln_heldout/bits_per_byte"])]
    assert history[1].value < history[0].value
    assert [a.path for a in client.list_artifacts(runs[0].info.run_id) if a.path.endswith(".png")] == ["ecg.png"]
    assert json.loads(runs[0].data.params["evaluate.eval_files"]) == [str(eval_file)]

    # The anneal stage's checkpoints are scored too, in their own series.
    anneal_partial = store.begin("anneal", keys["anneal"], resumable=True)
    train_model(MODEL, OPTIM, RUN, mixture, anneal_partial, stop_after=10)
    assert not up_to_date(cfg, keys)
    annealed = continuous_eval(TINY, overrides)
    # every anneal checkpoint (tiny.yaml: anneal.checkpoint_every=5); continuous_eval.every thins only the train ones
    assert annealed["train"]["evaluated"] == [] and annealed["anneal"]["evaluated"] == [5, 10]
    assert annealed["anneal"]["mlflow_run_id"] != second["mlflow_run_id"]
    assert up_to_date(cfg, keys)
    ecg_path(cfg, keys).unlink()
    assert not up_to_date(cfg, keys)


def _wait_for_event(name: str, current: float, timeout_s: float = 30.0):
    """The newest event called `name` whose payload's `current` is this run's, once the Prefect API has
    stored it (events are written asynchronously; earlier tests' pipeline runs share the API and emit
    their own regressions)."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            events = client.read_events(EventFilter(event=EventNameFilter(name=[name])), limit=50).events
            events = [e for e in events if e.payload.get("current") == current]
            if events or time.monotonic() > deadline:
                assert events, f"no {name} event reached the Prefect API in {timeout_s}s"
                return events[0]
            time.sleep(0.5)
