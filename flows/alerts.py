"""Alerts: Prefect automations that post Kiln's events to a webhook (Slack-compatible JSON).

Kiln emits Prefect events where something needs a person: a stage that failed
(`kiln.stage.failed`, from the runner), a training rollback or abort after a loss spike or a
non-finite loss (`kiln.train.rollback`, `kiln.train.abort`, from the health monitor), an eval score
that fell beyond `continuous_eval.regression_tolerance` (`kiln.eval.regression`, from continuous
eval), and a flow run that crashed (Prefect's own `prefect.flow-run.Crashed`). `kiln deploy
--alert-webhook URL` creates one automation per event type, all sending through one
`CustomWebhookNotificationBlock` whose JSON is `{"text": ...}`: what Slack, Mattermost and most
chat webhooks accept.

A worker or machine that dies outright (SIGKILL, OOM, a lost node) cannot report its run as
Crashed: the run would stay Running forever. Deployment runs send a heartbeat event every
`PREFECT_FLOWS_HEARTBEAT_FREQUENCY` seconds (Prefect's default 180; Kiln's CLI runs send none), so
one more automation, Prefect's zombie-run recipe, marks a run Crashed after three missed
heartbeats, and the Crashed alert follows. The window comes from the heartbeat setting of the
process that deploys: set the same value where you deploy and where workers run.
"""

from __future__ import annotations

from datetime import timedelta

from tasks.evals.ecg import REGRESSION_EVENT

ALERTS = {  # automation name -> (event, subject)
    "kiln-stage-failed": ("kiln.stage.failed", "Kiln: a stage failed"),
    "kiln-training-rollback": ("kiln.train.rollback", "Kiln: training rolled back after a loss anomaly"),
    "kiln-training-abort": ("kiln.train.abort", "Kiln: training gave up (too many anomalies)"),
    "kiln-eval-regression": (REGRESSION_EVENT, "Kiln: an eval score regressed"),
    "kiln-flow-run-crashed": ("prefect.flow-run.Crashed", "Kiln: a flow run crashed"),
}
UNRESPONSIVE = "kiln-crash-unresponsive-runs"
MISSED_HEARTBEATS = 3  # one late heartbeat on a busy machine must not crash a live run
BLOCK_NAME = "kiln-alerts"
BODY = "{{ event.event }} on {{ event.resource.id }} at {{ event.occurred }}: {{ event.payload }}"
# every event after which a run legitimately stops sending heartbeats
_RUN_ALIVE_OR_DONE = {"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                      "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed", "prefect.flow-run.Paused",
                      "prefect.flow-run.Suspended"}


def unresponsive_after(heartbeat_s: int | None) -> timedelta | None:
    """How long a deployment run may stay silent before it is declared Crashed (None: heartbeats off)."""
    return None if heartbeat_s is None else timedelta(seconds=MISSED_HEARTBEATS * heartbeat_s)


def create_alerts(webhook_url: str) -> list[str]:
    """Create (or replace) the webhook block, one automation per alert and the unresponsive-run
    detector; returns the automations' names."""
    from prefect.automations import Automation, EventTrigger, Posture, SendNotification
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.events import ResourceSpecification
    from prefect.settings import get_current_settings

    block = CustomWebhookNotificationBlock(name=BLOCK_NAME, url=webhook_url,
                                           json_data={"text": "{{subject}}\n{{body}}"})
    block_id = block.save(BLOCK_NAME, overwrite=True)
    with get_client(sync_client=True) as client:
        for name in [*ALERTS, UNRESPONSIVE]:
            for existing in client.read_automations_by_name(name):
                client.delete_automation(existing.id)
    for name, (event, subject) in ALERTS.items():
        Automation(
            name=name, description=f"Kiln alert: {subject}",
            trigger=EventTrigger(expect={event}, posture=Posture.Reactive, threshold=1, within=timedelta(0)),
            actions=[SendNotification(block_document_id=block_id, subject=subject, body=BODY)],
        ).create()
    created = list(ALERTS)
    silence = unresponsive_after(get_current_settings().flows.heartbeat_frequency)
    if silence is not None:
        Automation(
            name=UNRESPONSIVE,
            description=f"Kiln: a flow run without a heartbeat for {silence.total_seconds():.0f}s is Crashed "
                        "(its worker or machine died)",
            trigger=EventTrigger(
                after={"prefect.flow-run.heartbeat"}, expect=_RUN_ALIVE_OR_DONE,
                match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
                for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1, within=silence),
            actions=[ChangeFlowRunState(state=StateType.CRASHED, name="Crashed", force=True,
                                        message=f"no heartbeat for {silence.total_seconds():.0f}s: "
                                                "the worker or its machine died")],
        ).create()
        created.append(UNRESPONSIVE)
    return created
