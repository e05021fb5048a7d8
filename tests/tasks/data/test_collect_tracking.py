"""Free-form licence strings in collect's stats reach a real MLflow store as valid metric names, with the raw keys kept.

Before: collect did all its work, then crashed when a removal reason such as
`licence_not_allowed:BSD-4-Clause-UC (fortune-mod; collected quotations)` became a metric name.
"""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import _validate_metric_name, _validate_param_name

from kiln.tasks.config import load_config
from kiln.tasks.runner import run_stage
from kiln.tasks.stage import Registry
from kiln.tasks.stages import collect as collect_stage
from kiln.tasks.tracking import METRIC_NAMES_ARTIFACT, MlflowTracker, metric_name
from tests.fixtures import toy_stage

REPO = Path(__file__).resolve().parents[3]
FORTUNE = "BSD-4-Clause-UC (fortune-mod; collected quotations)"
UNKNOWN = "Frobnicate (see debian/copyright; section 3) | a/../b"


@settings(max_examples=300, deadline=None, database=None)
@given(st.text(max_size=300), st.text(max_size=300))
def test_any_key_becomes_a_name_mlflow_accepts_and_distinct_keys_stay_distinct(key, other):
    name = metric_name(key)
    _validate_metric_name(name)  # raises MlflowException on a name MLflow refuses
    _validate_param_name(name)
    if key != other:
        assert metric_name(other) != name
    if name == key:  # valid keys are left as they are
        assert len(key) <= 250


def test_valid_keys_are_kept_and_others_renamed_readably():
    assert metric_name("removed.licence_not_allowed:BSD-4-Clause") == "removed.licence_not_allowed:BSD-4-Clause"
    assert metric_name(f"removed.licence_not_allowed:{FORTUNE}").startswith(
        "removed.licence_not_allowed:BSD-4-Clause-UC _fortune-mod_ collected quotations__")


def test_collect_with_debian_licences_logs_to_a_real_mlflow_store(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    records = [
        {"text": "The fortune cookie file is distributed under the original BSD licence.", "license": FORTUNE},
        {"text": "This program is free software; you can redistribute it.", "license": "GPL-2+"},
        {"text": "Permission is hereby granted, free of charge.", "licence": "Expat"},
        {"text": "Nobody knows what this licence is.", "licence": UNKNOWN},
    ]
    source = tmp_path / "debian.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    registry = Registry([collect_stage.STAGE, toy_stage.STAGE])
    cfg = load_config("tests/fixtures/toy.yaml", [
        f"work_dir={tmp_path / 'work'}", f"collect.sources=[{{name: debian, path: {source}, format: jsonl, domain: code}}]",
    ], registry=registry)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker(uri, "kiln-licences", tmp_path / "mlartifacts")

    outcome = run_stage("collect", cfg, tracker=tracker, registry=registry)

    client = MlflowClient(uri)
    run = client.get_run(outcome.mlflow_run_id)
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert metrics["num_kept"] == 2 and metrics["num_removed"] == 2
    assert metrics["removed.licence_not_allowed:BSD-4-Clause-UC"] == 1  # a valid name is kept as it is
    [unknown_name] = [name for name in metrics if name.startswith("removed.licence_unknown")]
    assert metrics[unknown_name] == 1

    artifacts = tmp_path / "artifacts"
    renamed = json.loads(Path(client.download_artifacts(run.info.run_id, METRIC_NAMES_ARTIFACT, str(artifacts))).read_text())
    assert renamed == {unknown_name: f"removed.licence_unknown:{UNKNOWN}"}
    stats = json.loads(Path(client.download_artifacts(run.info.run_id, "stats.json", str(artifacts))).read_text())
    assert stats["removed"] == {"licence_not_allowed:BSD-4-Clause-UC": 1, f"licence_unknown:{UNKNOWN}": 1}
    assert "| debian | GPL-2+ | GPL-2.0-or-later | allowed | 1 |" in (Path(outcome.path) / "compliance.md").read_text()
