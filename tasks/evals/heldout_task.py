"""Turns a held-out JSON-lines file into a local lm-eval perplexity task that runs offline.

The task mirrors lm-eval's own `wikitext` task (`loglikelihood_rolling` over each document's
text, reporting word and byte perplexity and bits per byte) but reads a validated copy of the
documents kept inside the task folder, so the task is self-contained and needs no hub.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from kiln.tasks.errors import InputError

DOCS_FILE_SUFFIX = ".docs.jsonl"
HF_CACHE_DIR = "hf_cache"
BITS_PER_BYTE_VERSION = 1  # bump when the task's definition changes (continuous eval then re-scores it)


@dataclass(frozen=True)
class EvalDoc:
    """One held-out document: its id (the key of decontamination's report), text and domain, if given."""

    id: str
    text: str
    domain: str | None = None


def task_name_for(eval_file: Path) -> str:
    """`data/evals/heldout.jsonl` -> `kiln_heldout` (lm-eval task names: lowercase, `_`)."""
    return "kiln_" + re.sub(r"[^a-z0-9]+", "_", Path(eval_file).stem.lower()).strip("_")


def read_eval_records(eval_file: Path) -> list[tuple[str, str]]:
    """(id, text) of every record (see `read_eval_docs`)."""
    return [(doc.id, doc.text) for doc in read_eval_docs(eval_file)]


def read_eval_docs(eval_file: Path) -> list[EvalDoc]:
    """Every record: its string `id` (else `line N`), text and string `domain`. The one reader of eval
    files (the eval tasks and decontamination both use it): blank lines are skipped, anything
    else malformed is an `InputError` naming the file and line."""
    if not eval_file.is_file():
        raise InputError(f"eval file {eval_file} does not exist: create it or fix the path")
    try:
        lines = eval_file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise InputError(f"eval file {eval_file} is not UTF-8 ({err}): re-encode it") from err
    records = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{eval_file}:{line_no}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"{where} is not valid JSON ({err.msg}): write one JSON object per line") from err
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise InputError(f'{where} has no string "text" field: each record needs {{"text": "..."}}')
        if not record["text"].strip():
            raise InputError(f'{where} has an empty "text": an eval item needs text; drop the line')
        doc_id, domain = record.get("id"), record.get("domain")
        records.append(EvalDoc(doc_id if isinstance(doc_id, str) else f"line {line_no}", record["text"],
                               domain if isinstance(domain, str) else None))
    if not records:
        raise InputError(f"eval file {eval_file} holds no records: add at least one {{\"text\": ...}} line")
    return records


def write_heldout_task(eval_file: Path, task_dir: Path, task_name: str, version: str | int = BITS_PER_BYTE_VERSION) -> str:
    """Write `<task_name>.yaml` and its documents into `task_dir`; returns the task name.

    lm-eval resolves relative `data_files` against the working directory, so the copy's path
    is written absolute. The HF datasets cache goes to `task_dir/hf_cache` rather than the
    user's home, so a run touches no files outside its own folder.
    """
    texts = [text for _, text in read_eval_records(eval_file)]
    task_dir.mkdir(parents=True, exist_ok=True)
    docs_path = (task_dir / f"{task_name}{DOCS_FILE_SUFFIX}").resolve()
    with open(docs_path, "w", encoding="utf-8") as handle:
        for text in texts:
            handle.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    config = {
        "task": task_name,
        "dataset_path": "json",
        "dataset_kwargs": {
            "data_files": {"test": str(docs_path)},
            "cache_dir": str((task_dir / HF_CACHE_DIR).resolve()),
        },
        "output_type": "loglikelihood_rolling",
        "test_split": "test",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        # Aggregations as lm-eval's defaults for these metrics, stated so it need not guess.
        "metric_list": [
            {"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
            {"metric": "byte_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
            {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
        ],
        "metadata": {"version": version},
    }
    (task_dir / f"{task_name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return task_name
