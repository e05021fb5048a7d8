"""Continuous evaluation (the "electrocardiogram"): benchmark scores of training checkpoints against
their step, while training runs.

The train and anneal stages write DCP checkpoints to `checkpoints/step_{step:07d}/` in their output
folder, which the store reports as the key's `live_path` (the partial folder while the stage runs,
its final folder once committed); training prunes old ones. This module finds the committed
checkpoints at multiples of `every` that are not evaluated yet, loads only their model weights into
a plain `Transformer`, scores them with the evaluate stage's lm-eval path, and appends each step's
scores to a state file beside the data,
`{work_dir}/continuous_eval/{stage key}/{eval key}/evaluated.jsonl`. The state file, not Prefect or
MLflow, decides what is done, so a step is evaluated once however often the schedule fires. A
checkpoint that is pruned or corrupt before or while it is read is skipped with the reason and not
recorded: the next run tries it again if it is still there.

The eval key hashes the settings that shape the scores (eval files and their content, extra tasks,
the document limit), so changing them starts a new series instead of mixing two in one curve.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from tasks.configbase import Section, runtime_field
from tasks.errors import ConfigError, InputError
from tasks.evals.evaluate import RESULTS_FILE, EvaluateConfig, evaluate_model
from tasks.fingerprint import fingerprint_paths
from tasks.store import Store, stage_key
from tasks.train.checkpoint import MARKER, checkpoint_dir, sha256_file, steps_on_disk
from tasks.train.config import ModelConfig

STATE_FILE = "evaluated.jsonl"
CHECKPOINTS_DIR = "checkpoints"  # where the training loop writes them, inside the stage's output folder
FORMAT_VERSION = 1


class ContinuousEvalConfig(Section):
    """Which training checkpoints (train and anneal) the scheduled continuous-eval flow scores, and how cheaply.

    No stage reads this section, so it is in no stage key; `limit` (which changes the scores) goes
    into the eval key of the state folder, `every` (which only picks the steps) does not.
    """

    # Evaluate the checkpoints at multiples of this step; a multiple of train.run.checkpoint_every.
    # None: every checkpoint the train stage writes.
    every: int | None = runtime_field(None, gt=0)
    # Documents per eval task, to keep scoring cheap beside training; None: evaluate.limit.
    limit: int | None = Field(None, gt=0)


@dataclass(frozen=True)
class EvalTarget:
    """One training stage's checkpoints, the eval settings and the state folder (see `eval_target`)."""

    stage: str  # "train" or "anneal"
    stage_key: str
    eval_key: str
    every: int
    evaluate: EvaluateConfig  # the evaluate stage's settings with continuous_eval.limit applied
    store: Store
    tokenizer: Path
    state_dir: Path

    @property
    def state_file(self) -> Path:
        return self.state_dir / STATE_FILE

    def checkpoint_root(self) -> Path | None:
        """Where the stage's checkpoints are now (they move when the stage commits), or None before it starts."""
        live = self.store.live_path(self.stage, self.stage_key)
        return live / CHECKPOINTS_DIR if live is not None else None


@dataclass(frozen=True)
class EvalPlan:
    """One look at the disk: steps to evaluate now, steps already recorded, due steps that are gone."""

    due: list[int]
    recorded: dict[int, dict[str, Any]]
    # multiples of `every` below the newest checkpoint that are neither on disk nor recorded:
    # pruned before any run evaluated them (or never written, e.g. before a resume)
    missed: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class CheckpointOutcome:
    """What happened to one due checkpoint: scored (`metrics`) or skipped (`reason`)."""

    step: int
    evaluated: bool
    metrics: dict[str, float] = field(default_factory=dict)
    reason: str | None = None
    wall_s: float = 0.0


def eval_target(ce: ContinuousEvalConfig, evaluate: EvaluateConfig, *, stage: str, key: str,
                checkpoint_every: int, store: Store, tokenizer: Path, work_dir: Path) -> EvalTarget:
    """The target for the checkpoints of `stage` at `key`, scored with the settings of `evaluate`."""
    every = ce.every or checkpoint_every
    if every % checkpoint_every:
        raise ConfigError(
            f"continuous_eval.every={every} is not a multiple of train.run.checkpoint_every={checkpoint_every}: "
            f"training writes checkpoints only at multiples of {checkpoint_every}, so some due steps would never "
            "exist; choose a multiple (or leave continuous_eval.every unset to evaluate every checkpoint)"
        )
    evaluate = evaluate.model_copy(update={"limit": ce.limit or evaluate.limit})
    identity = {"evaluate": evaluate.identity(),
                "eval_files_sha256": fingerprint_paths(Path(p) for p in evaluate.eval_files)}
    eval_key = stage_key("continuous_eval", identity, {stage: key}, FORMAT_VERSION)
    return EvalTarget(stage=stage, stage_key=key, eval_key=eval_key, every=every, evaluate=evaluate,
                      store=store, tokenizer=tokenizer, state_dir=work_dir / "continuous_eval" / key / eval_key)


def read_recorded(state_file: Path) -> dict[int, dict[str, Any]]:
    """The rows of the state file by step (empty when nothing has been evaluated yet)."""
    if not state_file.is_file():
        return {}
    rows: dict[int, dict[str, Any]] = {}
    for line_no, line in enumerate(state_file.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            row = json.loads(line)
            rows[int(row["step"])] = row
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise InputError(
                f"{state_file}:{line_no} is not a continuous-eval record ({{\"step\": ..., \"metrics\": ...}}): "
                "delete that line and the next run evaluates its checkpoint again"
            ) from None
    return rows


def _record(state_file: Path, row: dict[str, Any]) -> None:
    """Add `row` to the state file, rewritten whole and renamed into place: a crash leaves the old file."""
    rows = read_recorded(state_file)
    rows[row["step"]] = row
    tmp = state_file.with_name(state_file.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for step in sorted(rows):
            handle.write(json.dumps(rows[step], sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, state_file)


def _steps_in(root: Path) -> list[int]:
    try:
        return steps_on_disk(root)
    except FileNotFoundError:  # the partial folder was committed (renamed) while being listed
        return []


def plan_evaluations(target: EvalTarget) -> EvalPlan:
    """The committed-looking checkpoints at multiples of `every` not yet in the state file, oldest first."""
    recorded = read_recorded(target.state_file)
    root = target.checkpoint_root()
    on_disk = set(_steps_in(root)) if root is not None else set()
    due = sorted(s for s in on_disk if s % target.every == 0 and s not in recorded)
    newest = max(on_disk, default=0)
    missed = [s for s in range(target.every, newest, target.every) if s not in on_disk and s not in recorded]
    if due and not target.tokenizer.is_file():
        raise InputError(
            f"the tokenizer {target.tokenizer} does not exist, but the {target.stage} stage it belongs to has checkpoints: "
            "run continuous eval with the config (and overrides) the training was started with"
        )
    return EvalPlan(due=due, recorded=recorded, missed=missed)


def _locate(target: EvalTarget, step: int) -> Path | None:
    """The step's checkpoint folder now (it moves when the stage commits), or None when it is gone."""
    root = target.checkpoint_root()
    path = checkpoint_dir(root, step) if root is not None else None
    return path if path is not None and path.is_dir() else None


def _still_complete(path: Path) -> bool:
    """The marker and every file it lists are still on disk (they vanish while training prunes)."""
    try:
        names = json.loads((path / MARKER).read_text())["sha256"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return False
    return all((path / name).is_file() for name in names)


def evaluate_checkpoint(target: EvalTarget, step: int) -> CheckpointOutcome:
    """Score the checkpoint of `step` and record it in the state file, or skip it with the reason
    when it is gone, incomplete or corrupt (training prunes checkpoints as it goes)."""
    # Imported here: torch.distributed.checkpoint takes a second to import and the config loads this module.
    from torch.distributed.checkpoint.api import CheckpointException

    from tasks.train.dcp import load_model_weights, read_train_state
    from tasks.train.model import Transformer, save_model  # torch: only where a checkpoint is scored

    started = time.perf_counter()

    def skipped(reason: str) -> CheckpointOutcome:
        return CheckpointOutcome(step, False, reason=reason, wall_s=time.perf_counter() - started)

    path = _locate(target, step)
    if path is None:
        return skipped("no longer on disk: pruned by training before it was evaluated")
    try:
        identity = read_train_state(path)["identity"]
        model_cfg, vocab_size = ModelConfig.model_validate(identity["model"]), int(identity["vocab_size"])
        model = Transformer(model_cfg, vocab_size)
        load_model_weights(path, model)
        marker_sha256 = sha256_file(path / MARKER)
    except (FileNotFoundError, json.JSONDecodeError, InputError) as error:
        return skipped(f"incomplete, corrupt or pruned while being checked: {error}")
    except CheckpointException:
        if _still_complete(path):
            raise  # the files are all there: a real loading error, not a pruned checkpoint
        return skipped("pruned by training while its weights were being read")

    target.state_dir.mkdir(parents=True, exist_ok=True)
    # evaluate_model scores a saved model folder; the copy lives only as long as the evaluation
    with tempfile.TemporaryDirectory(prefix=f".step_{step:07d}.", dir=target.state_dir) as tmp:
        model_dir, out_dir = Path(tmp) / "model", Path(tmp) / "eval"
        save_model(model, model_cfg, vocab_size, model_dir)
        out_dir.mkdir()
        metrics = evaluate_model(target.evaluate, model_dir, target.tokenizer, out_dir)
        shutil.copyfile(out_dir / RESULTS_FILE, target.state_dir / f"step_{step:07d}.{RESULTS_FILE}")
    wall_s = time.perf_counter() - started
    _record(target.state_file, {"step": step, "metrics": metrics, "wall_s": wall_s, "marker_sha256": marker_sha256,
                                "evaluated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return CheckpointOutcome(step, True, metrics=metrics, wall_s=wall_s)


def scores_table(recorded: Mapping[int, Mapping[str, Any]], outcomes: Sequence[CheckpointOutcome],
                 missed: Sequence[int]) -> list[dict[str, Any]]:
    """One row per step, oldest first: every recorded score (the curve so far) and this run's skips."""
    new = {o.step for o in outcomes if o.evaluated}
    rows: list[dict[str, Any]] = []
    for step, row in recorded.items():
        scores = {k: round(v, 4) for k, v in row["metrics"].items() if k.endswith(("bits_per_byte", "byte_perplexity"))}
        rows.append({"step": step, "status": "evaluated now" if step in new else "recorded", **scores})
    rows += [{"step": o.step, "status": f"skipped: {o.reason}"} for o in outcomes if not o.evaluated]
    rows += [{"step": s, "status": "missed: pruned before it was evaluated (set train.run.keep_every)"} for s in missed]
    return sorted(rows, key=lambda r: r["step"])
