"""The continuous-eval flow through the real Prefect API and MLflow store, while a real tiny training run
writes checkpoints into the store's partial folder and then commits, and then an anneal run does the
same: scores land in MLflow at the checkpoint steps, each step once; a run with nothing new changes
nothing; a real sustained rise in bits per byte (training goes on, at a high learning rate, on other
text) is one `kiln.eval.regression` event, with its alert sentence, however many steps it lasts; the
ECG is drawn; and two `kiln continuous-eval` processes started at once on the same new checkpoints
score and record each once, in the state file and in MLflow."""

import json
import os
import subprocess
import sys
import time

from mlflow.tracking import MlflowClient

from kiln.flows.cli import main
from kiln.flows.continuous_eval import continuous_eval
from kiln.tasks.config import load_config
from kiln.tasks.constants import TOKENIZER_FILE
from kiln.tasks.continuous_state import ecg_path, eval_targets, up_to_date
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

TINY = "configs/tiny.yaml"


def test_checkpoints_are_scored_in_mlflow_at_their_steps_once(prefect_api, in_repo, tmp_path, capsys):
    from prefect.settings import PREFECT_API_URL

    eval_file = write_eval_file(tmp_path / "evals" / "heldout.jsonl")
    # checkpoints every 5 steps, all kept (tiny's anneal ablation starts from step 20: the config checks it is kept)
    overrides = [f"work_dir={tmp_path / 'work'}", f"evaluate.eval_files=[{eval_file}]",
                 "train.run.checkpoint_every=5", "train.run.keep_every=5", "continuous_eval.every=5",
                 "evaluate.suite.categories=[]"]  # the held-out task alone: one series, one regression to follow
    cfg = load_config(TINY, overrides)
    keys, store = stage_keys(cfg), Store(cfg.store_root)
    # The stages before train, as far as continuous eval reads them: a committed tokenizer.
    tokenizer = write_tokenizer(store.begin("tokenize", keys["tokenize"]) / TOKENIZER_FILE)
    store.commit("tokenize", keys["tokenize"], {"stage": "tokenize"})

    assert continuous_eval(TINY, overrides)["train"]["evaluated"] == []  # training has not started: nothing to do
    assert not up_to_date(cfg, keys)  # but no ECG either: a pipeline's after-run pass still runs the flow

    # Training is running: checkpoints 5 and 10 in the partial folder, on the eval file's own text.
    partial = store.begin("train", keys["train"], resumable=True)
    train_model(MODEL, RISING_OPTIM, RUN, write_mixture(tmp_path / "data", tokenizer), partial, stop_after=10)
    first = continuous_eval(TINY, overrides)["train"]
    assert (first["evaluated"], first["skipped"], first["missed"]) == ([5, 10], {}, [])
    assert first["mlflow_steps_logged"] == [5, 10] and first["regressions"] == [] == first["open_regressions"]
    assert first["ecg"] == str(ecg_path(cfg, keys)) and ecg_path(cfg, keys).read_bytes()[:4] == b"\x89PNG"
    assert first["schedule_paused"] is False  # not a deployment run: nothing to pause

    # Training resumes on other text to step 20 and the stage commits: 15 and 20 are read from the final folder,
    # both far worse than step 10: one regression, where it starts.
    train_model(MODEL, RISING_OPTIM, RUN, other_mixture(tmp_path / "other", tokenizer), partial)
    store.commit("train", keys["train"], {"stage": "train"})
    second = continuous_eval(TINY, overrides)["train"]
    assert (second["evaluated"], second["recorded"], second["mlflow_steps_logged"]) == ([15, 20], [5, 10, 15, 20], [15, 20])
    assert second["mlflow_run_id"] == first["mlflow_run_id"]
    [regression] = second["regressions"]
    assert (regression["kind"], regression["task"], regression["step"], regression["best_step"]) == (
        "started", "kiln_heldout", 15, 10)
    assert regression["current"] > regression["best"] * 1.05 and regression["noise"] == regression["best"] * 0.05
    assert second["open_regressions"] == [regression]  # step 20 is still worse: the same regression, no new event
    event = _wait_for_event("kiln.eval.regression", regression["current"])  # emitted to the Prefect API, for the alert
    assert event.resource.id == "kiln.eval.tiny"
    assert {k: event.payload[k] for k in ("task", "step", "best", "best_step", "stage")} == {
        "task": "kiln_heldout", "step": 15, "best": regression["best"], "best_step": 10, "stage": "train"}
    text = event.payload["text"]
    assert text.startswith(f"Continuous eval of {TINY} with work_dir=") and "kiln_heldout bits_per_byte regressed at " \
        f"train step 15: {regression['current']:.4f}, worse than its best {regression['best']:.4f} (step 10)" in text
    ui = PREFECT_API_URL.value().removesuffix("/api")
    assert f"Flow run: {ui}/v2/runs/flow-run/" in text

    # Nothing new: the CLI's run evaluates nothing, logs nothing and emits nothing.
    capsys.readouterr()
    environ = dict(os.environ)
    try:
        assert main(["continuous-eval", TINY, *overrides]) == 0
    finally:  # the CLI pins PREFECT_HOME, MLFLOW_TRACKING_URI, ... for its process; later tests get theirs back
        os.environ.clear()
        os.environ.update(environ)
    out = capsys.readouterr().out
    assert f"train {keys['train']}: evaluated steps none new; 4 steps recorded" in out
    assert "open regression: kiln_heldout bits_per_byte since step 15" in out
    assert up_to_date(cfg, keys)  # what lets a cached pipeline rerun skip the after-run pass

    target = eval_targets(cfg, keys)[0]
    rows = {step: row for (step, _), row in read_recorded(target.state_file).items()}
    client = MlflowClient(cfg.tracking_uri)
    experiment = client.get_experiment_by_name("kiln").experiment_id
    runs = client.search_runs([experiment], filter_string="tags.`kiln.stage` = 'continuous-eval'")
    assert [r.info.run_name for r in runs] == [f"continuous-eval/train/{keys['train']}"]
    assert runs[0].data.tags["kiln.eval_key"] == target.eval_key
    history = client.get_metric_history(runs[0].info.run_id, "kiln_heldout.bits_per_byte")
    assert [(m.step, m.value) for m in history] == [
        (step, rows[step]["metrics"]["kiln_heldout/bits_per_byte"]) for step in (5, 10, 15, 20)]
    assert [a.path for a in client.list_artifacts(runs[0].info.run_id) if a.path.endswith(".png")] == ["ecg.png"]
    assert json.loads(runs[0].data.params["evaluate.eval_files"]) == [str(eval_file)]

    # The anneal stage's checkpoints, scored by two `kiln continuous-eval` processes started at once (as a
    # scheduled run and a pipeline's pass may be): each step scored by one of them, recorded once.
    anneal_partial = store.begin("anneal", keys["anneal"], resumable=True)
    train_model(MODEL, RISING_OPTIM, RUN, write_mixture(tmp_path / "anneal-data", tokenizer), anneal_partial, stop_after=10)
    assert not up_to_date(cfg, keys)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))},
           "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(in_repo)}
    command = [sys.executable, "-m", "kiln.flows.cli", "continuous-eval", TINY, *overrides]
    scorers = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for _ in range(2)]
    outputs = [scorer.communicate(timeout=600)[0] for scorer in scorers]
    assert [s.returncode for s in scorers] == [0, 0], "\n\n".join(o[-3000:] for o in outputs)
    # every anneal checkpoint (tiny.yaml: anneal.checkpoint_every=5); continuous_eval.every thins only the train ones
    said = [next(line for line in o.splitlines() if line.startswith(f"anneal {keys['anneal']}:")) for o in outputs]
    scored = sorted(step for line in said for step in _steps_in(line))
    assert scored == [5, 10], said  # between them, each once
    anneal = eval_targets(cfg, keys)[1]
    assert sorted(read_recorded(anneal.state_file)) == [(5, "kiln_heldout"), (10, "kiln_heldout")]
    assert len(anneal.state_file.read_text().splitlines()) == 2
    [anneal_run] = client.search_runs([experiment], filter_string="tags.`kiln.evaluated_stage` = 'anneal'")
    assert anneal_run.info.run_name == f"continuous-eval/anneal/{keys['anneal']}"
    assert [m.step for m in client.get_metric_history(anneal_run.info.run_id, "kiln_heldout.bits_per_byte")] == [5, 10]
    assert up_to_date(cfg, keys)
    ecg_path(cfg, keys).unlink()
    assert not up_to_date(cfg, keys)


def _steps_in(line: str) -> list[int]:
    """The steps an `anneal <key>: evaluated steps [5, 10]; ...` line says this process scored."""
    listed = line.split("evaluated steps ", 1)[1].split(";", 1)[0]
    return [] if listed == "none new" else json.loads(listed)


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
                assert len(events) == 1, f"the regression was emitted {len(events)} times"
                return events[0]
            time.sleep(0.5)
