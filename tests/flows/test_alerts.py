"""What an alert says: a sentence per Kiln event (stage, config, error or numbers, the flow run's page in
the Prefect UI), rendered by Prefect's own template engine from the bodies `kiln deploy` gives its
automations. The webhook round trip against a real server and worker is in tests/flows/test_operate.py."""

from __future__ import annotations

from datetime import datetime, timezone
from uuid import uuid4

from prefect.server.events.schemas.events import ReceivedEvent
from prefect.server.schemas.core import Flow, FlowRun
from prefect.server.schemas.states import State, StateType
from prefect.server.utilities.user_templates import render_user_template_sync

from kiln.flows.alerts import KILN_BODY, crashed_body, regression_text, stage_event_text
from kiln.tasks.evals.ecg import RegressionEvent


def event(name: str, payload: dict, resource: str = "kiln.decontaminate.fbcc57f35cde") -> ReceivedEvent:
    return ReceivedEvent(event=name, resource={"prefect.resource.id": resource}, payload=payload, id=uuid4(),
                         occurred=datetime.now(timezone.utc))


def test_a_kiln_event_is_its_sentence_and_an_event_without_one_still_says_what_it_is():
    text = stage_event_text("kiln.stage.failed", {"stage": "decontaminate", "key": "fbcc57f35cde",
                                                  "error": "InputError: eval file evals/mine.jsonl does not\n exist"},
                            "decontaminate", "fbcc57f35cde")
    # outside a flow run there is no config and no page to link to
    assert text == ("Stage decontaminate (key fbcc57f35cde) of Kiln's defaults failed: InputError: eval file "
                    "evals/mine.jsonl does not exist.")
    assert render_user_template_sync(KILN_BODY, {"event": event("kiln.stage.failed", {"text": text})}) == text
    bare = render_user_template_sync(KILN_BODY, {"event": event("kiln.train.rollback", {"step": "17"}, "kiln.train.abc")})
    assert bare == "kiln.train.rollback on kiln.train.abc: {'step': '17'}"


def test_training_and_regression_events_say_what_happened_in_numbers():
    rollback = stage_event_text("kiln.train.rollback", {"step": 17, "kind": "spike", "loss": 9.1, "rolled_back_to": 10,
                                                        "rollback": 1}, "train", "abc123")
    assert rollback == ("Stage train (key abc123) of Kiln's defaults rolled training back to step 10 after a spike "
                        "loss (9.1) at step 17; rollback 1.")
    started = RegressionEvent("started", "kiln_heldout_code", "bits_per_byte", 1200, 3.25, 3.06, 600, 0.153, 1200)
    assert regression_text(started, "train") == (
        "Continuous eval of Kiln's defaults: kiln_heldout_code bits_per_byte regressed at train step 1200: 3.2500, "
        "worse than its best 3.0600 (step 600) by more than its noise (0.1530).")
    cleared = RegressionEvent("cleared", "kiln_heldout_code", "bits_per_byte", 2100, 3.12, 3.06, 600, 0.153, 1200)
    assert regression_text(cleared, "train").endswith("within its noise (0.1530) of its best 3.0600 (step 600); it "
                                                      "had regressed since step 1200.")


def test_a_crashed_run_names_its_flow_config_reason_and_page():
    run_id = uuid4()
    flow = Flow(id=uuid4(), name="kiln-pipeline")
    run = FlowRun(id=run_id, name="brave-fox", flow_id=flow.id, parameters={"config_path": "configs/mine.yaml"},
                  state=State(type=StateType.CRASHED, message="no heartbeat for 90s: the worker or its machine died. "))
    context = {"event": event("prefect.flow-run.Crashed", {}, f"prefect.flow-run.{run_id}"), "flow_run": run,
               "flow": flow}
    assert render_user_template_sync(crashed_body("http://127.0.0.1:4200/"), context) == (
        "Flow run brave-fox (kiln-pipeline, config configs/mine.yaml) crashed: no heartbeat for 90s: the worker or its "
        f"machine died. Flow run: http://127.0.0.1:4200/v2/runs/flow-run/{run_id}")  # one period; Prefect's current UI
    assert render_user_template_sync(crashed_body(None), context).endswith("machine died.")
