"""Continuous eval on a real tiny training run's DCP checkpoints: which steps are due, scores recorded
once (also by two scorers at once, in two processes), weights equal to the trained model's, pruned and
corrupt checkpoints skipped with a reason."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import kiln.tasks.train.dcp as dcp_module
from kiln.tasks.config import load_config
from kiln.tasks.continuous_state import eval_targets
from kiln.tasks.errors import ConfigError, InputError
from kiln.tasks.evals.continuous import (
    STATE_FILE,
    EvalTarget,
    evaluate_checkpoint,
    plan_evaluations,
    read_recorded,
)
from kiln.tasks.evals.evaluate import EvaluateConfig, evaluate_model
from kiln.tasks.graph import stage_keys
from kiln.tasks.library_output import LIBRARY_LOG
from kiln.tasks.store import Store
from kiln.tasks.train.checkpoint import MARKER, checkpoint_dir, sha256_file
from kiln.tasks.train.dcp import load_model_weights
from kiln.tasks.train.loop import train_model
from kiln.tasks.train.model import Transformer, load_model
from tests.fixtures.continuous_eval import MODEL, OPTIM, RUN, TEXTS, write_eval_file, write_mixture, write_tokenizer

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """20 real training steps with DCP checkpoints at 5, 10, 15 and 20."""
    root = tmp_path_factory.mktemp("continuous")
    tokenizer = write_tokenizer(root / "tokenizer.json")
    mixture = write_mixture(root / "data", tokenizer)
    result = train_model(MODEL, OPTIM, RUN, mixture, root / "train")
    return {"root": root, "checkpoints": root / "train" / "checkpoints", "model": result.model_dir,
            "tokenizer": root / "tokenizer.json", "eval_file": write_eval_file(root / "evals" / "heldout.jsonl")}


def target_in(store: Store, trained: dict[str, Path], tmp_path: Path, every: int) -> EvalTarget:
    """The target of train key `train0` in `store`."""
    return EvalTarget(stage="train", stage_key="train0", eval_key="eval0", every=every,
                      evaluate=EvaluateConfig(eval_files=[str(trained["eval_file"])]), store=store,
                      tokenizer=trained["tokenizer"], state_dir=tmp_path / "state")


def target_for(trained: dict[str, Path], tmp_path: Path, every: int, checkpoints: Path | None = None) -> EvalTarget:
    """A target whose train stage is running, with `checkpoints` (default: the trained run's) in its partial folder."""
    store = Store(tmp_path / "store")
    partial = store.partial_path("train", "train0")
    partial.mkdir(parents=True, exist_ok=True)
    if not (partial / "checkpoints").exists():
        (partial / "checkpoints").symlink_to(checkpoints or trained["checkpoints"])
    return target_in(store, trained, tmp_path, every)


def copy_checkpoints(trained: dict[str, Path], dest: Path) -> Path:
    shutil.copytree(trained["checkpoints"], dest)
    return dest


def test_due_steps_are_the_multiples_of_every_not_yet_recorded(trained, tmp_path):
    assert list(plan_evaluations(target_for(trained, tmp_path, every=10)).due) == [10, 20]
    target = target_for(trained, tmp_path, every=5)
    plan = plan_evaluations(target)
    assert plan.due == {step: ["kiln_heldout"] for step in (5, 10, 15, 20)}
    target.state_dir.mkdir()
    version = plan.versions["kiln_heldout"]
    target.state_file.write_text(json.dumps({"step": 10, "task": "kiln_heldout", "version": version, "metrics": {}}) + "\n")
    plan = plan_evaluations(target)
    assert list(plan.due) == [5, 15, 20] and list(plan.recorded) == [(10, "kiln_heldout")] and plan.missed == []


def test_evaluations_are_deduplicated_by_checkpoint_task_and_task_version(trained, tmp_path):
    target = target_for(trained, tmp_path, every=10)
    target.state_dir.mkdir()
    versions = plan_evaluations(target).versions
    rows = [{"step": s, "task": "kiln_heldout", "version": versions["kiln_heldout"], "metrics": {}} for s in (10, 20)]
    target.state_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plan_evaluations(target).due == {}
    # A task added to the suite is due on the checkpoints already scored, and only it.
    with_choice = {**versions, "kiln_heldout_choice": "1+abc"}
    assert plan_evaluations(target, with_choice).due == {10: ["kiln_heldout_choice"], 20: ["kiln_heldout_choice"]}
    # A changed version (its eval file, its settings, or lm-eval's version of it) is scored again.
    assert plan_evaluations(target, {"kiln_heldout": "2+def"}).due == {10: ["kiln_heldout"], 20: ["kiln_heldout"]}
    # The real thing: editing the eval file changes the bits-per-byte task's version.
    edited = tmp_path / "heldout.jsonl"
    edited.write_text(trained["eval_file"].read_text().replace("cat", "dog"))
    moved = dataclasses.replace(target, evaluate=EvaluateConfig(eval_files=[str(edited)]))
    assert plan_evaluations(moved).versions["kiln_heldout"] != versions["kiln_heldout"]
    assert list(plan_evaluations(moved).due) == [10, 20]


def test_checkpoints_are_read_where_the_store_has_them_and_pruned_ones_are_reported(trained, tmp_path):
    # While the stage runs its checkpoints are in the partial folder; 5 was pruned before anyone evaluated it.
    store = Store(tmp_path / "store")
    target = target_in(store, trained, tmp_path, every=5)
    assert plan_evaluations(target).due == {}  # the stage has not started
    partial = copy_checkpoints(trained, store.partial_path("train", "train0") / "checkpoints")
    shutil.rmtree(checkpoint_dir(partial, 5))
    plan = plan_evaluations(target)
    assert list(plan.due) == [10, 15, 20] and plan.missed == [5]
    # The stage commits: the same checkpoints are found in its final folder.
    store.commit("train", "train0", {"stage": "train"})
    assert target.checkpoint_root() == store.path("train", "train0") / "checkpoints"
    assert list(plan_evaluations(target).due) == [10, 15, 20]


@pytest.fixture(scope="module")
def evaluated(trained, tmp_path_factory):
    """Continuous eval of every 10th step, run once."""
    target = target_for(trained, tmp_path_factory.mktemp("evaluated"), every=10)
    outcomes = [evaluate_checkpoint(target, step, tasks) for step, tasks in plan_evaluations(target).due.items()]
    return target, outcomes


def test_each_due_checkpoint_is_scored_once_and_recorded_beside_the_data(evaluated, trained, tmp_path):
    target, outcomes = evaluated
    assert [(o.step, o.evaluated, o.reason, o.tasks) for o in outcomes] == [
        (10, True, None, ("kiln_heldout",)), (20, True, None, ("kiln_heldout",))]
    rows = read_recorded(target.state_file)
    assert list(rows) == [(10, "kiln_heldout"), (20, "kiln_heldout")]
    assert [r["marker_sha256"] for r in rows.values()] == [
        sha256_file(checkpoint_dir(trained["checkpoints"], s) / MARKER) for s in (10, 20)]
    assert {r["version"] for r in rows.values()} == {plan_evaluations(target).versions["kiln_heldout"]}
    bits = {step: row["metrics"]["kiln_heldout/bits_per_byte"] for (step, _), row in rows.items()}
    assert 0 < bits[20] < bits[10]  # the electrocardiogram: training on the text improves its score
    assert rows[20, "kiln_heldout"]["metrics"]["kiln_heldout/num_docs"] == len(TEXTS)
    assert sorted(p.name for p in target.state_dir.iterdir()) == [  # the temporary model is gone
        STATE_FILE, LIBRARY_LOG, "step_0000010.results.json", "step_0000020.results.json"]
    assert (target.state_dir / LIBRARY_LOG).read_text().count("Generating test split") >= 2  # both steps' lines
    # Step 20 is the last step: its scores are exactly the evaluate stage's on the final saved model (the same
    # weights through the same adapter, batches and kernels on one machine: bit-identical by design).
    out = tmp_path / "final_eval"
    out.mkdir()
    final = evaluate_model(target.evaluate, trained["model"], trained["tokenizer"], out)
    assert {k: v for k, v in final.items() if k.startswith("kiln_heldout/")} == rows[20, "kiln_heldout"]["metrics"]
    # Idempotent: the state file says both are done.
    assert plan_evaluations(target).due == {}


def test_weights_loaded_equal_the_saved_model(trained):
    final, _ = load_model(trained["model"])
    loaded = Transformer(MODEL, final.vocab_size)
    train_state = load_model_weights(checkpoint_dir(trained["checkpoints"], 20), loaded)
    assert train_state["step"] == 20 and train_state["identity"]["vocab_size"] == final.vocab_size
    assert loaded.state_dict().keys() == final.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), final.state_dict().values()))
    earlier = Transformer(MODEL, final.vocab_size)
    load_model_weights(checkpoint_dir(trained["checkpoints"], 10), earlier)
    assert not torch.equal(earlier.lm_head.weight, final.lm_head.weight)


def test_pruned_and_corrupt_checkpoints_are_skipped_with_a_reason_and_not_recorded(trained, tmp_path, monkeypatch):
    root = copy_checkpoints(trained, tmp_path / "checkpoints")
    target = target_for(trained, tmp_path, every=5, checkpoints=root)
    assert list(plan_evaluations(target).due) == [5, 10, 15, 20]
    shard = next(checkpoint_dir(root, 5).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # a flipped bit
    shard.write_bytes(bytes(data))
    (checkpoint_dir(root, 10) / MARKER).unlink()  # half deleted: rmtree took the marker first
    shutil.rmtree(checkpoint_dir(root, 15))  # pruned between planning and evaluating
    intact = dcp_module._intact

    def pruned_right_after_the_check(path: Path) -> bool:
        ok = intact(path)
        if path.name == "step_0000020":
            shutil.rmtree(path)  # training prunes it after the integrity check, before the weights are read
        return ok

    monkeypatch.setattr(dcp_module, "_intact", pruned_right_after_the_check)
    outcomes = {step: evaluate_checkpoint(target, step) for step in (5, 10, 15, 20)}
    assert not any(o.evaluated for o in outcomes.values())
    assert "incomplete or corrupt" in outcomes[5].reason and "incomplete or corrupt" in outcomes[10].reason
    assert outcomes[15].reason == "no longer on disk: pruned by training before it was evaluated"
    assert outcomes[20].reason == "pruned by training while its weights were being read"
    assert not target.state_file.exists()


def test_a_loading_error_with_every_file_present_is_not_hidden_as_a_skip(trained, tmp_path):
    # A checkpoint whose train_state describes another model, with a marker that matches: a real bug.
    root = copy_checkpoints(trained, tmp_path / "checkpoints")
    path = checkpoint_dir(root, 20)
    state = json.loads((path / "train_state.json").read_text())
    state["identity"]["model"]["d_model"] = 64
    (path / "train_state.json").write_text(json.dumps(state))
    marker = json.loads((path / MARKER).read_text())
    marker["sha256"]["train_state.json"] = sha256_file(path / "train_state.json")
    (path / MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointException) as error:
        evaluate_checkpoint(target_for(trained, tmp_path, every=5, checkpoints=root), 20)
    assert "Size mismatch" in str(error.value.failures)


def test_a_malformed_state_file_line_is_an_error_naming_the_line(tmp_path):
    state = tmp_path / STATE_FILE
    state.write_text(json.dumps({"step": 5, "task": "kiln_heldout", "version": "1", "metrics": {}}) + "\nnot json\n"
                     + json.dumps({"step": 6, "metrics": {}}) + "\n")
    with pytest.raises(InputError, match=f"{state}:2 .*delete that line"):
        read_recorded(state)
    state.write_text(json.dumps({"step": 6, "metrics": {}}) + "\n")  # a row of format 1: no task
    with pytest.raises(InputError, match=f"{state}:1 .*delete that line"):
        read_recorded(state)


def test_target_resolves_the_train_run_and_eval_settings_from_the_config(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)

    def resolved(*overrides: str) -> EvalTarget:
        cfg = load_config("configs/tiny.yaml", [f"work_dir={tmp_path}", *overrides])
        return eval_targets(cfg, stage_keys(cfg))[0]

    base = resolved()
    cfg = load_config("configs/tiny.yaml", [f"work_dir={tmp_path}"])
    keys = stage_keys(cfg)
    store = tmp_path / "store"
    train, anneal = eval_targets(cfg, keys)
    assert (train.stage, anneal.stage, anneal.stage_key) == ("train", "anneal", keys["anneal"])
    assert anneal.eval_key != base.eval_key and anneal.state_dir.parent.name == keys["anneal"]
    assert base.stage_key == keys["train"] and base.every == cfg.train.run.checkpoint_every == 20
    assert base.checkpoint_root() is None  # nothing in the store yet
    Store(store).partial_path("train", keys["train"]).mkdir(parents=True)
    assert base.checkpoint_root() == store / "train" / f".{keys['train']}.partial" / "checkpoints"
    assert base.tokenizer == store / "tokenize" / keys["tokenize"] / "tokenizer.json"
    assert base.state_dir == tmp_path / "continuous_eval" / keys["train"] / base.eval_key
    assert base.evaluate.limit == 10  # tiny.yaml's evaluate.limit
    # `every` picks steps, it does not change scores; `limit` does, so it starts a new series.
    assert resolved("continuous_eval.every=40").eval_key == base.eval_key
    fewer = resolved("continuous_eval.limit=3")
    assert fewer.evaluate.limit == 3 and fewer.eval_key != base.eval_key and fewer.stage_key == base.stage_key
    # (keep_every: tiny's anneal ablation starts from step 20, which the config checks is kept)
    assert resolved("train.run.checkpoint_every=10", "train.run.keep_every=10", "continuous_eval.every=30").every == 30
    with pytest.raises(ConfigError, match=r"every=30 is not a multiple of train.run.checkpoint_every=20"):
        resolved("continuous_eval.every=30")


SCORER = """
import json, sys, time
from pathlib import Path
from kiln.tasks.evals.continuous import EvalTarget, evaluate_checkpoint, plan_evaluations
from kiln.tasks.evals.evaluate import EvaluateConfig
from kiln.tasks.store import Store

root, me, eval_file, tokenizer = Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
target = EvalTarget(stage="train", stage_key="train0", eval_key="eval0", every=5,
                    evaluate=EvaluateConfig(eval_files=[eval_file]), store=Store(root / "store"),
                    tokenizer=tokenizer, state_dir=root / "state")
plan = plan_evaluations(target)
(root / f"planned.{me}").write_text(json.dumps(list(plan.due)))
while len(list(root.glob("planned.*"))) < 2:  # both have planned before either scores: they want the same steps
    time.sleep(0.05)
outcomes = [evaluate_checkpoint(target, step, tasks, plan.versions) for step, tasks in plan.due.items()]
print(json.dumps({o.step: "scored" if o.evaluated else "elsewhere" if o.elsewhere else o.reason for o in outcomes}))
"""


def test_two_scorers_at_once_score_and_record_each_checkpoint_once(trained, tmp_path):
    """Two processes plan the same four due checkpoints, then score them at once: each step is scored by
    one of them (the other finds it recorded once it holds the step's lock), and each row lands once."""
    target = target_for(trained, tmp_path, every=5)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    scorers = [subprocess.Popen([sys.executable, "-c", SCORER, str(tmp_path), str(n), str(trained["eval_file"]),
                                 str(trained["tokenizer"])], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for n in range(2)]
    results = [scorer.communicate(timeout=600) for scorer in scorers]
    assert [s.returncode for s in scorers] == [0, 0], "\n".join(err[-3000:] for _, err in results)
    outcomes = [json.loads(out.splitlines()[-1]) for out, _ in results]
    assert [json.loads((tmp_path / f"planned.{n}").read_text()) for n in range(2)] == [[5, 10, 15, 20]] * 2
    for step in ("5", "10", "15", "20"):
        assert sorted(outcome[step] for outcome in outcomes) == ["elsewhere", "scored"], outcomes
    lines = target.state_file.read_text().splitlines()
    assert sorted((json.loads(line)["step"], json.loads(line)["task"]) for line in lines) == [
        (step, "kiln_heldout") for step in (5, 10, 15, 20)]
    assert not list(target.state_dir.glob("*.lock"))  # every lock released
