"""A launched run reports while its job runs: on the real local Slurm cluster, MLflow holds the loss of
early steps, and a planted loss spike's rollback reaches `on_event` (what alerts), before rank 0 has
written the job's result (its last act)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from kiln.tasks.launch.cluster import ClusterSpec
from kiln.tasks.train.callbacks import CallbackSpec
from kiln.tasks.train.config import ParallelDims
from kiln.tasks.train.launched_training import WORKER_RESULT, train_with_launcher
from kiln.tasks.train.testing_faults import FaultInjection
from tests.tasks.train.test_train_health import MODEL, OPTIM, WATCHED
from tests.tasks.train.test_train_loop import write_mixture

# a checkpoint every 5 of 30 steps: the job outlives several looks at its logs. The planted spike scores
# a z of about 95; near-zero losses late in this toy run reach 10-14 by noise alone, so the bar is 40
RUN = WATCHED.model_copy(update={"log_every": 1, "checkpoint_every": 5,
                                 "health": WATCHED.health.model_copy(update={"spike_zscore": 40.0})})
BAD_STEP = 14  # poisoned early, so that the job runs on for 16 steps and 3 checkpoints after the alert
# and pauses after the rollback: the driver's tail, which writes each earlier step's metrics to MLflow
# first, once saw the alert only after a fast job's end (CI, December 2026)
PAUSE_S = 5.0


@pytest.mark.cluster
def test_metrics_and_a_loss_alert_arrive_while_the_job_runs(slurm_cluster, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_mixture(data)
    out = tmp_path / "run"
    out.mkdir()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("live")).info.run_id
    seen_live: dict[str, bool] = {}

    def on_metrics(step: int, metrics: dict[str, float]) -> None:
        client.log_batch(run_id, [Metric(name.replace("/", "."), value, 0, step) for name, value in metrics.items()])
        if "loss" in metrics and "metrics" not in seen_live:
            in_mlflow = bool(client.get_metric_history(run_id, "loss"))
            seen_live["metrics"] = in_mlflow and not (out / WORKER_RESULT).exists()

    def on_event(event: dict) -> None:
        if event.get("action") == "rollback":
            seen_live["alert"] = not (out / WORKER_RESULT).exists()

    result = train_with_launcher(MODEL, OPTIM, RUN, ParallelDims(), ClusterSpec(), data / "manifest.json", data, out,
                                 launcher="slurm", timeout_s=300, on_metrics=on_metrics, on_event=on_event,
                                 callbacks=[CallbackSpec.of(FaultInjection, poison_data_index=[BAD_STEP - 1],
                                                                pause_after_step={BAD_STEP + 1: PAUSE_S})])
    assert result.health_events[0]["step"] == BAD_STEP and result.model_dir is not None
    assert seen_live == {"metrics": True, "alert": True}
    # every log step reached MLflow, the last one too (the tail's final look as the job ended)
    steps = sorted({m.step for m in client.get_metric_history(run_id, "loss")})
    assert steps == list(range(1, 31))
