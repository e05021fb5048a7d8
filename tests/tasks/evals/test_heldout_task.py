"""The held-out task writer: a self-contained lm-eval task yaml, and errors naming file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kiln.tasks.errors import InputError
from kiln.tasks.evals.heldout_task import read_eval_records, task_name_for, write_heldout_task


def test_task_name_derives_from_file_stem() -> None:
    assert task_name_for(Path("data/evals/heldout.jsonl")) == "kiln_heldout"
    assert task_name_for(Path("/x/Wiki-Dev.v2.jsonl")) == "kiln_wiki_dev_v2"


def test_writes_yaml_and_docs_copy(tmp_path: Path) -> None:
    eval_file = tmp_path / "heldout.jsonl"
    records = [{"text": "first doc", "id": 1}, {"text": "second\ndoc"}]
    eval_file.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    task_dir = tmp_path / "out" / "tasks"

    assert write_heldout_task(eval_file, task_dir, "kiln_heldout") == "kiln_heldout"

    config = yaml.safe_load((task_dir / "kiln_heldout.yaml").read_text())
    docs = Path(config["dataset_kwargs"]["data_files"]["test"])
    assert docs.is_absolute() and docs.parent == task_dir.resolve()
    assert [json.loads(line) for line in docs.read_text().splitlines()] == [
        {"text": "first doc"},
        {"text": "second\ndoc"},
    ]
    assert config["task"] == "kiln_heldout"
    assert config["dataset_path"] == "json"
    assert config["output_type"] == "loglikelihood_rolling"
    assert config["test_split"] == "test"
    assert (config["doc_to_text"], config["doc_to_target"]) == ("", "{{text}}")
    assert [m["metric"] for m in config["metric_list"]] == ["word_perplexity", "byte_perplexity", "bits_per_byte"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text": "ok"}\nnot json\n', "bad.jsonl:2 is not valid JSON"),
        ('{"text": "ok"}\n\n{"body": "x"}\n', 'bad.jsonl:3 has no string "text" field'),
        ('["text"]\n', 'bad.jsonl:1 has no string "text" field'),
        ('{"text": 3}\n', 'bad.jsonl:1 has no string "text" field'),
        ('{"text": "  "}\n', 'bad.jsonl:1 has an empty "text"'),
        ("\n", "bad.jsonl holds no records"),
    ],
)
def test_bad_eval_file_names_file_and_line(tmp_path: Path, content: str, message: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    with pytest.raises(InputError, match=message):
        write_heldout_task(bad, tmp_path / "tasks", "kiln_bad")


def test_eval_records_carry_ids_and_reject_non_utf8(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"id": "q1", "text": "first"}\n\n{"text": "second", "id": 7}\n')
    assert read_eval_records(good) == [("q1", "first"), ("line 3", "second")]
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"text": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(InputError, match="latin1.jsonl is not UTF-8"):
        read_eval_records(latin1)


def test_missing_eval_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="missing.jsonl does not exist"):
        write_heldout_task(tmp_path / "missing.jsonl", tmp_path / "tasks", "kiln_missing")
