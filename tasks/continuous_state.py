"""Where a config's continuous eval stands: its two series (the train stage's checkpoints and the anneal
stage's), whether a pass would change anything, whether the stages it watches are done, and the lines
`kiln status` shows for it. Read from the store and the state files beside the data, without Prefect
or MLflow, so the pipeline, the scheduled flow and `kiln status` agree. It reads the whole config
(train, anneal, evaluate, continuous_eval), so it sits in the stage layer, above the evals work
(`kiln.tasks.evals.continuous`) it drives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kiln.tasks.constants import TOKENIZER_FILE
from kiln.tasks.errors import KilnError
from kiln.tasks.evals.continuous import (
    EvalTarget,
    current_rows,
    eval_target,
    plan_evaluations,
    read_recorded,
    recorded_steps,
    suite_versions,
)
from kiln.tasks.evals.ecg import ECG_FILE, RegressionEvent, all_events, curves, open_regressions, trusted_events
from kiln.tasks.evals.trust import TRUST_FILE
from kiln.tasks.settings import KilnConfig
from kiln.tasks.store import Store
from kiln.tasks.train.anneal import anneal_checkpointing
from kiln.tasks.train.checkpoint import steps_on_disk

WATCHED = ("train", "anneal")  # the stages whose checkpoints continuous eval scores, in curve order


def eval_targets(cfg: KilnConfig, keys: dict[str, str]) -> list[EvalTarget]:
    """One target per training stage of `cfg`, located in the store by its key."""
    store = Store(cfg.store_root)
    tokenizer = store.path("tokenize", keys["tokenize"]) / TOKENIZER_FILE
    anneal_every = anneal_checkpointing(cfg.anneal, cfg.train.run)["checkpoint_every"]
    return [eval_target(cfg.continuous_eval, cfg.evaluate, stage="train", key=keys["train"],
                        checkpoint_every=cfg.train.run.checkpoint_every, store=store, tokenizer=tokenizer,
                        work_dir=Path(cfg.work_dir)),
            # every anneal checkpoint: `continuous_eval.every` thins the train stage's only
            eval_target(cfg.continuous_eval.model_copy(update={"every": None}), cfg.evaluate, stage="anneal",
                        key=keys["anneal"], checkpoint_every=anneal_every, store=store, tokenizer=tokenizer,
                        work_dir=Path(cfg.work_dir))]


def ecg_path(cfg: KilnConfig, keys: dict[str, str]) -> Path:
    """Where the ECG of `cfg`'s training run is drawn."""
    return Path(cfg.work_dir) / "continuous_eval" / keys["train"] / ECG_FILE


def anneal_offset(cfg: KilnConfig, train_target: EvalTarget | None = None) -> int:
    """The train step the anneal continues from (anneal.from_step, else the last): where its curve starts.
    The last is the train stage's newest checkpoint on disk when there is one: under `train.model: plan`
    the plan sets the step count, not `train.run.steps`."""
    if cfg.anneal.from_step is not None:
        return cfg.anneal.from_step
    root = train_target.checkpoint_root() if train_target is not None else None
    on_disk = steps_on_disk(root) if root is not None else []
    return max(on_disk, default=cfg.train.run.steps)


def up_to_date(cfg: KilnConfig, keys: dict[str, str]) -> bool:
    """A pass would change nothing: every checkpoint of both training stages that is due and on disk is
    scored at the current task versions, and the ECG is drawn (steps pruned before anyone scored them
    cannot be scored by a pass either)."""
    if not ecg_path(cfg, keys).is_file():
        return False
    targets = eval_targets(cfg, keys)
    versions = suite_versions(targets[0].evaluate)
    return not any(plan_evaluations(target, versions).due for target in targets)


def watched_complete(cfg: KilnConfig, keys: dict[str, str]) -> bool:
    """Both stages continuous eval watches are committed: they will write no more checkpoints."""
    store = Store(cfg.store_root)
    return all(store.is_complete(stage, keys[stage]) for stage in WATCHED)


@dataclass(frozen=True)
class SeriesStatus:
    """One series as `kiln status` shows it."""

    stage: str
    key: str
    started: bool  # the stage has a partial or a complete folder (its checkpoints can exist)
    scored: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # on disk, due, not scored yet
    missed: list[int] = field(default_factory=list)  # pruned before anyone scored them
    open: list[RegressionEvent] = field(default_factory=list)
    problem: str | None = None  # why the series could not be read


def evaluate_trust(cfg: KilnConfig, keys: dict[str, str]) -> dict[str, bool]:
    """Each task's trust verdict from the evaluate stage's output, once it is committed; {} before (every
    task then alerts: nothing has judged it yet)."""
    path = Store(cfg.store_root).path("evaluate", keys["evaluate"]) / TRUST_FILE
    if not path.is_file():
        return {}
    return {task: bool(verdict["trusted"]) for task, verdict in json.loads(path.read_text(encoding="utf-8")).items()}


def series_status(cfg: KilnConfig, keys: dict[str, str]) -> list[SeriesStatus]:
    """Each series' scored, pending and missed steps and its open regressions (of the tasks not judged
    untrusted: `evaluate_trust`)."""
    targets = eval_targets(cfg, keys)
    trusted = evaluate_trust(cfg, keys)
    try:
        versions = suite_versions(targets[0].evaluate)
    except KilnError as error:  # an eval file moved: say so on the status line
        return [SeriesStatus(t.stage, t.stage_key, t.checkpoint_root() is not None, problem=str(error)) for t in targets]
    found = []
    for target in targets:
        rows = current_rows(read_recorded(target.state_file), versions)
        events, _ = trusted_events(all_events(curves(rows), cfg.continuous_eval.regression_sigmas,
                                              cfg.continuous_eval.min_change), trusted)
        started = target.checkpoint_root() is not None
        try:
            plan = plan_evaluations(target, versions)
        except KilnError as error:
            found.append(SeriesStatus(target.stage, target.stage_key, started, recorded_steps(rows), problem=str(error)))
            continue
        found.append(SeriesStatus(target.stage, target.stage_key, started, recorded_steps(rows), sorted(plan.due),
                                  plan.missed, open_regressions(events)))
    return found


def _steps(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:6])) + (f", ... {steps[-1]}" if len(steps) > 6 else "")
    return f"{len(steps)}" + (f" ({shown})" if steps else "")


def status_lines(cfg: KilnConfig, keys: dict[str, str]) -> list[str]:
    """`kiln status`'s continuous-eval part: the ECG's path, then per series its scored, pending and missed
    steps and its open regressions."""
    path = ecg_path(cfg, keys)
    lines = [f"continuous eval (ECG {path.resolve() if path.is_file() else f'{path.resolve()}: not drawn yet'}):"]
    statuses = series_status(cfg, keys)
    problems = {series.problem for series in statuses}
    if len(problems) == 1 and None not in problems:  # the eval settings themselves: one line says it
        return lines + [f"  cannot be read: {problems.pop()}"]
    for series in statuses:
        head = f"  {series.stage:<7} {series.key}  "
        if series.problem is not None:
            lines.append(f"{head}cannot be read: {series.problem}")
            continue
        if not series.started and not series.scored:
            lines.append(f"{head}the stage has not started: nothing to score")
            continue
        line = f"{head}scored {_steps(series.scored)}, pending {_steps(series.pending)}, missed {_steps(series.missed)}"
        if series.missed:
            keeper = "train.run.keep_every" if series.stage == "train" else f"{series.stage}.keep_every"
            line += f" (pruned before scoring: {keeper} keeps them)"
        regressions = "; ".join(f"{e.task} {e.metric} since step {e.since} ({e.current:.4g} against its best "
                                f"{e.best:.4g} at step {e.best_step})" for e in series.open)
        lines.append(f"{line}; open regressions: {regressions or 'none'}")
    return lines
