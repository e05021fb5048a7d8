"""Alerts: Prefect automations that post Kiln's events to a webhook (Slack-compatible JSON), each as a
sentence a person can act on, and the detector that marks a dead worker's flow run Crashed.

Kiln emits Prefect events where something needs a person: a stage that failed
(`kiln.stage.failed`, from the runner), a training rollback or abort after a loss spike or a
non-finite loss (`kiln.train.rollback`, `kiln.train.abort`, from the health monitor), an eval score
whose regression started or cleared (`kiln.eval.regression`, `kiln.eval.regression.cleared`, from
continuous eval: judged against the score's noise, `tasks.evals.ecg`), and a flow run that crashed
(Prefect's own `prefect.flow-run.Crashed`). Each Kiln event carries its sentence in the payload's
`text` (`stage_event_text`, `regression_text`: what happened, in which stage or series, for which
config, with the error or the numbers, and the flow run's link in the Prefect UI), written where
the event is emitted, which knows all of it. `kiln deploy --alert-webhook URL` creates one automation
per event type, all sending through one `CustomWebhookNotificationBlock` whose JSON is
`{"text": ...}`: what Slack, Mattermost and most chat webhooks accept.

A worker or machine that dies outright (SIGKILL, OOM, a lost node) cannot report its run as
Crashed: the run would stay Running forever. Deployment runs send a heartbeat event every
`PREFECT_FLOWS_HEARTBEAT_FREQUENCY` seconds (Prefect's default 180; Kiln's CLI runs send none), so
one more automation, Prefect's zombie-run recipe, marks a run Crashed after three missed
heartbeats (and the Crashed alert follows, where there are alerts). It is bookkeeping, not an
alert: `kiln deploy` creates it with or without a webhook. The window comes from the heartbeat
setting of the process that deploys: set the same value where you deploy and where workers run.
`KILN_MISSED_HEARTBEATS` (default 3, at least 2) in that process changes how many heartbeats may be
missed: 2 detects a dead worker a heartbeat sooner, and crashes a live run whose one heartbeat is late.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import yaml

from kiln.tasks.errors import KilnError
from kiln.tasks.evals.ecg import CLEARED_EVENT, REGRESSION_EVENT, RegressionEvent

ALERTS = {  # automation name -> (event, subject)
    "kiln-stage-failed": ("kiln.stage.failed", "Kiln: a stage failed"),
    "kiln-training-rollback": ("kiln.train.rollback", "Kiln: training rolled back after a loss anomaly"),
    "kiln-training-abort": ("kiln.train.abort", "Kiln: training gave up (too many anomalies)"),
    "kiln-eval-regression": (REGRESSION_EVENT, "Kiln: an eval score regressed"),
    "kiln-eval-regression-cleared": (CLEARED_EVENT, "Kiln: an eval regression cleared"),
    "kiln-flow-run-crashed": ("prefect.flow-run.Crashed", "Kiln: a flow run crashed"),
}
CRASHED = "kiln-flow-run-crashed"
UI_VERSION = "v2"  # the path segment of Prefect's current UI (prefect.server.api.server.UI_VERSION_PATH_SEGMENT)
UNRESPONSIVE = "kiln-crash-unresponsive-runs"
MISSED_HEARTBEATS = 3  # one late heartbeat on a busy machine must not crash a live run
MISSED_SETTING = "KILN_MISSED_HEARTBEATS"  # the deploying process's override of MISSED_HEARTBEATS
BLOCK_NAME = "kiln-alerts"
TEXT = "text"  # the payload field that holds a Kiln event's sentence
# a Kiln event's sentence; an event without one (emitted by hand, or by an older Kiln) shows its raw payload
KILN_BODY = "{{ event.payload.text or (event.event ~ ' on ' ~ event.resource.id ~ ': ' ~ event.payload|string) }}"
_MAX_ERROR = 600  # characters of an error message an alert shows (the stage's log has it whole)
_MAX_OVERRIDES = 200
# every event after which a run legitimately stops sending heartbeats
_RUN_ALIVE_OR_DONE = {"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                      "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed", "prefect.flow-run.Paused",
                      "prefect.flow-run.Suspended"}


def crashed_body(ui_url: str | None) -> str:
    """The crash alert's sentence, rendered by the server from the flow run the event names (Prefect's own
    event carries no Kiln payload); `ui_url`: the Prefect UI the deploying process talks to."""
    link = f" Flow run: {flow_run_page(ui_url, '{{ flow_run.id }}')}" if ui_url else ""
    # a message that ends its own sentence gets no second period
    return ("Flow run {{ flow_run.name }} ({{ flow.name }}{% if flow_run.parameters.config_path %}, config "
            "{{ flow_run.parameters.config_path }}{% endif %}) crashed: "
            "{{ (flow_run.state.message or 'no reason given').strip().rstrip('.') }}." + link)


def flow_run_page(ui_url: str, flow_run_id: str) -> str:
    """A flow run's page in the Prefect UI at `ui_url`: Prefect 3's current UI serves it under /v2 (its own
    navigation links there; the old UI's /runs/... paths are kept for a while but are not where it leads)."""
    return f"{ui_url.rstrip('/')}/{UI_VERSION}/runs/flow-run/{flow_run_id}"


def run_context() -> tuple[str, str | None]:
    """The config the current flow run was given (its path, and its overrides if any) and the run's page
    in the Prefect UI (None outside a flow run, or without a UI address)."""
    from prefect.runtime import flow_run
    from prefect.settings import get_current_settings

    parameters = flow_run.parameters or {}
    config = str(parameters.get("config_path") or "Kiln's defaults")
    overrides = " ".join(parameters.get("overrides") or [])
    if overrides:
        config += f" with {overrides if len(overrides) <= _MAX_OVERRIDES else overrides[:_MAX_OVERRIDES] + '...'}"
    run_id = flow_run.get_id()
    ui_url = get_current_settings().ui_url
    return config, flow_run_page(ui_url, str(run_id)) if run_id and ui_url else None


def _sentence(text: str, url: str | None) -> str:
    """`text` as a sentence, then the flow run's page."""
    return text.rstrip(". ") + "." + (f" Flow run: {url}" if url else "")


def stage_event_text(event: str, payload: Mapping[str, Any], stage: str, key: str) -> str:
    """The alert sentence of a stage's event (a failure, a training rollback or abort), in a flow run."""
    config, url = run_context()
    where = f"Stage {stage} (key {key}) of {config}"
    if event == "kiln.stage.failed":
        error = " ".join(str(payload.get("error")).split())
        what = f"failed: {error if len(error) <= _MAX_ERROR else error[:_MAX_ERROR] + '...'}"
    elif event == "kiln.train.rollback":
        what = (f"rolled training back to step {payload.get('rolled_back_to')} after a {payload.get('kind')} loss "
                f"({payload.get('loss')}) at step {payload.get('step')}; rollback {payload.get('rollback')}.")
    elif event == "kiln.train.abort":
        what = (f"gave up training at step {payload.get('step')}: the loss was still bad ({payload.get('kind')}, "
                f"{payload.get('loss')}) after {payload.get('rollbacks')} rollbacks.")
    else:
        what = f"reported {event}: {dict(payload)}"
    return _sentence(f"{where} {what}", url)


def adjust_command(config: str, from_step: int, changes: list[str], work_dir: str | None = None) -> str:
    """The `kiln adjust` command line that goes on from `from_step` under `changes` (in `work_dir`, if given),
    quoted for a POSIX shell."""
    where = ["--work-dir", shlex.quote(work_dir)] if work_dir else []
    return " ".join(["kiln", "adjust", shlex.quote(config), *where, "--from-step", str(from_step),
                     *(shlex.quote(change) for change in changes)])


def phases_override(phases: list[dict[str, Any]]) -> str:
    """`train.phases=[...]` as one override, in YAML's flow style (as the README writes it)."""
    return "train.phases=" + yaml.safe_dump(phases, default_flow_style=True, sort_keys=False, width=1 << 30).strip()


def regression_text(event: RegressionEvent, stage: str, domain: str | None = None, command: str | None = None) -> str:
    """The alert sentence of a regression that started or cleared in the `stage` series, in a flow run;
    given the training domain the task measures and the `kiln adjust` command that upweights it (see
    `flows.continuous_eval.upweight`), both follow on lines of their own, so the command copies whole."""
    sentence = _regression_sentence(event, stage)
    if domain is None or command is None:
        return sentence
    return (f"{sentence}\nIts training domain is {domain}. To upweight {domain} from step {event.step} on "
            f"(a new train run from that checkpoint; nothing before it is retrained), run:\n{command}")


def _regression_sentence(event: RegressionEvent, stage: str) -> str:
    config, url = run_context()
    score = f"{event.task} {event.metric}"
    if event.kind == "started":
        text = (f"Continuous eval of {config}: {score} regressed at {stage} step {event.step}: {event.current:.4f}, "
                f"worse than its best {event.best:.4f} (step {event.best_step}) by more than its noise "
                f"({event.noise:.4f}).")
    else:
        text = (f"Continuous eval of {config}: {score} recovered at {stage} step {event.step}: {event.current:.4f}, "
                f"within its noise ({event.noise:.4f}) of its best {event.best:.4f} (step {event.best_step}); it "
                f"had regressed since step {event.since}.")
    return _sentence(text, url)


def missed_heartbeats() -> int:
    """How many heartbeats a deployment run may miss: `$KILN_MISSED_HEARTBEATS`, else `MISSED_HEARTBEATS`.
    Fewer than 2 would crash a live run whose next heartbeat is a moment late, so it is refused."""
    value = os.environ.get(MISSED_SETTING, "").strip()
    if not value:
        return MISSED_HEARTBEATS
    if not value.isdigit() or int(value) < 2:
        raise KilnError(f"{MISSED_SETTING}={value!r} is not a whole number of at least 2: set it to how many "
                        f"heartbeats a run may miss before it is marked Crashed (2, 3...), or unset it for "
                        f"{MISSED_HEARTBEATS}")
    return int(value)


def unresponsive_after(heartbeat_s: int | None) -> timedelta | None:
    """How long a deployment run may stay silent before it is declared Crashed (None: heartbeats off)."""
    return None if heartbeat_s is None else timedelta(seconds=missed_heartbeats() * heartbeat_s)


def _delete_automations(names: list[str]) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for name in names:
            for existing in client.read_automations_by_name(name):
                client.delete_automation(existing.id)


def create_crash_detector() -> timedelta | None:
    """Create (or replace) the automation that marks a deployment run Crashed after `missed_heartbeats()`
    missed heartbeats; returns its window (None, and no automation, when heartbeats are off)."""
    from prefect.automations import Automation, EventTrigger, Posture
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.events import ResourceSpecification
    from prefect.settings import get_current_settings

    _delete_automations([UNRESPONSIVE])
    silence = unresponsive_after(get_current_settings().flows.heartbeat_frequency)
    if silence is None:
        return None
    Automation(
        name=UNRESPONSIVE,
        description=f"Kiln: a flow run without a heartbeat for {silence.total_seconds():.0f}s is Crashed "
                    "(its worker or machine died)",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"}, expect=_RUN_ALIVE_OR_DONE,
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1, within=silence),
        # not forced: the server then refuses to turn a final state (Completed, Failed...) into Crashed. A short
        # run's heartbeat event can reach the server after the Completed event the server emitted itself, so
        # the trigger may fire for a run that ended well; a forced change would overwrite its Completed.
        actions=[ChangeFlowRunState(state=StateType.CRASHED, name="Crashed", force=False,
                                    message=f"no heartbeat for {silence.total_seconds():.0f}s: "
                                            "the worker or its machine died")],
    ).create()
    return silence


def create_alerts(webhook_url: str) -> list[str]:
    """Create (or replace) the webhook block and one automation per alert; returns the automations' names."""
    from prefect.automations import Automation, EventTrigger, Posture, SendNotification
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.settings import get_current_settings

    block = CustomWebhookNotificationBlock(name=BLOCK_NAME, url=webhook_url,
                                           json_data={"text": "{{subject}}\n{{body}}"})
    block_id = block.save(BLOCK_NAME, overwrite=True)
    _delete_automations(list(ALERTS))
    ui_url = get_current_settings().ui_url
    for name, (event, subject) in ALERTS.items():
        Automation(
            name=name, description=f"Kiln alert: {subject}",
            trigger=EventTrigger(expect={event}, posture=Posture.Reactive, threshold=1, within=timedelta(0)),
            actions=[SendNotification(block_document_id=block_id, subject=subject,
                                      body=crashed_body(ui_url) if name == CRASHED else KILN_BODY)],
        ).create()
    return list(ALERTS)
