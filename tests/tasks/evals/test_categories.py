"""The suite's bundled category tasks scored end to end by lm-eval through Kiln's adapter, offline, on a
real (tiny, untrained) Kiln model: every category and level gives its rows, the generated long-context
tasks fit the model's context, and the production tasks generate, execute and classify."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from kiln.tasks.evals.categories import SuiteConfig, TokenView, build_category_suite, passkey_items
from kiln.tasks.evals.evaluate import RESULTS_FILE, EvaluateConfig, evaluate_model, suite_task_names
from kiln.tasks.train.config import ModelConfig
from kiln.tasks.train.model import build_model, save_model
from tests.fixtures.continuous_eval import write_eval_file, write_tokenizer

ALL = ["reasoning", "coding", "multilingual", "long_context", "safety"]
LANGUAGES = ["en", "de", "fr", "es", "it", "pt", "nl", "ru", "ja", "zh", "cs", "da"]
MODEL = ModelConfig(d_model=16, n_layers=1, n_heads=2, max_seq_len=64)


@pytest.fixture(scope="module")
def scored(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("categories")
    eval_file = write_eval_file(root / "evals" / "heldout.jsonl")
    tokenizer = write_tokenizer(root / "tokenizer.json")
    torch.manual_seed(0)
    save_model(build_model(MODEL, tokenizer.get_vocab_size()), MODEL, tokenizer.get_vocab_size(), root / "model")
    cfg = EvaluateConfig(eval_files=[str(eval_file)], limit=4,
                         suite=SuiteConfig(categories=ALL, passkey={"items_per_length": 2}))
    started = time.perf_counter()
    metrics = evaluate_model(cfg, root / "model", root / "tokenizer.json", root / "out")
    wall = time.perf_counter() - started
    return {"cfg": cfg, "metrics": metrics, "wall": wall, "out": root / "out",
            "results": json.loads((root / "out" / RESULTS_FILE).read_text()), "tokenizer": tokenizer}


def test_every_category_and_level_is_scored(scored):
    tasks = scored["results"]["kiln_tasks"]
    by = {(t["category"], t["level"]) for t in tasks.values()}
    # (the fixture's held-out sentences are too short for the general choice task)
    assert by == {("general", "proxy"), ("reasoning", "proxy"), ("reasoning", "mid"),
                  ("coding", "proxy"), ("coding", "production"), ("multilingual", "proxy"), ("multilingual", "mid"),
                  ("long_context", "proxy"), ("long_context", "mid"), ("long_context", "production"),
                  ("safety", "mid"), ("safety", "production")}
    # One row per language of the bundled multilingual set: bits per byte and a choice task. The limit of 4
    # items per task is below the 12 languages: a grouped task is sampled by group, one item of each language.
    m = scored["metrics"]
    for lang in LANGUAGES:
        assert 0 < m[f"kiln_multilingual[{lang}]/bits_per_byte"] < 20
        assert 0 <= m[f"kiln_multilingual_choice[{lang}]/acc_norm"] <= 1
    items = scored["results"]["kiln_item_scores"]
    for task in ("kiln_multilingual", "kiln_multilingual_choice"):
        assert m[f"{task}/num_docs"] == 12
        assert {g: s["num_items"] for g, s in items[task]["groups"].items()} == dict.fromkeys(LANGUAGES, 1)
    # An ungrouped task scores its first 4; the 4 position buckets one item each.
    assert m["kiln_reasoning/num_docs"] == 4 and m["kiln_position/num_docs"] == 4
    assert 0 <= m["kiln_coding_pass1/pass_at_1"] <= 1 and m["kiln_coding_pass1/num_docs"] == 4
    assert m["kiln_bias_pairs/stereotype_preference"] in (0, 0.25, 0.5, 0.75, 1)
    assert 0 <= m["kiln_toxicity/toxic_share"] <= 1 and 0 <= m["kiln_toxicity/toxicity"] <= 1
    # The classifier (128 MB) is not kept: the suite's items are, and it is trained again from them.
    assert not (scored["out"] / "tasks" / "toxicity.ftz").exists()
    assert (scored["out"] / "tasks" / "kiln_toxicity.yaml").is_file()
    for bucket in ("tokens 0-16", "tokens 16-32", "tokens 32-48", "tokens 48-64"):
        assert m[f"kiln_position[{bucket}]/bits_per_byte"] > 0
    # The names the stage lists without a model are the names it scores, and those it could not build here.
    skipped = scored["results"]["kiln_skipped_tasks"]
    assert set(skipped) == {"kiln_heldout_choice", "kiln_passkey (50% of context)"}
    assert set(suite_task_names(scored["cfg"])) == set(tasks)
    assert {g for g in scored["results"]["kiln_item_scores"]["kiln_passkey"]["groups"]} <= {"75% of context",
                                                                                           "100% of context"}
    # Each task's items: a score, a bootstrap interval around it, and (no contamination given) the same clean score.
    for name, item in scored["results"]["kiln_item_scores"].items():
        assert item["ci_low"] <= item["score"] + 1e-9 and item["score"] <= item["ci_high"] + 1e-9, name
        assert item["clean_score"] == pytest.approx(item["score"]), name


def test_passkey_prompts_fit_the_context_and_hold_the_key(scored):
    tokenizer = scored["tokenizer"]
    view = TokenView(lambda t: tokenizer.encode(t).ids, tokenizer.decode, MODEL.max_seq_len)
    # This tokenizer (320 tokens, English text only: digits are bytes) needs 40 tokens for the key and the
    # question: 16 and 32 are too short.
    assert passkey_items(view, 0.25, SuiteConfig().passkey) == passkey_items(view, 0.5, SuiteConfig().passkey) == []
    for fraction in (0.75, 1.0):
        items = passkey_items(view, fraction, SuiteConfig().passkey)
        assert len(items) == 8 and len({item["context"] for item in items}) == 8
        for item in items:
            answer = item["choices"][item["label"]]
            assert answer == item["target"] and answer.strip() in item["context"]
            assert len(view.encode(item["context"] + answer)) <= int(fraction * MODEL.max_seq_len)
        assert passkey_items(view, fraction, SuiteConfig().passkey) == items  # deterministic


def test_levels_select_tasks_and_versions_follow_the_items(tmp_path):
    proxy = SuiteConfig(categories=ALL, levels=["proxy"])
    tasks, _ = build_category_suite(proxy, None, None)
    assert {t.level for t in tasks} == {"proxy"}
    assert {t.category for t in tasks} == {"reasoning", "coding", "multilingual", "long_context"}
    assert len(tasks) == 5  # reasoning, coding, multilingual, passkey and position: one lm-eval task each
    edited = tmp_path / "reasoning.jsonl"
    records = [json.loads(line) for line in Path(SuiteConfig().reasoning_file).read_text().splitlines()]
    records[0]["label"] = (records[0]["label"] + 1) % 4
    edited.write_text("".join(json.dumps(r) + "\n" for r in records))
    before = {t.name: t.version for t in build_category_suite(SuiteConfig(categories=["reasoning"]), None, None)[0]}
    after = {t.name: t.version for t in
             build_category_suite(SuiteConfig(categories=["reasoning"], reasoning_file=str(edited)), None, None)[0]}
    assert before.keys() == after.keys() == {"kiln_reasoning", "kiln_reasoning_bpb"}
    assert all(before[n] != after[n] for n in before)
