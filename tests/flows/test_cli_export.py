"""`kiln export`: a stage output by key, a folder in the store or outside it, to a Hugging Face folder."""

from __future__ import annotations

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

from kiln.flows.cli import main  # noqa: E402
from tests.fixtures.export_store import KEYS, build_store  # noqa: E402

TINY = "configs/tiny.yaml"


@pytest.fixture
def store(in_repo, tmp_path):
    return build_store(tmp_path / "work" / "store")[0]


def card(folder) -> str:
    return (folder / "README.md").read_text(encoding="utf-8")


def test_export_a_stage_key_with_its_lineage_scores_and_tokenizer(store, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", KEYS["anneal"], TINY, f"work_dir={tmp_path / 'work'}", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "LlamaForCausalLM" in printed and f"pretrained={out}" in printed
    assert f"tokenize/{KEYS['tokenize']}/tokenizer.json" in printed  # found through the lineage
    text = card(out)
    assert f"| collect | `{KEYS['collect']}` |" in text and "| kiln_heldout | bits_per_byte | 3.6 |" in text
    assert "evaluate" not in [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")]

    # STAGE/KEY, and the train stage's own model with its own scores
    out = tmp_path / "hf-train"
    assert main(["export", f"train/{KEYS['train']}", TINY, f"work_dir={tmp_path / 'work'}", "--out", str(out)]) == 0
    assert "| kiln_heldout | bits_per_byte | 3.625 |" in card(out) and f"| anneal | `{KEYS['anneal']}`" not in card(out)


def test_export_a_folder_inside_and_outside_the_store(store, tmp_path, capsys):
    model_dir = store.path("anneal", KEYS["anneal"]) / "model"
    out = tmp_path / "inside"
    assert main(["export", str(model_dir), TINY, f"work_dir={tmp_path / 'work'}", "--out", str(out)]) == 0
    assert f"| mix | `{KEYS['mix']}` |" in card(out) and "bits_per_byte | 3.6 |" in card(out)

    outside = tmp_path / "copied-model"
    outside.mkdir()
    for f in model_dir.iterdir():
        (outside / f.name).write_bytes(f.read_bytes())
    tokenizer = store.path("tokenize", KEYS["tokenize"]) / "tokenizer.json"
    out = tmp_path / "outside"
    assert main(["export", str(outside), TINY, f"work_dir={tmp_path / 'work'}", "--out", str(out),
                 "--tokenizer", str(tokenizer), "--dtype", "bfloat16"]) == 0
    assert "no lineage recorded" in card(out) and "No evaluate stage output scores this model." in card(out)
    capsys.readouterr()

    # without --tokenizer, a folder outside the store takes this config's tokenize output: not there
    assert main(["export", str(outside), TINY, f"work_dir={tmp_path / 'work'}", "--out", str(tmp_path / "x")]) == 2
    assert "pass --tokenizer" in capsys.readouterr().err


def test_export_names_what_it_cannot_find(store, tmp_path, capsys):
    assert main(["export", "0123456789ab", TINY, f"work_dir={tmp_path / 'work'}", "--out", str(tmp_path / "x")]) == 2
    assert "no folder, stage name or stage key" in capsys.readouterr().err
    # a stage name means this config's output of it, which this store does not hold
    assert main(["export", "anneal", TINY, f"work_dir={tmp_path / 'work'}", "--out", str(tmp_path / "x")]) == 2
    assert "is not complete" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
