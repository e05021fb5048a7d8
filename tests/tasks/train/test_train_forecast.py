"""The train stage records the planner's forecast beside what it spent: a real (tiny) train stage
through the runner, on inputs committed to a store as the mix, fit and validate stages commit them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.config import load_config
from tasks.runner import run_stage
from tasks.scaling.fit import PLAN_FILE
from tasks.scaling.mix import MIXTURE_FILE
from tasks.scaling.validate import REPORT_FILE
from tasks.store import Store
from tasks.train.config import TrainRunConfig
from tasks.train.planner import forecast_training
from tests.fixtures.continuous_eval import write_mixture, write_tokenizer

REPO = Path(__file__).resolve().parents[3]
KEYS = {"mix": "31c0000e0001", "fit": "f170000e0002", "validate": "7a11da7e0003", "train": "7a10000e0004"}
INPUTS = {"mix": (), "fit": (), "validate": ()}
STEPS = ["train.run.steps=4", "train.run.checkpoint_every=2", "train.run.eval_batches=1", "train.lr=0.01",
         "train.run.num_threads=1"]


def commit(store: Store, stage: str, write) -> None:
    out = store.begin(stage, KEYS[stage])
    write(out)
    store.commit(stage, KEYS[stage], {"stage": stage, "key": KEYS[stage], "format_version": 1, "inputs": {},
                                      "identity": {}, "stats": {"headline": {}}, "wall_s": 0.1,
                                      "mlflow_run_id": "untracked", "created_at": "2026-01-01T00:00:00Z"})


@pytest.fixture
def inputs(tmp_path) -> Store:
    """A store with a one-domain mixture, a plan without a production run, and a passed gate."""
    store = Store(tmp_path / "store")

    def mixture(out: Path) -> None:
        write_mixture(out, write_tokenizer(out / "tokenizer.json"))
        manifest = json.loads((out / "manifest.json").read_text())
        for domain in manifest["domains"].values():  # shard paths are relative to the store root
            domain["train"] = [f"mix/{KEYS['mix']}/{name}" for name in domain["train"]]
            domain["val"] = [f"mix/{KEYS['mix']}/{name}" for name in domain["val"]]
        (out / MIXTURE_FILE).write_text(json.dumps(manifest))

    commit(store, "mix", mixture)
    commit(store, "fit", lambda out: (out / PLAN_FILE).write_text(json.dumps(
        {"lr": 0.01, "runs": {}, "refused": {"production": "not planned in this test"}, "loss_law": None})))
    commit(store, "validate", lambda out: (out / REPORT_FILE).write_text(json.dumps({"passed": True, "reasons": []})))
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
    assert stats["steps"] == 4 and stats["forecast"] == expected
    assert expected["devices"] == 1 and expected["step_s"] > 0
    assert manifest["cost"]["forecast_accelerator_s"] == expected["accelerator_s"]
    # nothing ran on an accelerator: no actual/forecast ratio, and 0 device-hours spent
    assert manifest["cost"]["accelerator_s"] == 0 and "forecast_ratio" not in manifest["cost"]
    assert outcome.headline["device_h"] == 0.0
    assert outcome.headline["forecast_device_h"] == float(f"{expected['device_hours']:.3g}")


def test_a_train_stage_on_a_cluster_without_accelerators_says_why_there_is_no_forecast(tmp_path, inputs):
    _, manifest, outcome = train(tmp_path, inputs)
    assert manifest["stats"]["forecast"] == {"skipped": "cluster.gpus_per_node is 0: the forecast prices "
                                             "accelerator time; describe the GPUs (a configs/clusters/*.yaml "
                                             "preset) to get one"}
    assert "forecast_accelerator_s" not in manifest["cost"] and "forecast_device_h" not in outcome.headline
