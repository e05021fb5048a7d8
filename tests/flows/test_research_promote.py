"""`kiln research CONFIG --promote NAME`: the promoted variant's production config (a new file beside
CONFIG) loads with the variant applied to the proxy family, the validate model and train.model; `kiln
plan` plans it and the train stage trains it; `kiln lineage` of that model names the decision. A
variant the decision did not promote is refused, saying its decision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.flows.cli import main
from kiln.tasks.config import load_config
from kiln.tasks.errors import ConfigError
from kiln.tasks.lineage import lineage, render_table
from kiln.tasks.runner import run_stage
from kiln.tasks.scaling.research import promoted_config
from kiln.tasks.store import Store
from tests.fixtures.validate_inputs import KEYS, commit_fit_and_gate, commit_mix

REPO = Path(__file__).resolve().parents[2]
RESEARCH_KEY = "5e5ea4c40001"
DECISION = {"variants": {
    "ln": {"decision": "promote", "reasons": [], "overrides": {"model.norm": "layernorm", "optim.z_loss": 1e-4}},
    "nope": {"decision": "inconclusive", "reasons": ["Holm-corrected p = 0.4 is not below alpha = 0.05"],
             "overrides": {"model.position": "nope"}}}}
SHORT = ["train.run.steps=4", "train.run.checkpoint_every=2", "train.run.eval_batches=1", "train.run.num_threads=1",
         "anneal_ablation.from_step=null"]


@pytest.fixture
def promoted(tmp_path) -> Path:
    config = tmp_path / "study.yaml"
    config.write_text(f"extends: {REPO / 'configs' / 'tiny.yaml'}\nwork_dir: {tmp_path / 'work'}\n")
    decision = tmp_path / "decision.json"
    decision.write_text(json.dumps(DECISION))
    return promoted_config(config, decision, "ln", RESEARCH_KEY, train_model_named=True)


def test_the_promoted_config_applies_the_variant_everywhere_a_model_is_trained(promoted, tmp_path):
    assert promoted == tmp_path / "study.promoted-ln.yaml"
    base, cfg = load_config(tmp_path / "study.yaml"), load_config(promoted)
    for model in (cfg.train.model, cfg.sweep.model, cfg.validate_.model):
        assert model.norm == "layernorm"
    # the rest of each model is the study config's
    assert cfg.train.model.model_dump(exclude={"norm"}) == base.train.model.model_dump(exclude={"norm"})
    assert cfg.sweep.model.model_dump(exclude={"norm"}) == base.sweep.model.model_dump(exclude={"norm"})
    assert cfg.train.optim.z_loss == cfg.sweep.optim.z_loss == 1e-4
    assert cfg.train.promoted_from == f"research/{RESEARCH_KEY}:ln" and base.train.promoted_from is None

    decision = tmp_path / "decision.json"
    with pytest.raises(ConfigError, match=r"--promote nope: its decision is inconclusive \(Holm-corrected p = 0.4"):
        promoted_config(tmp_path / "study.yaml", decision, "nope", RESEARCH_KEY, True)
    with pytest.raises(ConfigError, match="--promote other: no such variant .* variants: ln, nope"):
        promoted_config(tmp_path / "study.yaml", decision, "other", RESEARCH_KEY, True)


def test_a_promoted_model_plans_trains_and_names_its_decision_in_lineage(promoted, tmp_path, capsys):
    assert main(["plan", str(promoted), "--cluster", "h100-1node"]) == 0
    assert "Chosen: dp=" in capsys.readouterr().out

    store = Store(tmp_path / "store")
    commit_mix(store)
    commit_fit_and_gate(store, 0.02)
    run_stage("train", load_config(promoted, SHORT), store=store, keys=KEYS)
    manifest = store.manifest("train", KEYS["train"])
    assert manifest["stats"]["steps_trained"] == 4
    assert manifest["identity"]["train"]["model"]["norm"] == "layernorm"

    links = lineage(store, "train", KEYS["train"])
    assert links[-1].promoted_from == f"research/{RESEARCH_KEY}:ln"
    assert (f"train {KEYS['train']}: model promoted from the research decision research/{RESEARCH_KEY} (variant ln"
            in render_table(links))
