"""The local eval suite built from held-out documents: which tasks, which items, which versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kiln.tasks.errors import InputError
from kiln.tasks.evals.evaluate import Contamination, EvaluateConfig, require_hub
from kiln.tasks.evals.heldout_task import EvalDoc, read_eval_docs
from kiln.tasks.evals.suite import (
    STANDARD_SUITE,
    ChoiceTaskConfig,
    LinesTaskConfig,
    build_local_suite,
    choice_items,
    lines_items,
    primary_metric,
    selected_items,
)

REPO = Path(__file__).resolve().parents[3]
PROSE = REPO / "data" / "evals" / "heldout.jsonl"
CODE = REPO / "data" / "evals" / "heldout_code.jsonl"


def test_the_default_suite_has_bpb_choice_and_line_tasks_per_domain(tmp_path):
    cfg = EvaluateConfig()
    suite, skipped = build_local_suite([PROSE, CODE], tmp_path, cfg.choice, cfg.lines)
    assert [(t.name, t.kind) for t in suite] == [
        ("kiln_heldout", "bits_per_byte"), ("kiln_heldout_choice", "choice"),
        ("kiln_heldout_code", "bits_per_byte"), ("kiln_heldout_code_choice", "choice"),
        ("kiln_heldout_code_lines", "lines")]
    assert skipped == {}
    counts = {t.name: len(t.source_ids) for t in suite}
    assert counts["kiln_heldout"] == 63 and counts["kiln_heldout_choice"] == 2 * 63
    assert counts["kiln_heldout_code"] == 40 and counts["kiln_heldout_code_choice"] == 2 * 40
    assert 70 <= counts["kiln_heldout_code_lines"] <= 2 * 40  # two per document that has two lines worth completing
    for task in suite:
        config = yaml.safe_load((tmp_path / f"{task.name}.yaml").read_text())
        assert config["metadata"]["version"] == task.version and task.version.startswith("1+")
        items = [json.loads(line) for line in Path(config["dataset_kwargs"]["data_files"]["test"]).read_text().splitlines()]
        assert len(items) == len(task.source_ids)
    # Rebuilt elsewhere: the same items and versions (the seed is the task name, not the folder).
    again, _ = build_local_suite([PROSE, CODE], tmp_path / "again", cfg.choice, cfg.lines)
    assert [t.version for t in again] == [t.version for t in suite]


def test_choice_items_take_distractors_of_the_same_length_from_other_documents():
    docs = read_eval_docs(CODE)
    cfg = ChoiceTaskConfig()
    items = choice_items(docs, cfg, seed="s")
    by_id = {d.id: d.text for d in docs}
    labels = [item["label"] for item in items]
    assert set(labels) == {0, 1, 2, 3} and max(labels.count(k) for k in range(4)) < 0.4 * len(items)
    for item in items:
        source = by_id[item["source_id"]]
        answer = item["choices"][item["label"]]
        assert item["context"] + answer in source  # the true continuation follows the passage verbatim
        assert len(item["context"].split()) == cfg.context_words
        assert all(len(choice.split()) == cfg.continuation_words for choice in item["choices"])
        assert all(choice[0].isspace() for choice in item["choices"])
        normalised = {" ".join(choice.split()) for choice in item["choices"]}
        assert len(normalised) == cfg.num_choices  # no distractor equals the answer or another distractor
        for k, choice in enumerate(item["choices"]):
            if k != item["label"]:
                assert any(choice in text for doc_id, text in by_id.items() if doc_id != item["source_id"])
    assert choice_items(docs, cfg, seed="s") == items and choice_items(docs, cfg, seed="t") != items


def test_lines_items_complete_code_lines_not_comments_or_docstrings():
    text = "\n".join([
        "import os",
        '"""Module docstring',
        "spanning = several lines of prose",
        '"""',
        "# a comment line that is long enough",
        "def main(argv):",
        "    value = os.path.join(argv[0], 'x')",
        "    return value",
        "x",
    ])
    items = lines_items([EvalDoc("d", text, "code")], LinesTaskConfig(items_per_doc=5, context_lines=2))
    assert [(i["context"].rsplit("\n", 1)[-1], i["target"]) for i in items] == [
        ("def", " main(argv):"), ("    value", " = os.path.join(argv[0], 'x')"), ("    return", " value")]
    assert items[1]["context"] == "# a comment line that is long enough\ndef main(argv):\n    value"
    assert [i["id"] for i in items] == ["d:6", "d:7", "d:8"]


def test_short_documents_skip_the_choice_task_with_the_reason(tmp_path):
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps({"text": f"sentence number {i} is short", "domain": "code"}) + "\n"
                             for i in range(5)))
    suite, skipped = build_local_suite([short], tmp_path / "tasks", ChoiceTaskConfig(), LinesTaskConfig())
    assert [t.name for t in suite] == ["kiln_short"]
    assert "fewer than 4 documents of at least 60 words" in skipped["kiln_short_choice"]
    assert "no line" in skipped["kiln_short_lines"]
    suite, skipped = build_local_suite([short], tmp_path / "tasks2", ChoiceTaskConfig(enabled=False),
                                       LinesTaskConfig(domains=[]))
    assert [t.name for t in suite] == ["kiln_short"] and skipped == {}


def test_versions_follow_the_items_and_settings(tmp_path):
    base, _ = build_local_suite([CODE], tmp_path / "a", ChoiceTaskConfig(), LinesTaskConfig())
    other, _ = build_local_suite([CODE], tmp_path / "b", ChoiceTaskConfig(num_choices=3), LinesTaskConfig(max_gen_toks=8))
    versions = {t.name: t.version for t in base}
    changed = {t.name for t in other if t.version != versions[t.name]}
    assert changed == {"kiln_heldout_code_choice", "kiln_heldout_code_lines"}  # bits per byte did not change
    edited = tmp_path / "heldout_code.jsonl"
    edited.write_text(CODE.read_text().replace("self", "this"))
    moved, _ = build_local_suite([edited], tmp_path / "c", ChoiceTaskConfig(), LinesTaskConfig())
    assert all(t.version != versions[t.name] for t in moved)


def test_contamination_rate_of_a_task_is_the_share_of_its_items_from_found_documents(tmp_path):
    suite, _ = build_local_suite([PROSE], tmp_path, ChoiceTaskConfig(), LinesTaskConfig())
    leaked = {"heldout/coreutils/basename.1", "heldout/coreutils/mkdir.1", "heldout/coreutils/sleep.1"}
    found = Contamination(rates={"hellaswag": 0.25}, contaminated_ids={"kiln_heldout": leaked})
    bpb, choice = suite
    assert found.rate(bpb) == 3 / 63 and found.rate(choice) == 6 / 126
    assert found.rate(bpb, limit=10) == 0.0  # the first ten documents are not among them
    assert found.rate("hellaswag") == 0.25 and found.rate("piqa") is None


def test_a_limit_samples_a_grouped_task_by_group_so_every_group_is_scored():
    # 12 languages of 4 items each, interleaved as the multilingual builder writes them, then one more
    # language (xx) with a single item at the end.
    langs = [f"l{n:02d}" for n in range(12)]
    groups = [lang for _ in range(4) for lang in langs] + ["xx"]
    assert selected_items(groups, 49, None) == list(range(49))
    assert selected_items(groups, 49, 100) == list(range(49))
    # Below the number of groups: one item of each of the 13 groups, the last group's too.
    assert selected_items(groups, 49, 10) == [*range(12), 48]
    # 26: a first round of 13 (xx's only item among them), a second of 12, and the third round's first.
    picked = [groups[i] for i in selected_items(groups, 49, 26)]
    assert len(picked) == 26 and {g: picked.count(g) for g in ("l00", "l01", "l11", "xx")} == \
        {"l00": 3, "l01": 2, "l11": 2, "xx": 1}
    # Groups of unequal size and out of order: still one of each at the smallest limit.
    assert selected_items(["a", "a", "a", "b", "c", "c"], 6, 2) == [0, 3, 4]
    # An ungrouped task: its first `limit` items.
    assert selected_items(["", "", "", ""], 4, 2) == [0, 1] and selected_items((), 4, 3) == [0, 1, 2]


def test_the_standard_suite_is_selectable_and_fails_at_once_offline(monkeypatch):
    from huggingface_hub import constants

    assert EvaluateConfig().online_tasks() == []
    cfg = EvaluateConfig(standard_suite=True, extra_tasks=["piqa", "boolq"])
    assert cfg.online_tasks() == [*STANDARD_SUITE, "boolq"]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(InputError, match=r"'hellaswag'.*Hugging Face hub, but this process is offline.*standard_suite: false"):
        require_hub(cfg.online_tasks())
    require_hub([])  # the local suite needs no hub


def test_primary_metric_prefers_normalised_accuracy():
    assert primary_metric(["acc", "acc_norm"]) == "acc_norm"
    assert primary_metric(["word_perplexity", "bits_per_byte"]) == "bits_per_byte"
    assert primary_metric(["exact_match"]) == "exact_match" and primary_metric(["f1"]) is None


def test_the_standard_suite_is_in_the_decontaminate_and_evaluate_keys_and_offline_fails_before_indexing(
        monkeypatch, tmp_path):
    from huggingface_hub import constants

    from kiln.tasks.config import load_config
    from kiln.tasks.data.decontaminate import DecontaminateConfig, decontaminate_documents
    from kiln.tasks.data.documents import Document, write_documents
    from kiln.tasks.graph import stage_keys

    monkeypatch.chdir(REPO)
    base = stage_keys(load_config("configs/tiny.yaml"))
    online = stage_keys(load_config("configs/tiny.yaml", ["evaluate.standard_suite=true"]))
    assert {name for name in base if base[name] != online[name]} >= {"decontaminate", "evaluate"}
    assert base["dedup"] == online["dedup"]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    documents = tmp_path / "in.jsonl"
    write_documents(documents, [Document("d", "some training text", "s", "prose", "MIT")])
    with pytest.raises(InputError, match=r"\['hellaswag', 'arc_easy', .*'mmlu'\].*offline"):
        decontaminate_documents(DecontaminateConfig(), [documents], [PROSE], tmp_path,
                                eval_tasks=EvaluateConfig(standard_suite=True).online_tasks())
