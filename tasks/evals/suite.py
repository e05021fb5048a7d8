"""The eval suite: lm-eval tasks Kiln builds from held-out documents, and the standard online suite.

From each eval file (JSON lines of held-out documents, one domain per file by convention) the
evaluate stage writes lm-eval task YAMLs over local files, so the suite runs offline:

- `kiln_<stem>`: bits per byte of each document (`loglikelihood_rolling`), the per-domain perplexity;
- `kiln_<stem>_choice`: multiple choice: after a passage, pick its true continuation among
  continuations of the same length taken from other documents of the same file (same domain);
  scored by accuracy and length-normalised accuracy;
- `kiln_<stem>_lines`: generation: given the preceding lines and the first word of a line of a
  document in one of `lines.domains` (code by default), write the rest of that line; exact match.

Items are drawn deterministically (a seed derived from the task name), so two runs build the same
task. Each item remembers the document it came from (`source_id`): a task's contamination rate is
the share of its items drawn from documents the decontaminate stage found in the training data. A
task's version is its builder's version plus a digest of its items and settings, so changing the
eval file or a task setting changes the version, and continuous eval scores that task again.

The standard suite (hellaswag, ARC, PIQA, WinoGrande, LAMBADA, MMLU) is lm-eval's own tasks, whose
data comes from the Hugging Face hub: selectable (`evaluate.standard_suite`) on a machine that is online.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field

from kiln.tasks.configbase import Section
from kiln.tasks.errors import ConfigError
from kiln.tasks.evals.heldout_task import (
    BITS_PER_BYTE_VERSION,
    DOCS_FILE_SUFFIX,
    HF_CACHE_DIR,
    EvalDoc,
    read_eval_docs,
    task_name_for,
    write_heldout_task,
)

STANDARD_SUITE = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "lambada_openai", "mmlu")
CHOICE_VERSION = 1  # bump when a builder's definition changes
LINES_VERSION = 1
# The score each kind of task is followed by (the ECG's curve, the regression check), best first.
PRIMARY_METRICS = {"acc_norm": True, "acc": True, "exact_match": True, "pass_at_1": True, "bits_per_byte": False,
                   "stereotype_preference": False, "toxic_share": False}  # -> higher is better
_MAX_TARGET_CHARS = 60  # a line's rest longer than this is not one completion a small model can be judged on
_MIN_TARGET_CHARS = 3


class ChoiceTaskConfig(Section):
    """The multiple-choice task of each eval file: a passage's true continuation among distractors."""

    enabled: bool = True
    num_choices: int = Field(4, ge=2)
    context_words: int = Field(48, ge=1)  # words of the passage shown (the adapter keeps the last that fit)
    continuation_words: int = Field(12, ge=1)  # words of each choice
    items_per_doc: int = Field(2, ge=1)


class LinesTaskConfig(Section):
    """The line-completion task: complete a held-out line from its first word, judged by exact match."""

    # Eval documents whose `domain` is one of these give the task (one per eval file); [] for none.
    domains: list[str] = ["code"]
    context_lines: int = Field(8, ge=1)  # preceding lines shown
    # Greedy generation costs a forward pass per token: two lines per document and 24 tokens (a 60-character
    # rest of a line is ~20 tokens of Kiln's 2048-token BPE) keep the task a few seconds on a CPU.
    items_per_doc: int = Field(2, ge=1)
    max_gen_toks: int = Field(24, ge=1)


CATEGORIES = ("reasoning", "coding", "multilingual", "long_context", "safety", "general")
LEVELS = ("proxy", "mid", "production")
# A held-out file's tasks, by kind: bits per byte is a continuous metric (proxy), the continuation choice
# is multiple choice (mid), line completion is generative (production).
_LEVEL_OF_KIND = {"bits_per_byte": "proxy", "choice": "mid", "lines": "production"}


@dataclass(frozen=True)
class LocalTask:
    """One task written into the task folder: its lm-eval name, kind, version and item sources, and where
    it sits in the suite: its category (`CATEGORIES`) and level (`LEVELS`)."""

    name: str
    kind: str  # "bits_per_byte", "choice", "lines", or a category task's kind (`tasks.evals.categories`)
    eval_file: Path | None  # None: generated items (passkey), exempt from decontamination
    version: str
    source_ids: tuple[str, ...]  # the eval document of each item, in item order
    category: str = "general"
    level: str = "proxy"
    groups: tuple[str, ...] = ()  # each item's group (language, passkey length, position bucket): a report row each

    def contamination_rate(self, contaminated_ids: set[str]) -> float:
        return sum(i in contaminated_ids for i in self.source_ids) / len(self.source_ids)

    def selected(self, limit: int | None) -> list[int]:
        """The items scored under `limit` (`selected_items`), ascending."""
        return selected_items(self.groups, len(self.source_ids), limit)


def selected_items(groups: Sequence[str], num_items: int, limit: int | None) -> list[int]:
    """Which of a task's `num_items` items are scored under `evaluate.limit`, ascending: all without a limit;
    an ungrouped task its first `limit`; a grouped task (a row per language, length or bucket) is sampled by
    group (stratified): its groups in turn, each group's items in their order, `limit` items but never fewer
    than one per group, so every group gets a score however small the limit (12 languages at limit 10: 12
    items, one each; at limit 24: two each)."""
    if limit is None or limit >= num_items:
        return list(range(num_items))
    if not any(groups):
        return list(range(limit))
    by_group: dict[str, list[int]] = {}
    for index, group in enumerate(groups):
        by_group.setdefault(group, []).append(index)
    want = max(limit, len(by_group))
    chosen: list[int] = []
    for k in range(max(len(items) for items in by_group.values())):
        chosen += [items[k] for items in by_group.values() if k < len(items)]
        if len(chosen) >= want:
            break
    return sorted(chosen[:want])


def primary_metric(metrics: Sequence[str]) -> str | None:
    """The metric a task's curve follows: the first of `PRIMARY_METRICS` the task reports."""
    return next((m for m in PRIMARY_METRICS if m in metrics), None)


def online_task_versions(names: Sequence[str]) -> dict[str, str]:
    """The version lm-eval's task index gives each named task or group (indexing takes seconds)."""
    from lm_eval.tasks import TaskManager  # imported here: lm-eval takes seconds to import

    index = TaskManager().task_index
    unknown = [name for name in names if name not in index]
    if unknown:
        raise ConfigError(f"evaluate.extra_tasks: {unknown} are not lm-eval tasks; see `lm_eval ls tasks`")
    return {name: str((index[name].cfg or {}).get("metadata", {}).get("version")) for name in names}


def build_local_suite(eval_paths: Sequence[Path], task_dir: Path, choice: ChoiceTaskConfig,
                      lines: LinesTaskConfig) -> tuple[list[LocalTask], dict[str, str]]:
    """Write every local task of the eval files into `task_dir`; returns them, file by file, and the
    tasks that could not be built with the reason (documents too short or too few: e.g. an eval file
    of one-sentence passages has no room for a passage and its continuation)."""
    task_dir.mkdir(parents=True, exist_ok=True)
    suite: list[LocalTask] = []
    skipped: dict[str, str] = {}
    for path in eval_paths:
        built = len(suite)
        docs = read_eval_docs(path)
        base = task_name_for(path)
        version = _version(BITS_PER_BYTE_VERSION, [{"text": d.text} for d in docs], {})
        write_heldout_task(path, task_dir, base, version)
        suite.append(LocalTask(base, "bits_per_byte", path, version, tuple(d.id for d in docs)))
        if choice.enabled:
            items = choice_items(docs, choice, seed=f"{base}_choice")
            if items:
                suite.append(_write_choice_task(path, items, task_dir, f"{base}_choice"))
            else:
                skipped[f"{base}_choice"] = (
                    f"fewer than {choice.num_choices} documents of at least {choice.context_words + choice.continuation_words} "
                    "words (evaluate.choice: num_choices, context_words + continuation_words)")
        coded = [d for d in docs if d.domain in lines.domains]
        if coded:
            items = lines_items(coded, lines)
            if items:
                suite.append(_write_lines_task(path, items, task_dir, f"{base}_lines", lines))
            else:
                skipped[f"{base}_lines"] = ("no line of its evaluate.lines.domains documents is worth completing "
                                            f"({_MIN_TARGET_CHARS}-{_MAX_TARGET_CHARS} characters after its first word)")
        # A file of code documents is the coding category's; any other held-out file is general.
        category = "coding" if all(d.domain == "code" for d in docs) else "general"
        suite[built:] = [replace(t, category=category, level=_LEVEL_OF_KIND[t.kind]) for t in suite[built:]]
    return suite, skipped


def _version(builder_version: int, items: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps([items, settings], sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return f"{builder_version}+{digest[:8]}"


def _write_task(task_dir: Path, name: str, items: list[dict[str, Any]], config: dict[str, Any]) -> None:
    """The items beside the YAML (absolute path: lm-eval resolves relative ones against the working
    directory), the datasets cache inside the task folder, so a run touches nothing outside it."""
    docs_path = (task_dir / f"{name}{DOCS_FILE_SUFFIX}").resolve()
    with open(docs_path, "w", encoding="utf-8") as handle:
        for item in items:
            handle.write(json.dumps(item, ensure_ascii=False) + "\n")
    full = {"task": name, "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(docs_path)}, "cache_dir": str((task_dir / HF_CACHE_DIR).resolve())},
            "test_split": "test", **config}
    (task_dir / f"{name}.yaml").write_text(yaml.safe_dump(full, sort_keys=False, allow_unicode=True), encoding="utf-8")


# ---- multiple choice ---------------------------------------------------------------------------


def _word_ends(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in re.finditer(r"\S+", text)]


def choice_items(docs: Sequence[EvalDoc], cfg: ChoiceTaskConfig, seed: str) -> list[dict[str, Any]]:
    """Items of the continuation task: `context`, `choices` (each starting with the whitespace that
    precedes it in its document) and `label`. Distractors are continuations of the same number of
    words from other documents, never equal (ignoring whitespace) to the answer or to each other."""
    rng = random.Random(seed)
    spans = [_word_ends(d.text) for d in docs]
    need = cfg.context_words + cfg.continuation_words
    usable = [i for i, s in enumerate(spans) if len(s) >= need]

    def continuation(i: int, start: int) -> str:
        """The `continuation_words` words of document i from word `start`, with the whitespace before them."""
        words = spans[i]
        return docs[i].text[words[start - 1][1] : words[start + cfg.continuation_words - 1][1]]

    items = []
    for i in usable:
        words, others = spans[i], [j for j in usable if j != i]
        if len(others) < cfg.num_choices - 1:
            break
        room = len(words) - need
        for k in range(cfg.items_per_doc):
            start = cfg.context_words + room * (2 * k + 1) // (2 * cfg.items_per_doc)
            answer = continuation(i, start)
            seen = {" ".join(answer.split())}
            choices = [answer]
            for j in rng.sample(others, len(others)):
                other_start = rng.randint(1, len(spans[j]) - cfg.continuation_words)
                text = continuation(j, other_start)
                if " ".join(text.split()) not in seen:
                    seen.add(" ".join(text.split()))
                    choices.append(text)
                if len(choices) == cfg.num_choices:
                    break
            if len(choices) < cfg.num_choices:
                continue  # the other documents repeat this passage: no fair distractors
            rng.shuffle(choices)
            context = docs[i].text[words[start - cfg.context_words][0] : words[start - 1][1]]
            items.append({"id": f"{docs[i].id}#{k}", "source_id": docs[i].id, "context": context,
                          "choices": choices, "label": choices.index(answer)})
    return items


def _write_choice_task(path: Path, items: list[dict[str, Any]], task_dir: Path, name: str) -> LocalTask:
    version = _version(CHOICE_VERSION, items, {})
    _write_task(task_dir, name, items, {
        "output_type": "multiple_choice",
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "target_delimiter": "",  # each choice carries the whitespace that preceded it in its document
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": version},
    })
    return LocalTask(name, "choice", path, version, tuple(item["source_id"] for item in items))


# ---- line completion ---------------------------------------------------------------------------


def _completable_lines(lines: Sequence[str]) -> list[tuple[int, int]]:
    """(line number, end of its first word) of the lines worth completing: code, not comments or the
    inside of a triple-quoted string, whose rest after the first word is 3-60 characters."""
    found = []
    in_string = False
    for number, line in enumerate(lines):
        stripped = line.strip()
        quotes = line.count('"""') + line.count("'''")
        if in_string or quotes or not stripped or stripped.startswith("#") or number == 0:
            in_string = in_string != bool(quotes % 2)
            continue
        first = re.match(r"\s*\S+", line)
        assert first is not None
        rest = line[first.end():].strip()
        if _MIN_TARGET_CHARS <= len(rest) <= _MAX_TARGET_CHARS:
            found.append((number, first.end()))
    return found


def lines_items(docs: Sequence[EvalDoc], cfg: LinesTaskConfig) -> list[dict[str, Any]]:
    """Items of the line-completion task, `items_per_doc` lines spread evenly over each document."""
    items = []
    for doc in docs:
        lines = doc.text.split("\n")
        candidates = _completable_lines(lines)
        n = min(cfg.items_per_doc, len(candidates))
        for k in range(n):
            number, cut = candidates[len(candidates) * (2 * k + 1) // (2 * n)]
            before = "\n".join(lines[max(0, number - cfg.context_lines) : number])
            items.append({"id": f"{doc.id}:{number + 1}", "source_id": doc.id,
                          "context": f"{before}\n{lines[number][:cut]}", "target": lines[number][cut:].rstrip()})
    return items


def _write_lines_task(path: Path, items: list[dict[str, Any]], task_dir: Path, name: str,
                      cfg: LinesTaskConfig) -> LocalTask:
    generation = {"until": ["\n"], "max_gen_toks": cfg.max_gen_toks, "do_sample": False}
    version = _version(LINES_VERSION, items, generation)
    _write_task(task_dir, name, items, {
        "output_type": "generate_until",
        "doc_to_text": "context",
        "doc_to_target": "target",
        "target_delimiter": "",
        "generation_kwargs": generation,
        # Whitespace around the rest of the line does not count: the model may or may not start with the space.
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "regexes_to_ignore": [r"^\s+", r"\s+$"]}],
        "metadata": {"version": version},
    })
    return LocalTask(name, "lines", path, version, tuple(item["source_id"] for item in items))


CATEGORY_DOMAINS = {"coding": "code", "multilingual": "multilingual"}  # a category task's training domain


def task_domains(tasks: Sequence[LocalTask], domains: Collection[str]) -> dict[str, str]:
    """The training domain each task measures, where one of `domains` (the mixture's) does: the most common
    domain of its eval documents, else its category's (`CATEGORY_DOMAINS`). A task without one is left out."""
    out: dict[str, str] = {}
    for task in tasks:
        found = Counter(d.domain for d in read_eval_docs(task.eval_file) if d.domain in domains) if task.eval_file else None
        if found:
            out[task.name] = found.most_common(1)[0][0]
        elif CATEGORY_DOMAINS.get(task.category) in domains:
            out[task.name] = CATEGORY_DOMAINS[task.category]
    return out
