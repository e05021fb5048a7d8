"""What a crash leaves running, marked as crashed in Prefect and MLflow, with the reason.

A worker or machine that dies outright (SIGKILL, OOM, a lost node) reports nothing. Prefect's
unresponsive-run automation (`flows.alerts`) marks its flow run Crashed after three missed
heartbeats, but the task run of the stage it was running stays Running and its MLflow runs stay
RUNNING forever. `reap_crashed` runs when a worker starts (`kiln worker`) and when a Kiln flow
starts (a UI Retry included), and marks:

- every Prefect task run still Running whose flow run has ended, or that an earlier attempt of the
  flow run now starting left running: Crashed, saying why;
- every MLflow run still RUNNING whose owning process died (`tasks.crashes`), or, for an owner on
  another host, whose flow run has ended or is starting over: FAILED, tagged `kiln.status=crashed`
  with the reason.

A run whose process is alive, or a flow run still running, is never touched.
"""

from __future__ import annotations

import sys
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
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.runtime import flow_run as current_flow_run
from prefect.states import Crashed

from kiln.tasks.crashes import reap_tracked
from kiln.tasks.tracker import Tracker

ENDED = [StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED]
RUNNING = [StateType.RUNNING]


def reap_crashed(tracker: Tracker | None) -> tuple[int, int]:
    """Mark what crashes left running (see the module doc); `tracker`: the MLflow experiment to look in
    (None: Prefect only). Inside a flow run that is a retry, what its earlier attempts left running
    counts as ended. Returns (task runs, tracked runs) marked."""
    restarting = str(current_flow_run.get_id()) if current_flow_run.get_id() and current_flow_run.run_count > 1 else None
    with get_client(sync_client=True) as client:
        tasks = _reap_task_runs(client, restarting)

        def ended(flow_run_ids: set[str]) -> dict[str, str]:
            runs = _flow_runs(client, flow_run_ids)
            out = {str(run.id): f"its Prefect flow run {run.name} ended {run.state_name}: {_message(run)}"
                   for run in runs if run.state_type in ENDED}
            if restarting in flow_run_ids:
                out[restarting] = "an earlier attempt of its Prefect flow run ended without ending it (its process died)"
            return out

        tracked = reap_tracked(tracker, ended) if tracker is not None else {}
    if tasks or tracked:
        print(f"kiln: marked {tasks} task run(s) and {len(tracked)} MLflow run(s) that a crash left running",
              file=sys.stderr, flush=True)
    return tasks, len(tracked)


def _reap_task_runs(client: SyncPrefectClient, restarting: str | None) -> int:
    running = TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=RUNNING)))
    leftovers = client.read_task_runs(task_run_filter=running, flow_run_filter=FlowRunFilter(
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=ENDED))))
    if restarting is not None:  # before this attempt starts a task, every running one is an earlier attempt's
        leftovers += client.read_task_runs(task_run_filter=running, flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[UUID(restarting)])))
    flow_runs = {str(run.id): run for run in _flow_runs(client, {str(t.flow_run_id) for t in leftovers if t.flow_run_id})}
    marked = 0
    for task_run in leftovers:
        flow_run = flow_runs.get(str(task_run.flow_run_id))
        if flow_run is None:
            continue
        if str(flow_run.id) == restarting:
            why = (f"attempt {task_run.flow_run_run_count} of flow run {flow_run.name} ended while this task "
                   "ran: its process died (the worker or machine was killed or crashed)")
        else:
            why = f"its flow run {flow_run.name} ended {flow_run.state_name} while this task ran: {_message(flow_run)}"
        client.set_task_run_state(task_run.id, Crashed(message=why), force=True)
        marked += 1
    return marked


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
