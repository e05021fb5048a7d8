"""The electrocardiogram: each eval task's main score against the training step, and its regressions.

Continuous eval records a row per checkpoint step and task (`tasks.evals.continuous`). Each task
is followed by one score (`suite.primary_metric`: normalised accuracy, exact match, bits per byte),
with what it needs to judge a change against the score's noise: lm-eval's standard error and the
number of items scored.

A score *regresses* when it is worse than the best of the earlier steps by more than that noise:
`sigmas` standard errors of the difference (each score's standard error at its sample size, a
proportion's as lm-eval computes it, never 0), and at least one item of the task; a metric lm-eval
gives no standard error for (bits per byte) must move by `min_change` of its best value. A
regression *starts* at the first step that regresses and *clears* at the first later step that no
longer does (back within the noise of the best, or a new best): two events, however many steps it
lasts. The continuous-eval flow emits each as a Prefect event (`kiln.eval.regression`,
`kiln.eval.regression.cleared`) and the plot marks every one.

The plot also marks where the training run's data changed (`Mark`, from its mixture history): each
data phase's first step and each adjustment point (a `kiln adjust` branch, a batch joining), so a
regression can be read against the change before it. The figure's data (curves, events, marks) is
written beside the image as JSON (`ecg.json`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from kiln.tasks.constants import BATCH_PREFIX
from kiln.tasks.evals.suite import PRIMARY_METRICS, primary_metric

ECG_FILE = "ecg.png"
ECG_DATA_FILE = "ecg.json"  # beside the image: what it draws
REGRESSION_EVENT = "kiln.eval.regression"
CLEARED_EVENT = "kiln.eval.regression.cleared"
STAGE_COLOURS = {"train": "#4477aa", "anneal": "#ee6677"}
PROPORTIONS = frozenset({"acc_norm", "acc", "exact_match"})  # a share of items: binomial noise


@dataclass(frozen=True)
class Score:
    """A task's main score at one step, with its standard error (None: lm-eval reports none) and item count."""

    step: int
    value: float
    stderr: float | None = None
    num_docs: int | None = None


@dataclass(frozen=True)
class Curve:
    task: str
    metric: str
    higher_is_better: bool
    scores: list[Score]  # oldest first

    @property
    def points(self) -> list[tuple[int, float]]:
        return [(score.step, score.value) for score in self.scores]


@dataclass(frozen=True)
class RegressionEvent:
    """A regression that started, or cleared, at `step` (`since`: the step it started at)."""

    kind: Literal["started", "cleared"]
    task: str
    metric: str
    step: int
    current: float
    best: float
    best_step: int
    noise: float  # how much worse than `best` a score had to be to count as a regression
    since: int

    @property
    def event(self) -> str:
        return REGRESSION_EVENT if self.kind == "started" else CLEARED_EVENT

    def payload(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Mark:
    """A vertical line of the ECG at `step` (steps trained before the change): a data phase's start
    (`phase`) or an adjustment point (`adjustment`: the run goes on from there under a new schedule)."""

    step: int
    kind: Literal["phase", "adjustment"]
    label: str


def schedule_marks(mixture_history: Sequence[Sequence[Any]]) -> list[Mark]:
    """The phase starts and adjustment points of a train run, from its mixture history (entries of [steps
    trained before the mixture applied, its summary], as its checkpoints and `metrics.json` keep them):
    a phase is marked where it began inside the steps its schedule trained, an adjustment where the
    schedule changed, naming the new batches it took in."""
    marks: list[Mark] = []
    for i, (start, summary) in enumerate(mixture_history):
        end = mixture_history[i + 1][0] if i + 1 < len(mixture_history) else None
        if i > 0:
            before = {name for name in mixture_history[i - 1][1] if name.startswith(BATCH_PREFIX)}
            joined = sorted({name.split("/")[1] for name in summary if name.startswith(BATCH_PREFIX)} -
                            {name.split("/")[1] for name in before})
            marks.append(Mark(start, "adjustment", f"adjusted at {start}"
                              + (f" + batch {', '.join(joined)}" if joined else "")))
        for phase in summary.get("phases", []):
            begins = phase["first_step"] - 1
            if begins > start and (end is None or begins < end):
                marks.append(Mark(begins, "phase", f"phase {phase['name']}"))
    return marks


def curves(rows: Mapping[tuple[int, str], Mapping[str, Any]]) -> dict[str, Curve]:
    """Each task's main score by step, from continuous-eval rows keyed by (step, task)."""
    scores: dict[str, list[Score]] = {}
    metrics: dict[str, str] = {}
    for (step, task), row in sorted(rows.items()):
        values = row["metrics"]
        metric = metrics.get(task) or primary_metric([key.split("/", 1)[1] for key in values])
        value = values.get(f"{task}/{metric}") if metric else None
        if value is None:
            continue
        metrics[task] = metric
        stderr = values.get(f"{task}/{metric}_stderr")
        num_docs = values.get(f"{task}/num_docs")
        scores.setdefault(task, []).append(Score(step, float(value), None if stderr is None else float(stderr),
                                                 None if num_docs is None else int(num_docs)))
    return {task: Curve(task, metrics[task], PRIMARY_METRICS[metrics[task]], s) for task, s in scores.items()}


def standard_error(metric: str, score: Score) -> float | None:
    """The score's standard error: a proportion's at its sample size (as lm-eval's `acc_stderr`, with the
    share kept half an item away from 0 and 1, where the formula claims certainty), else lm-eval's own."""
    if metric in PROPORTIONS and score.num_docs and score.num_docs > 1:
        n = score.num_docs
        p = min(max(score.value, 0.5 / n), 1 - 0.5 / n)
        return math.sqrt(p * (1 - p) / (n - 1))
    return score.stderr


def noise(metric: str, best: Score, current: Score, sigmas: float, min_change: float) -> float:
    """How much worse than `best` `current` must be to be a regression rather than noise."""
    errors = [standard_error(metric, best), standard_error(metric, current)]
    if None in errors:  # no standard error (bits per byte): the minimum detectable change
        return min_change * abs(best.value)
    bound = sigmas * math.sqrt(sum(e * e for e in errors))
    items = [s.num_docs for s in (best, current) if s.num_docs]
    if metric in PROPORTIONS and items:
        bound = max(bound, 1 / min(items))  # less than one item is no change at all
    return bound


def regression_events(curve: Curve, sigmas: float, min_change: float) -> list[RegressionEvent]:
    """Where a regression of `curve` starts and where it clears, oldest first."""
    sign = 1.0 if curve.higher_is_better else -1.0
    events: list[RegressionEvent] = []
    best: Score | None = None
    since: int | None = None
    for score in curve.scores:
        if best is None:
            best = score
            continue
        bound = noise(curve.metric, best, score, sigmas, min_change)
        regressed = sign * (best.value - score.value) > bound
        if regressed and since is None:
            since = score.step
            events.append(RegressionEvent("started", curve.task, curve.metric, score.step, score.value, best.value,
                                          best.step, bound, since))
        elif not regressed and since is not None:
            events.append(RegressionEvent("cleared", curve.task, curve.metric, score.step, score.value, best.value,
                                          best.step, bound, since))
            since = None
        if sign * score.value > sign * best.value:
            best = score
    return events


def all_events(series: Mapping[str, Curve], sigmas: float | None, min_change: float) -> list[RegressionEvent]:
    """Every task's regression events (none when `sigmas` is None: regressions are off), oldest first."""
    if sigmas is None:
        return []
    found = [event for curve in series.values() for event in regression_events(curve, sigmas, min_change)]
    return sorted(found, key=lambda e: (e.step, e.task))


def trusted_events(events: Iterable[RegressionEvent], trusted: Mapping[str, bool]
                   ) -> tuple[list[RegressionEvent], list[str]]:
    """The events that may alert: those of tasks not judged untrusted (`trusted`: the evaluate stage's verdict
    per task; a task it has not judged, or before it ran, alerts); and the tasks not trusted whose events
    were left out, sorted."""
    kept, left_out = [], set()
    for event in events:
        if trusted.get(event.task, True):
            kept.append(event)
        else:
            left_out.add(event.task)
    return kept, sorted(left_out)


def open_regressions(events: Iterable[RegressionEvent]) -> list[RegressionEvent]:
    """The regressions that started and have not cleared: each task's last event, where it is a start."""
    last: dict[str, RegressionEvent] = {}
    for event in sorted(events, key=lambda e: e.step):
        last[event.task] = event
    return [event for event in last.values() if event.kind == "started"]


def ecg_data(stages: Mapping[str, Mapping[str, Curve]], offsets: Mapping[str, int],
             events: Collection[tuple[str, RegressionEvent]] = (), marks: Sequence[Mark] = ()) -> dict[str, Any]:
    """What the ECG draws, as JSON: each stage's curves (steps shifted by its offset), events and marks."""
    return {"curves": {stage: {task: {"metric": c.metric, "points": [[offsets.get(stage, 0) + s.step, s.value]
                                                                     for s in c.scores]}
                               for task, c in series.items()} for stage, series in stages.items()},
            "events": [{"stage": stage, **e.payload(), "x": offsets.get(stage, 0) + e.step} for stage, e in events],
            "marks": [asdict(m) for m in marks]}


def plot_ecg(stages: Mapping[str, Mapping[str, Curve]], offsets: Mapping[str, int], path: Path,
             events: Collection[tuple[str, RegressionEvent]] = (), categories: Mapping[str, str] | None = None,
             trusted: Mapping[str, bool] | None = None, marks: Sequence[Mark] = ()) -> Path:
    """One panel per task, or, given each task's category, one panel per category with a line per task;
    each stage's curve shifted right by its offset (the anneal stage starts where training ended); each
    regression's start circled, its clearing marked with a triangle. Given `trusted`, a trusted task is
    drawn solid and bold, an untrusted one dashed and faint (its legend entry says so). Each mark (a
    train step) is a vertical line in every panel: dotted for a phase, solid for an adjustment. The
    figure's data goes to `ecg.json` beside it."""
    # matplotlib is imported here: the continuous-eval flow pays for it only when it draws
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tasks = list(dict.fromkeys(task for series in stages.values() for task in series))
    assert tasks, "nothing to draw"
    panels = (list(dict.fromkeys(categories.get(t, "general") for t in tasks)) if categories is not None else tasks)
    members = {panel: [t for t in tasks if (categories.get(t, "general") if categories is not None else t) == panel]
               for panel in panels}
    columns = min(3, len(panels))
    rows = (len(panels) + columns - 1) // columns
    figure = Figure(figsize=(4.2 * columns, 2.9 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    markers = {"started": dict(marker="o", facecolors="none", edgecolors="#aa3377", label="regression"),
               "cleared": dict(marker="^", facecolors="none", edgecolors="#228833", label="cleared")}
    for n, panel in enumerate(panels):
        axes = figure.add_subplot(rows, columns, n + 1)
        metric = ""
        for task in members[panel]:
            trust = None if trusted is None else trusted.get(task)
            style = ({} if trust is None else
                     dict(linewidth=2.0, alpha=1.0) if trust else dict(linewidth=0.9, alpha=0.45, linestyle="--"))
            for stage, series in stages.items():
                curve = series.get(task)
                if curve is None:
                    continue
                metric = f"{curve.metric} {'↑' if curve.higher_is_better else '↓'}"
                offset = offsets.get(stage, 0)
                label = stage if categories is None else f"{task} ({stage}{'' if trust is not False else ', not trusted'})"
                colour = STAGE_COLOURS.get(stage) if categories is None else None
                axes.plot([offset + s.step for s in curve.scores], [s.value for s in curve.scores], marker="o",
                          markersize=3, label=label, color=colour, **{"linewidth": 1.2, **style})
                for kind, mark in markers.items():
                    marked = [(offset + e.step, e.current) for where, e in events
                              if where == stage and e.task == task and e.kind == kind]
                    if marked:
                        axes.scatter(*zip(*marked), s=60, zorder=3, **mark)
        for mark in marks:
            axes.axvline(mark.step, color="#777777" if mark.kind == "phase" else "#cc6600", linewidth=0.9,
                         linestyle=":" if mark.kind == "phase" else "-", zorder=1)
            axes.annotate(mark.label, (mark.step, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=5,
                          va="top", ha="right", color="#555555")
        axes.set_title(panel, fontsize=9)
        axes.set_xlabel("step", fontsize=8)
        axes.set_ylabel(metric if categories is None else "score (each task's main metric)", fontsize=8)
        axes.tick_params(labelsize=7)
        axes.grid(alpha=0.3)
        if n == 0 or categories is not None:
            axes.legend(fontsize=5 if categories is not None else 7)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(tmp, dpi=110)
    data = path.with_name(ECG_DATA_FILE)
    data.write_text(json.dumps(ecg_data(stages, offsets, events, marks), indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path
