"""The training stages record the planner's forecast beside what they spent: real (tiny) train and
validate stages through the runner, on inputs committed to a store as the stages before them commit
them. A stage's forecast is the sum over every training run it does (validate: its run and the
mixture-transfer runs), and says that it covers training only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.tasks.config import load_config
from kiln.tasks.runner import run_stage
from kiln.tasks.store import Store
from kiln.tasks.train.config import TrainRunConfig
from kiln.tasks.train.launched_training import WORKER_CONFIG
from kiln.tasks.train.planner import forecast_training
from tests.fixtures.validate_inputs import (
    KEYS,
    VOCAB_SIZE,
    commit_fit_and_gate,
    commit_mix,
    commit_validate_inputs,
)

REPO = Path(__file__).resolve().parents[3]
# (tiny's anneal ablation starts from step 20, which a 4-step run never writes: the config refuses it)
STEPS = ["train.run.steps=4", "train.run.checkpoint_every=2", "train.run.eval_batches=1", "train.lr=0.01",
         "train.run.num_threads=1", "anneal_ablation.from_step=null"]
COVERS = "the training runs in `runs`; evaluations and other work are not forecast"
NO_GPUS = ("cluster.gpus_per_node is 0: the forecast prices accelerator time; describe the GPUs (a "
           "configs/clusters/*.yaml preset) to get one")


@pytest.fixture
def inputs(tmp_path) -> Store:
    """A store with a one-domain mixture, a plan without a production run, and a passed gate."""
    store = Store(tmp_path / "store")
    commit_mix(store)
    commit_fit_and_gate(store, 0.01)
    return store


def train(tmp_path: Path, store: Store, *overrides: str):
    cfg = load_config(REPO / "configs" / "tiny.yaml", [f"work_dir={tmp_path / 'work'}", *STEPS, *overrides])
    outcome = run_stage("train", cfg, store=store, keys=KEYS)
    return cfg, store.manifest("train", KEYS["train"]), outcome


def test_a_train_stage_records_the_forecast_for_its_cluster_beside_its_cost(tmp_path, inputs):
    # the cluster section is runtime: a CPU run of a config meant for one H100 is forecast for that H100
    cfg, manifest, outcome = train(tmp_path, inputs, "cluster.gpus_per_node=1")
    expected = forecast_training(cfg.train.model, 320, TrainRunConfig(steps=4, batch_size=8, seq_len=64),
                                 cfg.train.parallel, cfg.cluster).to_dict()
    stats = manifest["stats"]
    assert stats["steps"] == 4 and stats["forecast"] == {
        "covers": COVERS, "runs": {"train": expected}, "wall_s": expected["wall_s"],
        "accelerator_s": expected["accelerator_s"], "device_hours": expected["device_hours"]}
    assert expected["devices"] == 1 and expected["step_s"] > 0
    assert manifest["cost"]["forecast_accelerator_s"] == expected["accelerator_s"]
    # nothing ran on an accelerator: no actual/forecast ratio, and 0 device-hours spent
    assert manifest["cost"]["accelerator_s"] == 0 and "forecast_ratio" not in manifest["cost"]
    assert outcome.headline["device_h"] == 0.0
    assert outcome.headline["forecast_device_h"] == float(f"{expected['device_hours']:.3g}")


def test_a_train_stage_on_a_cluster_without_accelerators_says_why_there_is_no_forecast(tmp_path, inputs):
    _, manifest, outcome = train(tmp_path, inputs)
    assert manifest["stats"]["forecast"] == {"covers": COVERS, "runs": {"train": {"skipped": NO_GPUS}},
                                             "skipped": f"train: {NO_GPUS}"}
    assert "forecast_accelerator_s" not in manifest["cost"] and "forecast_device_h" not in outcome.headline


def test_a_validate_stage_forecasts_its_run_and_each_mixture_transfer_run_it_trains(tmp_path):
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        f"work_dir={tmp_path / 'work'}", "cluster.gpus_per_node=1", "validate.capabilities.enabled=false",
        "validate.run.steps=4", "validate.run.checkpoint_every=2", "validate.run.eval_batches=1",
        "validate.run.num_threads=1", "validate.mixture_transfer.num_mixtures=3", "validate.mixture_transfer.steps=2"])
    store = commit_validate_inputs(Store(tmp_path / "store"), cfg.sweep.reference)
    run_stage("validate", cfg, store=store, keys=KEYS)
    manifest = store.manifest("validate", KEYS["validate"])
    run = TrainRunConfig(steps=4, batch_size=8, seq_len=64, eval_batches=1, checkpoint_every=2, num_threads=1)
    main = forecast_training(cfg.validate_.model, VOCAB_SIZE, run, cfg.train.parallel, cfg.cluster).to_dict()
    # the transfer runs train where the validate run does, at the transfer's 2 steps; none is the validate
    # run itself (that needs the validate run's length)
    transfer = forecast_training(cfg.validate_.model, VOCAB_SIZE, run.model_copy(update={"steps": 2}),
                                 cfg.train.parallel, cfg.cluster).to_dict()
    assert (main["steps"], transfer["steps"], transfer["devices"]) == (4, 2, 1)
    assert transfer["step_s"] == main["step_s"]  # one layout on one device: twice the steps, twice the forecast
    names = ["planned", cfg.sweep.reference, "other"]
    assert manifest["stats"]["forecast"] == {
        "covers": COVERS, "runs": {"validate": main, **{f"transfer/{name}": transfer for name in names}},
        **{key: main[key] + transfer[key] + transfer[key] + transfer[key]
           for key in ("wall_s", "accelerator_s", "device_hours")}}
    assert manifest["stats"]["forecast"]["accelerator_s"] == pytest.approx(2.5 * main["accelerator_s"], rel=1e-12)
    assert manifest["cost"]["forecast_accelerator_s"] == manifest["stats"]["forecast"]["accelerator_s"]
    assert sorted(manifest["stats"]["gate"]["mixture_transfer"]["observed"]) == sorted(names)


@pytest.mark.slow
@pytest.mark.distributed
def test_mixture_transfer_runs_train_through_the_configured_launcher(tmp_path):
    """validate's transfer runs train where its own run does: here each is a torchrun job of its own."""
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        f"work_dir={tmp_path / 'work'}", "cluster.launcher=torchrun", "validate.capabilities.enabled=false",
        "validate.run.steps=4", "validate.run.checkpoint_every=2", "validate.run.eval_batches=1",
        "validate.run.num_threads=1", "validate.mixture_transfer.num_mixtures=3", "validate.mixture_transfer.steps=2"])
    store = commit_validate_inputs(Store(tmp_path / "store"), cfg.sweep.reference)
    run_stage("validate", cfg, store=store, keys=KEYS)
    out = store.path("validate", KEYS["validate"])
    names = ["planned", cfg.sweep.reference, "other"]
    for name in names:
        launched = json.loads((out / "transfer" / name / WORKER_CONFIG).read_text())
        assert launched["train"]["steps"] == 2
        assert (out / "transfer" / name / "model").is_dir()
    observed = store.manifest("validate", KEYS["validate"])["stats"]["gate"]["mixture_transfer"]["observed"]
    assert sorted(observed) == sorted(names) and all(loss > 0 for loss in observed.values())
