"""The electrocardiogram: each eval task's main score against the training step, and its regressions.

Continuous eval records a row per checkpoint step and task (`tasks.evals.continuous`). Each task
is followed by one score (`suite.primary_metric`: normalised accuracy, exact match, bits per byte);
a step whose score is worse than the best of the earlier steps by more than the tolerance is a
regression, which the continuous-eval flow emits as the Prefect event `kiln.eval.regression`. The
plot draws one panel per task, the train stage's curve and the anneal stage's after it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tasks.evals.suite import PRIMARY_METRICS, primary_metric

ECG_FILE = "ecg.png"
REGRESSION_EVENT = "kiln.eval.regression"
STAGE_COLOURS = {"train": "#4477aa", "anneal": "#ee6677"}


@dataclass(frozen=True)
class Curve:
    task: str
    metric: str
    higher_is_better: bool
    points: list[tuple[int, float]]  # (step, score), oldest first


@dataclass(frozen=True)
class Regression:
    """A step whose score fell more than `tolerance` below the best of the steps before it."""

    task: str
    metric: str
    step: int
    best: float
    best_step: int
    current: float
    tolerance: float

    def payload(self) -> dict[str, Any]:
        return asdict(self)


def curves(rows: Mapping[tuple[int, str], Mapping[str, Any]]) -> dict[str, Curve]:
    """Each task's main score by step, from continuous-eval rows keyed by (step, task)."""
    points: dict[str, list[tuple[int, float]]] = {}
    metrics: dict[str, str] = {}
    for (step, task), row in sorted(rows.items()):
        metric = metrics.get(task) or primary_metric([key.split("/", 1)[1] for key in row["metrics"]])
        value = row["metrics"].get(f"{task}/{metric}") if metric else None
        if value is None:
            continue
        metrics[task] = metric
        points.setdefault(task, []).append((step, float(value)))
    return {task: Curve(task, metrics[task], PRIMARY_METRICS[metrics[task]], pts) for task, pts in points.items()}


def find_regressions(series: Mapping[str, Curve], new: Collection[tuple[int, str]], tolerance: float) -> list[Regression]:
    """The regressions among the `new` (step, task) scores: worse than the best earlier step by more than `tolerance`."""
    found = []
    for task, curve in series.items():
        sign = 1.0 if curve.higher_is_better else -1.0
        for i, (step, value) in enumerate(curve.points):
            if (step, task) not in new or i == 0:
                continue
            best_step, best = max(curve.points[:i], key=lambda point: sign * point[1])
            if sign * (best - value) > tolerance:
                found.append(Regression(task, curve.metric, step, best, best_step, value, tolerance))
    return sorted(found, key=lambda r: (r.step, r.task))


def plot_ecg(stages: Mapping[str, Mapping[str, Curve]], offsets: Mapping[str, int], path: Path,
             regressions: Collection[tuple[str, str, int]] = ()) -> Path:
    """One panel per task: each stage's curve, shifted right by its offset (the anneal stage starts
    where training ended), each regression `(stage, task, step)` circled."""
    # matplotlib is imported here: the continuous-eval flow pays for it only when it draws
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tasks = list(dict.fromkeys(task for series in stages.values() for task in series))
    assert tasks, "nothing to draw"
    columns = min(3, len(tasks))
    rows = (len(tasks) + columns - 1) // columns
    figure = Figure(figsize=(4.2 * columns, 2.9 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    for n, task in enumerate(tasks):
        axes = figure.add_subplot(rows, columns, n + 1)
        metric = ""
        for stage, series in stages.items():
            curve = series.get(task)
            if curve is None:
                continue
            metric = f"{curve.metric} {'↑' if curve.higher_is_better else '↓'}"
            steps = [offsets.get(stage, 0) + step for step, _ in curve.points]
            values = [value for _, value in curve.points]
            axes.plot(steps, values, marker="o", markersize=3, linewidth=1.2, label=stage,
                      color=STAGE_COLOURS.get(stage))
            marked = [(x, v) for x, (step, v) in zip(steps, curve.points, strict=True) if (stage, task, step) in regressions]
            if marked:
                axes.scatter(*zip(*marked), s=60, facecolors="none", edgecolors="#aa3377", zorder=3,
                             label="regression")
        axes.set_title(task, fontsize=9)
        axes.set_xlabel("step", fontsize=8)
        axes.set_ylabel(metric, fontsize=8)
        axes.tick_params(labelsize=7)
        axes.grid(alpha=0.3)
        if n == 0:
            axes.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(tmp, dpi=110)
    tmp.replace(path)
    return path
