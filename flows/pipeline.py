"""The pipeline flow: every pipeline stage in order, as cached Prefect tasks under one MLflow parent run.

The config is resolved once, and every key computed once, per pipeline run. Each stage is one
`stage` task (see `flows.stages`), so a rerun after a failure (from the CLI, a deployment or the
UI's Retry) reuses what is complete and redoes only the failed stage and what follows it. A retry
first marks what its crashed attempt left running (`flows.crashes`).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from kiln.flows.continuous_eval import continuous_eval
from kiln.flows.crashes import reap_crashed
from kiln.flows.environment import apply_run_settings
from kiln.flows.stages import execute
from kiln.tasks.config import default_config_path, load_config
from kiln.tasks.continuous_state import ecg_path, up_to_date
from kiln.tasks.crashes import CRASH_TAGS, OWNER_TAG, process_owner
from kiln.tasks.graph import stage_keys
from kiln.tasks.provenance import provenance
from kiln.tasks.runner import StageOutcome, stages_until
from kiln.tasks.settings import KilnConfig, open_tracker
from kiln.tasks.stages import REGISTRY
from kiln.tasks.tracking import MlflowTracker


def describe(outcome: StageOutcome) -> str:
    numbers = ", ".join(f"{k}={v}" for k, v in outcome.headline.items())
    return f"{outcome.status:>6} {outcome.wall_s:7.1f}s  {numbers}"


def summary_table(outcomes: list[StageOutcome]) -> str:
    """A plain-text table for the terminal: stage, status, time, key numbers."""
    lines = [f"{'stage':<14} {'status':>6} {'time':>8}  key numbers", "-" * 78]
    lines += [f"{o.stage:<14} {describe(o)}" for o in outcomes]
    return "\n".join(lines)


def summary_markdown(outcomes: list[StageOutcome]) -> str:
    lines = ["| stage | status | time (s) | key numbers | key |", "|---|---|---|---|---|"]
    for o in outcomes:
        numbers = ", ".join(f"{k}={v}" for k, v in o.headline.items())
        lines.append(f"| {o.stage} | {o.status} | {o.wall_s:.1f} | {numbers} | `{o.key}` |")
    return "\n".join(lines)


def _parent_run(tracker: MlflowTracker, cfg: KilnConfig, config_path: str | None, overrides: list[str],
                until: str | None) -> str:
    """One MLflow run per Prefect flow run: a retry (the UI's Retry, `retries=`) continues the
    first attempt's run, so both attempts' stages sit under one parent (each stage run tagged with
    its attempt). The run is named by config and hash and carries the resolved config as the latest
    attempt loaded it: a retry after a config fix renames it and logs the fixed config, and every
    attempt's own copy stays under `attempts/<n>/`."""
    flow_run_id = str(flow_run.get_id() or "")
    attempt = max(flow_run.run_count, 1)
    config_hash = hashlib.sha256(json.dumps(cfg.identity(), sort_keys=True, default=str).encode()).hexdigest()[:12]
    name = f"pipeline/{Path(config_path).stem if config_path else 'defaults'}/{config_hash}"
    tags = {"kiln.stage": "pipeline", "kiln.prefect_flow_run_id": flow_run_id or "none"}
    current = {"kiln.config_hash": config_hash, "kiln.config_path": str(config_path), "kiln.attempt": attempt,
               OWNER_TAG: process_owner()}
    parent = tracker.find_run(tags) if flow_run_id else None
    if parent is not None:
        tracker.reopen_run(parent, name=name, clear_tags=CRASH_TAGS)  # a crashed attempt's, if the reaper ended it
        tracker.set_tags(parent, current)
    else:
        parent = tracker.start_run(name, tags={**tags, **current},
                                   params={"config_path": str(config_path), "overrides": overrides, "until": until})
    for folder in ("", f"attempts/{attempt}/"):
        tracker.log_dict(parent, cfg.to_dict(), f"{folder}resolved_config.json")
        tracker.log_dict(parent, provenance(), f"{folder}provenance.json")
    return parent


def _score_checkpoints(cfg: KilnConfig, keys: dict[str, str], config_path: str | None, overrides: list[str]) -> None:
    """The continuous-eval pass a watched run gets on its schedule, once at the end: each kept train and
    anneal checkpoint scored, the ECG drawn (a subflow, so it shows under this run in Prefect). When the
    state files say the pass would change nothing (a cached rerun), no subflow is started. It runs
    outside the continuous-eval deployment's one-run-at-a-time limit, beside a scheduled run perhaps:
    each checkpoint's scoring locks (`tasks.evals.continuous`) keep both from scoring one step twice."""

    if up_to_date(cfg, keys):
        print(f"[ ecg ] every kept checkpoint is scored; ECG {ecg_path(cfg, keys)}", file=sys.stderr, flush=True)
        return
    print("[ ecg ] scoring the kept train and anneal checkpoints...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    summaries = continuous_eval(config_path, overrides)
    scored = {stage: s["recorded"] for stage, s in summaries.items()}
    ecg = next((s["ecg"] for s in summaries.values() if s["ecg"]), None)
    regressions = [f"{stage} {r['task']} {r['metric']} since step {r['since']}"
                   for stage, s in summaries.items() for r in s["open_regressions"]]
    print(f"[ ecg ] steps scored {scored} in {time.perf_counter() - started:.1f}s; ECG {ecg}"
          + (f"; open regressions: {', '.join(regressions)}" if regressions else ""), file=sys.stderr, flush=True)


@flow(name="kiln-pipeline", description="Kiln: raw text to an evaluated, annealed model.")
def pipeline(config_path: str | None = None, overrides: list[str] | None = None,
             until: str | None = None) -> list[dict[str, Any]]:
    config_path = config_path or default_config_path()  # the flow run's folder's kiln.yaml, else Kiln's default
    overrides = list(overrides or [])
    cfg = load_config(config_path, overrides)
    apply_run_settings(cfg)  # a worker's flow-run process gets what the CLI sets
    names = stages_until(until, REGISTRY)
    keys = stage_keys(cfg)
    tracker = open_tracker(cfg)
    parent = _parent_run(tracker, cfg, config_path, overrides, until)
    reap_crashed(tracker)  # what a crash left running: an earlier attempt's stage, another run's
    outcomes: list[StageOutcome] = []
    started = time.perf_counter()
    try:
        for index, name in enumerate(names, 1):
            print(f"[{index:2d}/{len(names)}] {name:<14} running...", file=sys.stderr, flush=True)
            outcome = execute(name, cfg, keys, parent_run_id=parent)
            outcomes.append(outcome)
            print(f"[{index:2d}/{len(names)}] {name:<14} {describe(outcome)}", file=sys.stderr, flush=True)
        if cfg.continuous_eval.after_run and "anneal" in names:
            _score_checkpoints(cfg, keys, config_path, overrides)
    except BaseException:
        tracker.end_run(parent, failed=True)
        raise
    tracker.log_metrics(parent, {"wall_s": time.perf_counter() - started,
                                 "num_stages_cached": sum(o.status == "cached" for o in outcomes)})
    create_markdown_artifact(summary_markdown(outcomes), key="kiln-pipeline-summary", description="Kiln pipeline run")
    tracker.end_run(parent)
    return [o.as_dict() for o in outcomes]
