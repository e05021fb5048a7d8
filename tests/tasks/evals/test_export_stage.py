"""The export stage through the plain runner, on a store of committed upstream outputs: the folder
transformers loads, and a model card whose lineage, mixtures, scores and licences come from the manifests."""

from __future__ import annotations

import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from kiln.tasks.config import load_config  # noqa: E402
from kiln.tasks.runner import run_stage  # noqa: E402
from kiln.tasks.stages import REGISTRY  # noqa: E402
from kiln.tasks.stages.export import HF_DIR  # noqa: E402
from tests.fixtures.export_store import ANNEAL_MIXTURE, KEYS, REPO, build_store  # noqa: E402


@pytest.fixture
def exported(tmp_path):
    cfg = load_config(str(REPO / "configs/tiny.yaml"), [f"work_dir={tmp_path}", "export.dtype=bfloat16"])
    store, model = build_store(cfg.store_root)
    outcome = run_stage("export", cfg, store=store, keys={**KEYS, "export": "e4907700007"})
    return outcome, model


def test_export_runs_after_evaluate_in_the_pipeline():
    pipeline = REGISTRY.pipeline()
    assert pipeline.index("export") == pipeline.index("evaluate") + 1
    assert set(REGISTRY["export"].inputs) == {"anneal", "tokenize", "evaluate", "collect"}


def test_export_stage_writes_a_loadable_folder_and_a_card_from_the_manifests(exported):
    import transformers

    outcome, model = exported
    assert outcome.status == "ran" and outcome.headline["architecture"] == "LlamaForCausalLM"
    folder = os.path.join(outcome.path, HF_DIR)
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "generation_config.json", "model.safetensors",
                                          "tokenizer.json", "tokenizer_config.json"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert hf.dtype == torch.bfloat16  # export.dtype reached the weights and the config
    # exactly: the export casts the same fp32 weights to bf16 (one correctly rounded cast, the same on any CPU)
    assert torch.equal(hf.model.embed_tokens.weight, model.tok_emb.weight.to(torch.bfloat16))
    assert transformers.AutoTokenizer.from_pretrained(folder).eos_token == "<|endoftext|>"

    card = open(os.path.join(folder, "README.md"), encoding="utf-8").read()
    for stage, key in KEYS.items():  # every stage it was made from, and the evaluation, by key
        assert f"| {stage} | `{key}` |" in card
    assert f"# kiln-{KEYS['anneal']}" in card
    assert "| kiln_heldout | bits_per_byte | 3.6 |" in card  # the annealed model's score, not the trained one's
    assert "3.625" not in card
    assert "| code | 0.5 | 0.16 |" in card  # the training mixture, and the annealing one
    assert all(f"| {domain} | {weight:.4g} |" in card for domain, weight in ANNEAL_MIXTURE.items()
               if not isinstance(weight, dict))
    assert "| best: the top 20% of web, prose by quality score | 0.2 |" in card
    assert "| prose-coreutils-man | prose | 15 | GPL-3.0-or-later |" in card
    assert "All licences in the training data: GPL-3.0-or-later, PSF-2.0." in card  # refused licences are not listed
