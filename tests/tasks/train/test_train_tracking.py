"""A training stage's MLflow run records what it trained with, not only what the config asked: with
`train.lr: plan` the fit's LR is the one used, and `train.optim.lr` (no setting: `train.lr` decides)
is not logged at all. A real (tiny) train stage through the runner, on committed inputs."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

from kiln.tasks.config import load_config
from kiln.tasks.runner import run_stage
from kiln.tasks.settings import open_tracker
from kiln.tasks.store import Store
from tests.fixtures.validate_inputs import KEYS, commit_fit_and_gate, commit_mix

REPO = Path(__file__).resolve().parents[3]
PLANNED_LR = 0.02


def test_the_train_run_logs_the_plans_lr_it_used_and_no_unused_optim_lr(tmp_path):
    store = Store(tmp_path / "store")
    commit_mix(store)
    commit_fit_and_gate(store, PLANNED_LR)
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        f"work_dir={tmp_path / 'work'}", "train.run.steps=2", "train.run.eval_batches=1", "train.run.num_threads=1",
        "anneal_ablation.from_step=null"])  # tiny's ablation starts from step 20, which a 2-step run never writes
    assert cfg.train.lr == "plan" and cfg.train.optim.lr != PLANNED_LR  # the default optim.lr is not the plan's

    outcome = run_stage("train", cfg, store=store, keys=KEYS, tracker=open_tracker(cfg))

    params = MlflowClient(cfg.tracking_uri).get_run(outcome.mlflow_run_id).data.params
    assert params["train.lr"] == "plan" and "train.optim.lr" not in params
    assert float(params["used.optim.lr"]) == PLANNED_LR
    assert params["used.run.steps"] == "2" and params["used.model.d_model"] == str(cfg.train.model.d_model)
    assert params["train.optim.weight_decay"] == params["used.optim.weight_decay"]  # the rest as configured
    # the bundled config's data schedule: step 1 in phase main, step 2 in the quality curriculum, charted
    history = MlflowClient(cfg.tracking_uri).get_metric_history(outcome.mlflow_run_id, "data.phase")  # MLflow names: "/" becomes "."
    assert [(m.step, m.value) for m in history] == [(2, 1.0)] and len(cfg.train.phases) == 2
