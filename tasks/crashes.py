"""Tracked runs that a crash ended: who owns a run, and marking an owner's leftovers failed.

A stage run's process may die without a word (SIGKILL, OOM, a worker or machine lost): its MLflow
run would then stay RUNNING forever. Every run the runner starts (and every pipeline run) is
tagged with its owner (`kiln.owner`: host and pid); `reap_tracked`, called whenever a later run or
worker starts and every 30 s by `kiln up`'s reaper (`kiln reap`), ends as FAILED each RUNNING run
whose owner is a dead process on this host, or, when its owner cannot be checked from here (another
host), whose orchestrator run is known to have ended; it tags the run `kiln.status=crashed` with the reason in `kiln.error`. A live owner's run is
never touched. `stale_tracked` finds the same runs without changing them (`kiln status` lists them).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping

from kiln.tasks.keylock import pid_alive
from kiln.tasks.tracker import Tracker

OWNER_TAG = "kiln.owner"
FLOW_RUN_TAG = "kiln.prefect_flow_run_id"
CRASH_TAGS = ("kiln.status", "kiln.error")  # what `reap_tracked` sets on a run it ends
RUN_NAME_TAG = "mlflow.runName"  # MLflow's own tag: the name its UI shows


def process_owner() -> str:
    """This process as a run's owner: `host:pid`."""
    return f"{socket.gethostname()}:{os.getpid()}"


def owner_alive(owner: str | None) -> bool | None:
    """Whether `owner` (`host:pid`) is a live process: None when it cannot be told from here (another
    host's process, or no owner recorded)."""
    host, _, pid = (owner or "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    return pid_alive(int(pid))


def crash_reason(tags: Mapping[str, str], ended: Mapping[str, str]) -> str | None:
    """Why the RUNNING run with `tags` can no longer end by itself (None: it may be alive). `ended` maps
    the orchestrator runs known to have ended (or to be starting over) to what ended them: it decides
    for runs whose owner cannot be checked from this host."""
    owner = tags.get(OWNER_TAG)
    alive = owner_alive(owner)
    if alive is False:
        host, _, pid = owner.rpartition(":")
        return f"its process (pid {pid} on {host}) died without ending it: the worker or machine was killed or crashed"
    if alive is None and tags.get(FLOW_RUN_TAG) in ended:
        return ended[tags[FLOW_RUN_TAG]]
    return None


def stale_tracked(tracker: Tracker, ended: Callable[[set[str]], Mapping[str, str]] | None = None
                  ) -> dict[str, tuple[str, str]]:
    """Every RUNNING tracked run that `crash_reason` finds dead: {run id: (run name, reason)}, unchanged.
    `ended(flow_run_ids)` says which of the orchestrator runs named by runs whose owner cannot be
    checked here have ended, and how (see `crash_reason`); without it only owners on this host count."""
    runs = tracker.running_runs()
    unchecked = {tags[FLOW_RUN_TAG] for _, tags in runs
                 if owner_alive(tags.get(OWNER_TAG)) is None and tags.get(FLOW_RUN_TAG, "none") != "none"}
    known = ended(unchecked) if ended is not None and unchecked else {}
    stale = {}
    for run_id, tags in runs:
        reason = crash_reason(tags, known)
        if reason is not None:
            stale[run_id] = (tags.get(RUN_NAME_TAG, run_id), reason)
    return stale


def reap_tracked(tracker: Tracker, ended: Callable[[set[str]], Mapping[str, str]] | None = None) -> dict[str, str]:
    """End as FAILED every RUNNING tracked run that `stale_tracked` finds dead, tagged `kiln.status=crashed`
    with the reason in `kiln.error`; returns {run id: reason}."""
    reaped = {}
    for run_id, (_, reason) in stale_tracked(tracker, ended).items():
        tracker.set_tags(run_id, dict(zip(CRASH_TAGS, ("crashed", reason))))
        tracker.end_run(run_id, failed=True)
        reaped[run_id] = reason
    return reaped
