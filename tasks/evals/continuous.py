"""Continuous evaluation (the "electrocardiogram"): benchmark scores of training checkpoints against
their step, while training runs.

The train and anneal stages write DCP checkpoints to `checkpoints/step_{step:07d}/` in their output
folder, which the store reports as the key's `live_path` (the partial folder while the stage runs,
its final folder once committed); training prunes old ones. This module finds the committed
checkpoints at multiples of `every` that are not evaluated yet, loads only their model weights into
a plain `Transformer`, scores them with the evaluate stage's lm-eval path, and records one row per
checkpoint step, task and task version in a state file beside the data,
`{work_dir}/continuous_eval/{stage key}/{eval key}/evaluated.jsonl`. The state file, not Prefect or
MLflow, decides what is done, so a step is evaluated once however often the schedule fires. A
checkpoint that is pruned or corrupt before or while it is read is skipped with the reason and not
recorded: the next run tries it again if it is still there.

Evaluations are deduplicated by (checkpoint, task, task version): adding a task scores only that
task on the checkpoints already evaluated, and a task whose version changes (its eval file, its
settings, or lm-eval's own version of it) is scored again. The eval key hashes only the item limit,
which changes every score, so changing it starts a new series instead of mixing two in one curve.

Several scorers may look at one series at once: the scheduled flow, the pipeline's end-of-run pass
and `kiln continuous-eval` all score through `evaluate_checkpoint`, which holds one lock per
(series, step, task, task version) while it scores (`tasks.keylock`: across processes and hosts,
a dead holder's lock broken) and looks at the state file again once it holds them, so a score
another scorer recorded meanwhile is not computed twice. The state file is rewritten under a lock
of its own, and the flow mirrors a series into MLflow under a third (`series_lock`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from kiln.tasks.configbase import Section, runtime_field
from kiln.tasks.errors import InputError
from kiln.tasks.evals.evaluate import RESULTS_FILE, EvaluateConfig, evaluate_model, suite_tasks
from kiln.tasks.evals.suite import online_task_versions, primary_metric
from kiln.tasks.keylock import KeyLock
from kiln.tasks.library_output import LIBRARY_LOG
from kiln.tasks.store import Store, stage_key
from kiln.tasks.train.checkpoint import MARKER, checkpoint_dir, sha256_file, steps_on_disk
from kiln.tasks.train.config import ModelConfig

log = logging.getLogger(__name__)

STATE_FILE = "evaluated.jsonl"
CHECKPOINTS_DIR = "checkpoints"  # where the training loop writes them, inside the stage's output folder
FORMAT_VERSION = 3  # 2: one row per step, task and task version; 3: a limit samples a grouped task by group
LOCK_SUFFIX = ".lock"
_UNITS = {"s": 1, "m": 60, "h": 3600}


def seconds(value: Any) -> Any:
    """A duration in seconds: a number, or a number with a unit as `--every` takes it ("90s", "10m", "1h")."""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", value)
        if match is None:
            raise ValueError(f"{value!r} is not a duration: give seconds (60), or a number and s, m or h (90s, 10m, 1h)")
        return round(float(match.group(1)) * _UNITS[match.group(2) or "s"])
    return value


Seconds = Annotated[int, BeforeValidator(seconds)]


class ContinuousEvalConfig(Section):
    """Which training checkpoints (train and anneal) continuous eval scores, how cheaply, how often the
    schedule looks, and what counts as a regression.

    No stage reads this section, so it is in no stage key; `limit` (which changes the scores) goes
    into the eval key of the state folder; the other fields change no score and are runtime.
    """

    # Evaluate the train checkpoints at multiples of this step; a multiple of train.run.checkpoint_every
    # (checked when the config loads). None: every checkpoint the train stage writes. The anneal stage's
    # checkpoints (anneal.checkpoint_every) are all evaluated.
    every: int | None = runtime_field(None, gt=0)
    # How often the continuous-eval deployment's schedule runs (`kiln deploy --continuous-eval CONFIG`;
    # `--every 60s` sets it too): seconds, or "90s", "10m", "1h". A run that finds nothing new does nothing;
    # once train and anneal are complete and every checkpoint they kept is scored, the schedule pauses itself.
    interval: Seconds = runtime_field(600, gt=0)
    # `kiln run` ends with a continuous-eval pass over the checkpoints still on disk, so even a run
    # nobody watched leaves its ECG (set train.run.keep_every / anneal.keep_every to keep them all).
    after_run: bool = runtime_field(True)
    # Documents per eval task, to keep scoring cheap beside training; None: evaluate.limit.
    limit: int | None = Field(None, gt=0)
    # The levels of the suite's tasks scored on checkpoints (those of evaluate.suite.levels among them):
    # proxy and mid are likelihood scores, a batch of forward passes per item; production tasks generate
    # (a forward pass per token) and execute, and are left to the evaluate stage. Which tasks are scored
    # changes no score, so it is not in the eval key.
    levels: list[Literal["proxy", "mid", "production"]] = runtime_field(["proxy", "mid"])
    # A task's main score (normalised accuracy, exact match, bits per byte) regresses when it is worse than
    # its best so far by more than this many standard errors of the difference (lm-eval's, at the number of
    # items scored; never less than one item); the Prefect event `kiln.eval.regression` marks where it
    # starts and `kiln.eval.regression.cleared` where it clears. None: no regressions are judged.
    regression_sigmas: float | None = runtime_field(2.0, gt=0)
    # The smallest change judged real for a score lm-eval gives no standard error for (bits per byte), as a
    # fraction of its best value: 0.05 flags 3.06 -> 3.22 bits per byte, not 3.06 -> 3.10.
    min_change: float = runtime_field(0.05, ge=0)


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
    """One look at the disk: what to evaluate now, what is recorded, due steps that are gone."""

    due: dict[int, list[str]]  # step -> the tasks whose current version it has not been scored on
    recorded: dict[tuple[int, str], dict[str, Any]]  # (step, task) -> its row in the state file
    versions: dict[str, str]  # the configured suite: task -> current version
    # multiples of `every` below the newest checkpoint that are neither on disk nor recorded:
    # pruned before any run evaluated them (or never written, e.g. before a resume)
    missed: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class CheckpointOutcome:
    """What happened to one due checkpoint: scored (`metrics`), skipped (`reason`), or scored meanwhile by
    another scorer (`elsewhere`: nothing left to do)."""

    step: int
    evaluated: bool
    metrics: dict[str, float] = field(default_factory=dict)
    reason: str | None = None
    wall_s: float = 0.0
    tasks: tuple[str, ...] = ()  # the tasks scored (or meant to be)
    elsewhere: bool = False


def eval_target(ce: ContinuousEvalConfig, evaluate: EvaluateConfig, *, stage: str, key: str,
                checkpoint_every: int, store: Store, tokenizer: Path, work_dir: Path) -> EvalTarget:
    """The target for the checkpoints of `stage` at `key`, scored with the settings of `evaluate`
    (`continuous_eval.every` is a multiple of `checkpoint_every`: the config checks it when it loads)."""
    every = ce.every or checkpoint_every
    levels = [level for level in evaluate.suite.levels if level in ce.levels]
    evaluate = evaluate.model_copy(update={"limit": ce.limit or evaluate.limit,
                                           "suite": evaluate.suite.model_copy(update={"levels": levels})})
    # The task set and each task's content are in the task versions the rows carry, not in the key.
    eval_key = stage_key("continuous_eval", {"limit": evaluate.limit}, {stage: key}, FORMAT_VERSION)
    return EvalTarget(stage=stage, stage_key=key, eval_key=eval_key, every=every, evaluate=evaluate,
                      store=store, tokenizer=tokenizer, state_dir=work_dir / "continuous_eval" / key / eval_key)


def read_recorded(state_file: Path) -> dict[tuple[int, str], dict[str, Any]]:
    """The rows of the state file by (step, task) (empty when nothing has been evaluated yet)."""
    if not state_file.is_file():
        return {}
    rows: dict[tuple[int, str], dict[str, Any]] = {}
    for line_no, line in enumerate(state_file.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            row = json.loads(line)
            rows[int(row["step"]), str(row["task"])] = row
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise InputError(
                f"{state_file}:{line_no} is not a continuous-eval record "
                "({\"step\": ..., \"task\": ..., \"version\": ..., \"metrics\": ...}): "
                "delete that line and the next run evaluates its checkpoint again"
            ) from None
    return rows


def recorded_steps(recorded: Mapping[tuple[int, str], Any]) -> list[int]:
    return sorted({step for step, _ in recorded})


def _record(target: EvalTarget, step: int, results: dict[str, Any], new_rows: Sequence[dict[str, Any]]) -> None:
    """Merge lm-eval's `results` of `step` into the step's results file and add `new_rows` to the state
    file (replacing a row of the same step and task), under the state file's lock, so that two scorers'
    rows both land. The state file is rewritten whole and renamed into place: a crash leaves the old one."""
    state_file = target.state_file
    with KeyLock(state_file.with_name(state_file.name + LOCK_SUFFIX)):
        _merge_results(target.state_dir / f"step_{step:07d}.{RESULTS_FILE}", results)
        rows = read_recorded(state_file)
        rows.update({(row["step"], row["task"]): row for row in new_rows})
        tmp = state_file.with_name(state_file.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as handle:
            for key in sorted(rows):
                handle.write(json.dumps(rows[key], sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, state_file)


def series_lock(target: EvalTarget) -> KeyLock:
    """The lock under which a scorer mirrors the series into MLflow (finds or starts its run, logs new steps)."""
    return KeyLock(target.state_dir / f"mlflow{LOCK_SUFFIX}")


@contextlib.contextmanager
def _scoring_locks(target: EvalTarget, step: int, versions: Mapping[str, str]) -> Iterator[None]:
    """Hold the lock of (series, step, task, version) for each task of `versions`, taken in name order so
    that two scorers of overlapping task sets cannot each hold what the other waits for."""
    def waiting(owner: dict[str, Any]) -> None:
        log.info("%s step %d is being scored by pid %s on %s: waiting for it", target.stage, step, owner.get("pid"),
                 owner.get("host"))

    names = sorted(re.sub(r"[^A-Za-z0-9_.+-]", "_", f"step_{step:07d}.{task}.{version}") + LOCK_SUFFIX
                   for task, version in versions.items())
    target.state_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as held:
        for name in names:
            held.enter_context(KeyLock(target.state_dir / name, on_wait=waiting))
        yield


def suite_versions(evaluate: EvaluateConfig) -> dict[str, str]:
    """Every configured task and its current version, without evaluating: the local tasks are built in
    a temporary folder (cheap); the versions of lm-eval's own tasks come from its task index."""
    versions = {task.name: task.version for task in suite_tasks(evaluate)}
    online = evaluate.online_tasks()
    if online:
        versions.update(online_task_versions(online))
    return versions


def _steps_in(root: Path) -> list[int]:
    try:
        return steps_on_disk(root)
    except FileNotFoundError:  # the partial folder was committed (renamed) while being listed
        return []


def plan_evaluations(target: EvalTarget, versions: Mapping[str, str] | None = None) -> EvalPlan:
    """The committed-looking checkpoints at multiples of `every`, oldest first, each with the configured
    tasks it has not been scored on at their current version (`versions`: default, the configured suite's)."""
    recorded = read_recorded(target.state_file)
    versions = dict(suite_versions(target.evaluate) if versions is None else versions)
    root = target.checkpoint_root()
    on_disk = set(_steps_in(root)) if root is not None else set()
    due: dict[int, list[str]] = {}
    for step in sorted(s for s in on_disk if s % target.every == 0):
        tasks = [t for t, v in versions.items() if recorded.get((step, t), {}).get("version") != v]
        if tasks:
            due[step] = tasks
    newest = max(on_disk, default=0)
    done = set(recorded_steps(recorded))
    missed = [s for s in range(target.every, newest, target.every) if s not in on_disk and s not in done]
    if due and not target.tokenizer.is_file():
        raise InputError(
            f"the tokenizer {target.tokenizer} does not exist, but the {target.stage} stage it belongs to has checkpoints: "
            "run continuous eval with the config (and overrides) the training was started with"
        )
    return EvalPlan(due=due, recorded=recorded, versions=versions, missed=missed)


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


def evaluate_checkpoint(target: EvalTarget, step: int, tasks: Sequence[str] | None = None,
                        versions: Mapping[str, str] | None = None) -> CheckpointOutcome:
    """Score the checkpoint of `step` on `tasks` (default: the whole configured suite; `versions`: their
    current versions, default the configured suite's) and record one row per task in the state file; or
    skip it with the reason when it is gone, incomplete or corrupt (training prunes checkpoints as it
    goes). Holds the step's scoring locks meanwhile, and scores only what no other scorer recorded
    while this one waited for them."""
    versions = dict(suite_versions(target.evaluate) if versions is None else versions)
    wanted = list(versions) if tasks is None else list(tasks)
    with _scoring_locks(target, step, {task: versions.get(task, "unknown") for task in wanted}):
        recorded = read_recorded(target.state_file)
        todo = [task for task in wanted if recorded.get((step, task), {}).get("version") != versions.get(task)]
        if not todo:
            return CheckpointOutcome(step, False, reason="scored meanwhile by another run", tasks=tuple(wanted),
                                     elsewhere=True)
        return _score(target, step, todo)


def _score(target: EvalTarget, step: int, tasks: Sequence[str]) -> CheckpointOutcome:
    # Imported here: torch.distributed.checkpoint takes a second to import and the config loads this module.
    from torch.distributed.checkpoint.api import CheckpointException

    from kiln.tasks.train.dcp import checkpoint_model, load_model_weights, read_train_state  # defers torch
    from kiln.tasks.train.model import Transformer, save_model  # torch: only where a checkpoint is scored; defers torch

    started = time.perf_counter()

    def skipped(reason: str) -> CheckpointOutcome:
        return CheckpointOutcome(step, False, reason=reason, wall_s=time.perf_counter() - started, tasks=tuple(tasks))

    path = _locate(target, step)
    if path is None:
        return skipped("no longer on disk: pruned by training before it was evaluated")
    try:
        state = read_train_state(path)
        model_cfg, vocab_size = ModelConfig.model_validate(checkpoint_model(state)), int(state["identity"]["vocab_size"])
        model = Transformer(model_cfg, vocab_size)
        load_model_weights(path, model)
        marker_sha256 = sha256_file(path / MARKER)
    except (FileNotFoundError, json.JSONDecodeError, InputError) as error:
        return skipped(f"incomplete, corrupt or pruned while being checked: {error}")
    except CheckpointException:
        if _still_complete(path):
            raise  # the files are all there: a real loading error, not a pruned checkpoint
        return skipped("pruned by training while its weights were being read")

    # evaluate_model scores a saved model folder; the copy lives only as long as the evaluation
    with tempfile.TemporaryDirectory(prefix=f".step_{step:07d}.", dir=target.state_dir) as tmp:
        model_dir, out_dir = Path(tmp) / "model", Path(tmp) / "eval"
        save_model(model, model_cfg, vocab_size, model_dir)
        out_dir.mkdir()
        metrics = evaluate_model(target.evaluate, model_dir, target.tokenizer, out_dir, tasks=tasks,
                                 log_file=target.state_dir / LIBRARY_LOG)  # the series' log, every step's
        results = json.loads((out_dir / RESULTS_FILE).read_text(encoding="utf-8"))
    wall_s = time.perf_counter() - started
    evaluated_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    scored = [t for t in results["versions"] if t in tasks]
    # a task this checkpoint cannot be given (a passkey past its context) is recorded as skipped, with why,
    # under the version the plan asks for: the step is done for it, not retried at every pass
    not_built = {t: why for t, why in results.get("kiln_skipped_tasks", {}).items() if t in tasks and t not in scored}
    wanted_versions = suite_versions(target.evaluate) if not_built else {}
    _record(target, step, results, [
        {"step": step, "task": task, "version": str(results["versions"][task]), "wall_s": wall_s,
         "metrics": {k: v for k, v in metrics.items() if k.startswith(f"{task}/")},
         "marker_sha256": marker_sha256, "evaluated_at": evaluated_at}
        for task in scored] + [
        {"step": step, "task": task, "version": wanted_versions.get(task, "unknown"), "wall_s": wall_s, "metrics": {},
         "skipped": why, "marker_sha256": marker_sha256, "evaluated_at": evaluated_at}
        for task, why in not_built.items()])
    return CheckpointOutcome(step, True, metrics=metrics, wall_s=wall_s, tasks=tuple(scored))


def _merge_results(path: Path, results: dict[str, Any]) -> None:
    """lm-eval's results of one step, merged task by task over earlier evaluations of the same step."""
    merged = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    for key, value in results.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key].update(value)
        else:
            merged[key] = value
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(merged, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def current_rows(recorded: Mapping[tuple[int, str], dict[str, Any]],
                 versions: Mapping[str, str]) -> dict[tuple[int, str], dict[str, Any]]:
    """The rows of the configured tasks at their current versions: the curves (older versions' rows
    stay in the state file for steps pruned before they could be scored again)."""
    return {key: row for key, row in recorded.items() if versions.get(key[1]) == row["version"]}


def scores_table(recorded: Mapping[tuple[int, str], dict[str, Any]], versions: Mapping[str, str],
                 outcomes: Sequence[CheckpointOutcome], missed: Sequence[int]) -> list[dict[str, Any]]:
    """One row per step, oldest first: each task's main score (the curve so far) and this run's skips."""

    new = {o.step for o in outcomes if o.evaluated}
    by_step: dict[int, dict[str, Any]] = {}
    for (step, task), row in sorted(current_rows(recorded, versions).items()):
        metric = primary_metric([k.split("/", 1)[1] for k in row["metrics"]])
        entry = by_step.setdefault(step, {"step": step, "status": "evaluated now" if step in new else "recorded"})
        if metric is not None:
            entry[f"{task}/{metric}"] = round(row["metrics"][f"{task}/{metric}"], 4)
    rows = list(by_step.values())
    rows += [{"step": o.step, "status": f"skipped: {o.reason}"} for o in outcomes if not o.evaluated and not o.elsewhere]
    rows += [{"step": s, "status": "missed: pruned before it was evaluated (set train.run.keep_every)"} for s in missed]
    return sorted(rows, key=lambda r: r["step"])
