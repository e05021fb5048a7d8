"""`kiln eval`: lm-eval's own command line, every flag passed through, with `--model kiln` registered."""

from __future__ import annotations

import json
import math
import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

from kiln.flows.cli import main  # noqa: E402
from kiln.tasks.evals.heldout_task import task_name_for, write_heldout_task  # noqa: E402
from tests.fixtures.export_store import KEYS, REPO, build_store  # noqa: E402


@pytest.mark.slow  # lm-eval's CLI in a subprocess: ~13 s
def test_kiln_eval_runs_lm_evals_cli_on_a_kiln_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store, _ = build_store(tmp_path / "store")
    eval_file = REPO / "data" / "evals" / "heldout.jsonl"
    task = write_heldout_task(eval_file, tmp_path / "tasks", task_name_for(eval_file))
    model_args = (f"model_dir={store.path('anneal', KEYS['anneal']) / 'model'},"
                  f"tokenizer={store.path('tokenize', KEYS['tokenize']) / 'tokenizer.json'}")
    assert main(["eval", "--model", "kiln", "--model_args", model_args, "--tasks", task,
                 "--include_path", str(tmp_path / "tasks"), "--limit", "2", "--batch_size", "4",
                 "--output_path", str(tmp_path / "results")]) == 0
    (results_file,) = (tmp_path / "results").rglob("results_*.json")
    scores = json.loads(results_file.read_text())["results"][task]
    assert scores["sample_len"] == 2 and math.isfinite(scores["bits_per_byte,none"])
