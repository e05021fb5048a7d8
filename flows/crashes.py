"""What a crash leaves running, marked as crashed in Prefect and MLflow, with the reason.

A worker or machine that dies outright (SIGKILL, OOM, a lost node) reports nothing. Prefect's
unresponsive-run automation (`flows.alerts`) marks its flow run Crashed after three missed
heartbeats, but the task run of the stage it was running stays Running and its MLflow runs stay
RUNNING forever. `reap_crashed` runs when a worker starts (`kiln worker`), when a Kiln flow
starts (a UI Retry included), and on the server side, with no worker or flow at all: `kiln up`
starts a reaper beside its servers (`kiln reap --every 30s`, `reap_every`), so a crash's leftovers
are marked within a minute of Prefect marking the flow run Crashed. It marks:

- every Prefect task run still Running whose flow run has ended, or that an earlier attempt of the
  flow run now starting left running: Crashed, saying why;
- every MLflow run still RUNNING whose owning process died (`tasks.crashes`), or, for an owner on
  another host, whose flow run has ended or is starting over: FAILED, tagged `kiln.status=crashed`
  with the reason.

A run whose process is alive, or a flow run still running, is never touched. `stale` lists the same
records without changing them (`kiln status`).
"""

from __future__ import annotations

import sys
import time
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    TaskRunFilter,
    TaskRunFilterState,
    TaskRunFilterStateType,
)
from prefect.client.schemas.objects import FlowRun, StateType, TaskRun
from prefect.runtime import flow_run as current_flow_run
from prefect.states import Crashed

from kiln.tasks.crashes import reap_tracked, stale_tracked
from kiln.tasks.tracker import Tracker

ENDED = [StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED]
RUNNING = [StateType.RUNNING]


def reap_crashed(tracker: Tracker | None, *, say: bool = False) -> tuple[int, int]:
    """Mark what crashes left running (see the module doc); `tracker`: the MLflow experiment to look in
    (None: Prefect only). Inside a flow run that is a retry, what its earlier attempts left running
    counts as ended. With `say`, prints each record marked and why. Returns (task runs, tracked runs)
    marked."""
    restarting = str(current_flow_run.get_id()) if current_flow_run.get_id() and current_flow_run.run_count > 1 else None
    with get_client(sync_client=True) as client:
        leftovers = _stale_task_runs(client, restarting)
        for task_run, why in leftovers:
            client.set_task_run_state(task_run.id, Crashed(message=why), force=True)
        tracked = reap_tracked(tracker, _ended(client, restarting)) if tracker is not None else {}
    if leftovers or tracked:
        print(f"kiln: marked {len(leftovers)} task run(s) and {len(tracked)} MLflow run(s) that a crash left running",
              file=sys.stderr, flush=True)
    if say:
        for task_run, why in leftovers:
            print(f"marked Crashed: Prefect task run {task_run.name} ({task_run.id}): {why}", flush=True)
        for run_id, why in tracked.items():
            print(f"marked FAILED: MLflow run {run_id}: {why}", flush=True)
    return len(leftovers), len(tracked)


def stale(tracker: Tracker | None) -> list[str]:
    """A line per record a crash left running that `reap_crashed` would mark, with the reason; nothing is
    changed (`kiln status`)."""
    with get_client(sync_client=True) as client:
        lines = [f"Prefect task run {task_run.name} ({task_run.id}) still Running: {why}"
                 for task_run, why in _stale_task_runs(client, None)]
        if tracker is not None:
            lines += [f"MLflow run {name} ({run_id}) still RUNNING: {why}"
                      for run_id, (name, why) in stale_tracked(tracker, _ended(client, None)).items()]
    return lines


def reap_every(tracker: Tracker | None, seconds: float) -> None:
    """`reap_crashed` every `seconds`, until stopped (SIGTERM, SIGINT): `kiln up`'s reaper. A pass that
    cannot reach a server (restarting, or down) is skipped and said; the next one tries again."""
    while True:
        try:
            reap_crashed(tracker, say=True)
        except Exception as error:  # noqa: BLE001 - whatever a restarting server answers (httpx's, MLflow's,
            # SQL errors): a reconciler outlives its servers' restarts, says why it skipped, and tries again
            print(f"kiln reap: skipped a pass, a server did not answer: {type(error).__name__}: {error}",
                  file=sys.stderr, flush=True)
        time.sleep(seconds)


def _ended(client: SyncPrefectClient, restarting: str | None):
    """`tasks.crashes`' question: which of these flow runs ended, and how."""
    def ended(flow_run_ids: set[str]) -> dict[str, str]:
        runs = _flow_runs(client, flow_run_ids)
        out = {str(run.id): f"its Prefect flow run {run.name} ended {run.state_name}: {_message(run)}"
               for run in runs if run.state_type in ENDED}
        if restarting in flow_run_ids:
            out[restarting] = "an earlier attempt of its Prefect flow run ended without ending it (its process died)"
        return out
    return ended


def _stale_task_runs(client: SyncPrefectClient, restarting: str | None) -> list[tuple[TaskRun, str]]:
    """Task runs still Running whose flow run ended (or is `restarting`), with why they cannot end now."""
    running = TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=RUNNING)))
    leftovers = client.read_task_runs(task_run_filter=running, flow_run_filter=FlowRunFilter(
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=ENDED))))
    if restarting is not None:  # before this attempt starts a task, every running one is an earlier attempt's
        leftovers += client.read_task_runs(task_run_filter=running, flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[UUID(restarting)])))
    flow_runs = {str(run.id): run for run in _flow_runs(client, {str(t.flow_run_id) for t in leftovers if t.flow_run_id})}
    stale = []
    for task_run in leftovers:
        flow_run = flow_runs.get(str(task_run.flow_run_id))
        if flow_run is None:
            continue
        if str(flow_run.id) == restarting:
            why = (f"attempt {task_run.flow_run_run_count} of flow run {flow_run.name} ended while this task "
                   "ran: its process died (the worker or machine was killed or crashed)")
        else:
            why = f"its flow run {flow_run.name} ended {flow_run.state_name} while this task ran: {_message(flow_run)}"
        stale.append((task_run, why))
    return stale


def _flow_runs(client: SyncPrefectClient, ids: set[str]) -> list[FlowRun]:
    """The flow runs of `ids` this API knows (a CLI run's id, from its embedded API, is unknown to a server)."""
    uuids = []
    for value in ids:
        try:
            uuids.append(UUID(value))
        except ValueError:
            continue
    if not uuids:
        return []
    return client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=uuids)))


def _message(run: FlowRun) -> str:
    return (run.state.message if run.state and run.state.message else "no message").strip()
