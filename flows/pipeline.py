"""The pipeline flow: every stage flow in order, under one MLflow parent run.

Each stage is a subflow that skips itself when its key is complete in the store, so a rerun
after a failure (from the CLI, a deployment or the UI's Retry) redoes only the failed stage
and what follows it.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.stages import STAGE_FLOWS, tracker_for
from tasks.config import load_config
from tasks.errors import ConfigError
from tasks.graph import STAGE_NAMES
from tasks.provenance import provenance


def stages_until(until: str | None) -> list[str]:
    if until is None:
        return list(STAGE_NAMES)
    if until not in STAGE_NAMES:
        raise ConfigError(f"--until {until!r} is not a stage; stages are: {', '.join(STAGE_NAMES)}")
    return list(STAGE_NAMES[: STAGE_NAMES.index(until) + 1])


def describe(outcome: dict[str, Any]) -> str:
    numbers = ", ".join(f"{k}={v}" for k, v in outcome["headline"].items())
    return f"{outcome['status']:>6} {outcome['wall_s']:7.1f}s  {numbers}"


def summary_table(outcomes: list[dict[str, Any]]) -> str:
    """A plain-text table for the terminal: stage, status, time, key numbers."""
    lines = [f"{'stage':<14} {'status':>6} {'time':>8}  key numbers", "-" * 78]
    lines += [f"{o['stage']:<14} {describe(o)}" for o in outcomes]
    return "\n".join(lines)


def summary_markdown(outcomes: list[dict[str, Any]]) -> str:
    lines = ["| stage | status | time (s) | key numbers | key |", "|---|---|---|---|---|"]
    for o in outcomes:
        numbers = ", ".join(f"{k}={v}" for k, v in o["headline"].items())
        lines.append(f"| {o['stage']} | {o['status']} | {o['wall_s']:.1f} | {numbers} | `{o['key']}` |")
    return "\n".join(lines)


@flow(name="kiln-pipeline", description="Kiln: raw text to an evaluated, annealed model.")
def pipeline(config_path: str | None = "configs/default.yaml", overrides: list[str] | None = None,
             until: str | None = None) -> list[dict[str, Any]]:
    overrides = list(overrides or [])
    cfg = load_config(config_path, overrides)
    names = stages_until(until)
    tracker = tracker_for(cfg)
    config = cfg.to_dict()
    config_hash = hashlib.sha256(json.dumps(cfg.identity(), sort_keys=True, default=str).encode()).hexdigest()[:12]
    parent = tracker.start_run("pipeline", tags={"kiln.stage": "pipeline", "kiln.config_hash": config_hash,
                                                 "kiln.config_path": str(config_path)},
                               params={"config_path": str(config_path), "overrides": overrides, "until": until})
    tracker.log_dict(parent, config, "resolved_config.json")
    tracker.log_dict(parent, provenance(), "provenance.json")
    outcomes: list[dict[str, Any]] = []
    started = time.perf_counter()
    try:
        for index, name in enumerate(names, 1):
            print(f"[{index:2d}/{len(names)}] {name:<14} running...", file=sys.stderr, flush=True)
            outcome = STAGE_FLOWS[name](config_path, overrides, parent_run_id=parent)
            outcomes.append(outcome)
            print(f"[{index:2d}/{len(names)}] {name:<14} {describe(outcome)}", file=sys.stderr, flush=True)
    except BaseException:
        tracker.end_run(parent, failed=True)
        raise
    tracker.log_metrics(parent, {"wall_s": time.perf_counter() - started,
                                 "num_stages_cached": sum(o["status"] == "cached" for o in outcomes)})
    create_markdown_artifact(summary_markdown(outcomes), key="kiln-pipeline-summary", description="Kiln pipeline run")
    tracker.end_run(parent)
    return outcomes
