"""The loss-curve plot a training run leaves in its output folder, health events marked on it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

LOSS_PLOT = "loss_curve.png"  # the file name every training run leaves it under
EVENT_COLOURS = {"rollback": "#ccbb44", "abort": "#aa3377"}


def plot_loss_curve(
    loss_curve: Sequence[tuple[int, float]],
    val_points: Sequence[tuple[int, float]],
    events: Sequence[dict[str, Any]],
    path: Path,
) -> None:
    """Train loss per step, validation points, and a vertical line at each health event's step."""
    # matplotlib is imported here: importing the training loop should not pay for it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 3.6))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    if loss_curve:
        steps, losses = zip(*loss_curve)
        axes.plot(steps, losses, color="#4477aa", linewidth=1.2, label="train")
    if val_points:
        steps, losses = zip(*val_points)
        axes.scatter(steps, losses, color="#ee6677", zorder=3, label="validation")
    labelled = set()
    for event in events:
        action = event["action"]
        axes.axvline(event["step"], color=EVENT_COLOURS.get(action, "#777777"), linestyle="--", linewidth=1,
                     label=None if action in labelled else action)
        labelled.add(action)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title("Training loss")
    axes.legend(loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=80)
