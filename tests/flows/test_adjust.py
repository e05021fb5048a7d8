"""Mid-run adjustment (`kiln adjust`, `train.branch`): a new train run goes on from a kept checkpoint of
another under a changed schedule, trains only the steps after it, and its lineage names the prefix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.flows.cli import adjustment
from kiln.tasks.config import load_config
from kiln.tasks.errors import ConfigError
from kiln.tasks.graph import stage_keys
from kiln.tasks.lineage import lineage, render_table
from kiln.tasks.runner import run_stage
from kiln.tasks.store import Store
from tests.fixtures.validate_inputs import KEYS, commit_fit_and_gate, commit_mix

REPO = Path(__file__).resolve().parents[2]
PREFIX = ["train.run.steps=6", "train.run.checkpoint_every=2", "train.run.keep_every=2", "train.run.eval_batches=1",
          "train.run.num_threads=1", "anneal_ablation.from_step=null"]
CHANGE = "train.phases=[{name: main, until_step: 4}, {name: late, seq_len: 32}]"


def test_the_adjustment_key_derives_from_the_prefix_key_the_step_and_the_schedule(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(f"extends: {REPO / 'configs' / 'tiny.yaml'}\nwork_dir: {tmp_path / 'work'}\n")
    prefix, overrides = adjustment(str(config), [CHANGE], 4)
    assert prefix == stage_keys(load_config(config))["train"]
    assert overrides == [CHANGE, f"train.branch={{prefix: '{prefix}', from_step: 4}}"]
    key = stage_keys(load_config(config, overrides))["train"]
    other_step = stage_keys(load_config(config, adjustment(str(config), [CHANGE], 2)[1]))["train"]
    other_schedule = stage_keys(load_config(config, [overrides[1]]))["train"]  # the branch alone, schedule kept
    assert len({prefix, key, other_step, other_schedule}) == 4
    with pytest.raises(Exception, match="needs at least one change"):
        adjustment(str(config), [], 4)


def test_an_adjustment_trains_only_the_steps_after_the_branch(tmp_path) -> None:
    store = Store(tmp_path / "store")
    commit_mix(store)
    commit_fit_and_gate(store, 0.02)
    base = [f"work_dir={tmp_path / 'work'}", *PREFIX]
    first = run_stage("train", load_config(REPO / "configs" / "tiny.yaml", base), store=store, keys=KEYS)
    prefix_stats = store.manifest("train", KEYS["train"])["stats"]
    assert prefix_stats["steps_trained"] == 6 and first.key == KEYS["train"]

    branch = f"train.branch={{prefix: '{KEYS['train']}', from_step: 4}}"
    cfg = load_config(REPO / "configs" / "tiny.yaml", [*base, CHANGE, branch])
    adjusted_key = "ad1000000007"
    run_stage("train", cfg, store=store, keys={**KEYS, "train": adjusted_key})
    stats = store.manifest("train", adjusted_key)["stats"]
    assert (stats["resumed_from_step"], stats["steps_trained"], stats["steps"]) == (4, 2, 6)  # counted: 5 and 6
    assert stats["branch"] == {"prefix": KEYS["train"], "from_step": 4}
    metrics = json.loads((store.path("train", adjusted_key) / "metrics.json").read_text())
    prefix_metrics = json.loads((store.path("train", KEYS["train"]) / "metrics.json").read_text())
    assert metrics["loss_curve"][:4] == prefix_metrics["loss_curve"][:4]  # the prefix's steps, not retrained
    assert [step for step, _ in metrics["loss_curve"]] == [1, 2, 3, 4, 5, 6]
    # the prefix's 4 steps of its phase main (the bundled schedule), then 2 of the new schedule's late phase
    # at its sequence length: the loader's position went on from the checkpoint's
    run = cfg.train.run
    assert {name: sum(by_source.values()) for name, by_source in metrics["tokens_by_phase"].items()} == {
        "main": 4 * run.batch_size * run.seq_len, "late": 2 * run.batch_size * 32}
    history = metrics["mixture_history"]
    assert [steps for steps, _ in history] == [0, 4] and [p["name"] for p in history[1][1]["phases"]] == ["main", "late"]

    links = lineage(store, "train", adjusted_key)
    assert links[-1].continues == (f"train {KEYS['train']} up to step 4, then schedule main (to step 4) -> late "
                                   "seq_len 32 to step 6")
    assert f"train {adjusted_key}: train {KEYS['train']} up to step 4" in render_table(links)

    with pytest.raises(ConfigError, match=r"kept checkpoints of steps \[2, 4, 6\]"):
        run_stage("train", load_config(REPO / "configs" / "tiny.yaml", [*base, CHANGE, branch.replace("4}", "3}")]),
                  store=store, keys={**KEYS, "train": "ad1000000008"})
