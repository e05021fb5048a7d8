"""From the ECG to an action (issue 33): the ECG marks a train run's phase starts and adjustment points, and
a capability-regression alert names the training domain the task measures and shows the `kiln adjust`
command that upweights it, a command that parses as a valid adjustment."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from kiln.flows.alerts import regression_text
from kiln.flows.cli import _parse_intermixed, _split_args, adjustment, build_parser
from kiln.flows.continuous_eval import mixture_domains, upweight
from kiln.tasks.config import load_config
from kiln.tasks.evals.ecg import ECG_DATA_FILE, Curve, Mark, RegressionEvent, Score, plot_ecg, schedule_marks
from kiln.tasks.graph import stage_keys
from kiln.tasks.train.data_schedule import phase_bounds

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
WEIGHTS = {"web": 0.4, "prose": 0.3, "code": 0.2, "multilingual": 0.1}


def _summary(phases: list[tuple[str, int, int]], weights: dict[str, float] = WEIGHTS) -> dict:
    """A mixture summary as checkpoints keep it (`tasks.train.trainer.mixture_summary`)."""
    return {**{d: {"weight": w, "train": [f"{d}.bin"]} for d, w in weights.items()},
            "phases": [{"name": n, "first_step": a, "last_step": b, "seq_len": 64, "weights": weights, "ordered": []}
                       for n, a, b in phases]}


def test_the_ecg_marks_phase_starts_and_adjustments_and_its_data_holds_them(tmp_path) -> None:
    joined = {**WEIGHTS, "batch/june/prose": 0.1}
    history = [[0, _summary([("main", 1, 32), ("rising-quality", 33, 40)])],
               [20, _summary([("main", 1, 20), ("more-code", 21, 30), ("late", 31, 40)], joined)]]
    marks = schedule_marks(history)
    # the first schedule's rising-quality phase never ran (the run was adjusted at 20); the adjustment took
    # the batch june in; the new schedule's late phase began after step 30
    assert marks == [Mark(20, "adjustment", "adjusted at 20 + batch june"), Mark(30, "phase", "phase late")]
    assert schedule_marks(history[:1]) == [Mark(32, "phase", "phase rising-quality")]

    curve = Curve("kiln_heldout_code", "bits_per_byte", False, [Score(10, 2.0), Score(20, 2.1), Score(30, 2.5)])
    event = RegressionEvent("started", "kiln_heldout_code", "bits_per_byte", 30, 2.5, 2.0, 10, 0.1, 30)
    path = plot_ecg({"train": {"kiln_heldout_code": curve}}, {}, tmp_path / "ecg.png", [("train", event)], marks=marks)
    assert path.read_bytes()[:4] == b"\x89PNG"
    data = json.loads((tmp_path / ECG_DATA_FILE).read_text())
    assert data["marks"] == [{"step": 20, "kind": "adjustment", "label": "adjusted at 20 + batch june"},
                             {"step": 30, "kind": "phase", "label": "phase late"}]
    assert data["curves"]["train"]["kiln_heldout_code"]["points"] == [[10, 2.0], [20, 2.1], [30, 2.5]]
    assert [(e["task"], e["x"]) for e in data["events"]] == [("kiln_heldout_code", 30)]


@pytest.mark.parametrize(("step", "schedule", "expected"), [
    # inside the bundled first phase: it ends at the step, then the upweighted phase to the end
    (20, None, [{"name": "main", "until_step": 20},
                {"name": "more-code", "mixture": {"web": 0.4, "prose": 0.3, "code": 0.4, "multilingual": 0.1}}]),
    # inside the second (quality-ordered) phase: the first as it ran, the second to the step, then the new one
    (36, None, [{"name": "main", "until_step": 32}, {"name": "rising-quality", "order": "quality", "until_step": 36},
                {"name": "more-code", "mixture": {"web": 0.4, "prose": 0.3, "code": 0.4, "multilingual": 0.1}}]),
    # a run without phases: the mix stage's mixture to the step
    (20, "train: {phases: []}", [{"name": "main", "until_step": 20},
                             {"name": "more-code", "mixture": {"web": 0.4, "prose": 0.3, "code": 0.4,
                                                               "multilingual": 0.1}}]),
])
def test_a_regression_alert_names_the_domain_and_a_kiln_adjust_command_that_parses(step, schedule, expected,
                                                                                   tmp_path) -> None:
    config_path = tmp_path / "run.yaml"
    config_path.write_text(f"extends: {TINY}\n{schedule or ''}\n")
    config_path = str(config_path)
    cfg = load_config(config_path)
    run = cfg.train.run
    ran = [(p.name, a, b) for p, (a, b, _) in zip(cfg.train.phases, phase_bounds(cfg.train.phases, run, "phases"))]
    summary = _summary(ran) if ran else {k: v for k, v in _summary([]).items() if k != "phases"}
    history = [[0, summary]]
    event = RegressionEvent("started", "kiln_heldout_code", "bits_per_byte", step, 2.5, 2.0, 10, 0.1, step)
    domains = {"kiln_heldout_code": "code"}
    assert mixture_domains(history) == list(WEIGHTS)
    work_dir = str(tmp_path / "work")
    domain, command = upweight(cfg, config_path, [f"work_dir={work_dir}"], event, "train", history, domains)
    text = regression_text(event, "train", domain, command)
    assert domain == "code" and "Its training domain is code." in text
    assert text.splitlines()[-1] == command  # on a line of its own: it copies whole

    # the command, as a shell splits it, is a `kiln adjust` the CLI parses, with a valid adjusted config
    argv = shlex.split(command)
    assert argv[:2] == ["kiln", "adjust"]
    ns = _parse_intermixed(build_parser(), argv[1:])
    config, changes = _split_args(ns.args)
    assert (config, ns.from_step, ns.work_dir) == (config_path, step, work_dir)
    assert len(changes) == 1 and changes[0].startswith("train.phases=[")
    prefix, adjusted = adjustment(config, changes, ns.from_step, ns.work_dir)
    assert prefix == stage_keys(cfg)["train"]  # the run that regressed
    new = load_config(config, adjusted)
    assert [p.model_dump(exclude_none=True, exclude_defaults=True) for p in new.train.phases] == expected
    bounds = phase_bounds(new.train.phases, new.train.run, "train.phases")  # a schedule the train stage accepts
    assert bounds[-2][1] == step and bounds[-1] == (step + 1, run.steps, run.seq_len)
    assert new.train.branch.from_step == step


def test_no_action_for_a_cleared_regression_an_anneal_or_a_task_without_a_domain() -> None:
    cfg = load_config(TINY)
    history = [[0, _summary([("main", 1, 32), ("rising-quality", 33, 40)])]]
    started = RegressionEvent("started", "kiln_heldout_code", "bits_per_byte", 20, 2.5, 2.0, 10, 0.1, 20)
    cleared = RegressionEvent("cleared", "kiln_heldout_code", "bits_per_byte", 30, 2.0, 2.0, 10, 0.1, 20)
    assert upweight(cfg, TINY, [], cleared, "train", history, {"kiln_heldout_code": "code"}) is None
    assert upweight(cfg, TINY, [], started, "anneal", history, {"kiln_heldout_code": "code"}) is None
    assert upweight(cfg, TINY, [], started, "train", history, {}) is None
    assert "domain" not in regression_text(started, "train")
