"""Decontamination covers every task of the configured suite: planted copies of bundled items are found,
each task gets its contamination rate, and scores are also given on the clean items only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.tasks.bundled import locate
from kiln.tasks.data.decontaminate import DecontaminateConfig, decontaminate_documents, read_contamination
from kiln.tasks.data.documents import Document, write_documents
from kiln.tasks.evals.categories import SuiteConfig, build_category_suite
from kiln.tasks.evals.evaluate import item_scores

SUITE = SuiteConfig(categories=["reasoning", "multilingual", "coding", "safety"])


def _records(name: str) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, locate(name).read_text().splitlines())}


def test_planted_items_give_per_task_rates_and_clean_scores(tmp_path):
    reasoning, multilingual = _records(SUITE.reasoning_file), _records(SUITE.multilingual_file)
    planted = [reasoning["arith-3"]["text"], reasoning["order-5"]["text"], multilingual["en-1"]["text"]]
    docs = [Document(f"leak-{i}", f"Some forum post. {text} More words after it.", "web", "web", "CC0")
            for i, text in enumerate(planted)]
    docs.append(Document("clean", "Nothing here comes from any benchmark at all, just ordinary prose. " * 3,
                         "web", "web", "CC0"))
    shard = tmp_path / "in.jsonl"
    write_documents(shard, docs)
    out = tmp_path / "out"
    out.mkdir()
    files = [locate(f) for f in SUITE.files()]
    decontaminate_documents(DecontaminateConfig(), [shard], files, out)
    found = read_contamination(out)
    assert found.contaminated_ids["kiln_reasoning"] == {"arith-3", "order-5"}
    assert found.contaminated_ids["kiln_multilingual"] == {"en-1"}
    assert found.contaminated_ids["kiln_coding"] == set() and found.contaminated_ids["kiln_bias_pairs"] == set()

    tasks = {t.name: t for t in build_category_suite(SUITE, None, None)[0]}
    # Every task of the suite gets a rate from its file's findings (grouped tasks over all their groups).
    assert found.rate(tasks["kiln_reasoning"]) == pytest.approx(2 / 36)
    assert found.rate(tasks["kiln_reasoning_bpb"]) == pytest.approx(2 / 36)
    assert found.rate(tasks["kiln_multilingual_choice"]) == pytest.approx(1 / 48)
    assert found.rate(tasks["kiln_coding_pass1"]) == 0.0

    # Scores on the clean items: every item right except the planted ones -> score 34/36, clean score 1.
    task = tasks["kiln_reasoning"]
    samples = [{"doc_id": i, "acc_norm": 0.0 if sid in {"arith-3", "order-5"} else 1.0,
                "doc": {"choices": [" a", " b", " c", " d"]}} for i, sid in enumerate(task.source_ids)]
    results = {"results": {task.name: {"acc,none": 0.9, "acc_norm,none": 34 / 36}}}
    scores = item_scores(task, samples, results, found)
    assert scores["score"] == pytest.approx(34 / 36) and scores["clean_score"] == 1.0
    assert (scores["num_items"], scores["num_clean"], scores["chance"]) == (36, 34, 0.25)


def test_generated_tasks_are_exempt():
    tasks = {t.name: t for t in build_category_suite(SuiteConfig(categories=["long_context"]), None, None)[0]}
    assert tasks["kiln_passkey"].eval_file is None and tasks["kiln_passkey_gen"].eval_file is None
    assert tasks["kiln_position"].eval_file == Path(locate(SuiteConfig().position_file)).absolute()
