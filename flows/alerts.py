"""Alerts: Prefect automations that post Kiln's events to a webhook (Slack-compatible JSON).

Kiln emits Prefect events where something needs a person: a stage that failed
(`kiln.stage.failed`, from the runner), a training rollback or abort after a loss spike or a
non-finite loss (`kiln.train.rollback`, `kiln.train.abort`, from the health monitor), and a flow
run that crashed (Prefect's own `prefect.flow-run.Crashed`, e.g. its worker died). `kiln deploy
--alert-webhook URL` creates one automation per event type, all sending through one
`CustomWebhookNotificationBlock` whose JSON is `{"text": ...}`: what Slack, Mattermost and most
chat webhooks accept.
"""

from __future__ import annotations

from datetime import timedelta

ALERTS = {  # automation name -> (event, subject)
    "kiln-stage-failed": ("kiln.stage.failed", "Kiln: a stage failed"),
    "kiln-training-rollback": ("kiln.train.rollback", "Kiln: training rolled back after a loss anomaly"),
    "kiln-training-abort": ("kiln.train.abort", "Kiln: training gave up (too many anomalies)"),
    "kiln-flow-run-crashed": ("prefect.flow-run.Crashed", "Kiln: a flow run crashed"),
}
BLOCK_NAME = "kiln-alerts"
BODY = "{{ event.event }} on {{ event.resource.id }} at {{ event.occurred }}: {{ event.payload }}"


def create_alerts(webhook_url: str) -> list[str]:
    """Create (or replace) the webhook block and one automation per alert; returns their names."""
    from prefect.automations import Automation, EventTrigger, Posture, SendNotification
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client

    block = CustomWebhookNotificationBlock(name=BLOCK_NAME, url=webhook_url,
                                           json_data={"text": "{{subject}}\n{{body}}"})
    block_id = block.save(BLOCK_NAME, overwrite=True)
    with get_client(sync_client=True) as client:
        for name in ALERTS:
            for existing in client.read_automations_by_name(name):
                client.delete_automation(existing.id)
    for name, (event, subject) in ALERTS.items():
        Automation(
            name=name, description=f"Kiln alert: {subject}",
            trigger=EventTrigger(expect={event}, posture=Posture.Reactive, threshold=1, within=timedelta(0)),
            actions=[SendNotification(block_document_id=block_id, subject=subject, body=BODY)],
        ).create()
    return list(ALERTS)
