"""The evaluate stage's work: runs lm-eval on a trained Kiln model through Kiln's own adapter.

The suite (`tasks.evals.suite`) is built from the held-out eval files: per-file (per-domain) bits
per byte, a multiple-choice continuation task and, for code, a line-completion task, all local and
offline. lm-eval's standard suite (`standard_suite`) and any built-in task named in `extra_tasks`
download their data from the Hugging Face hub, so they work only on a machine that is online;
offline they fail at once with an `InputError` that says so.

Every result carries its task's version (`results.json`: `versions`) and, given what the
decontaminate stage found, its contamination rate: the share of the task's evaluated items drawn
from eval documents that share n-grams with the training data.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from kiln.tasks.bundled import locate
from kiln.tasks.configbase import Section, added_field, runtime_field
from kiln.tasks.errors import ConfigError, InputError
from kiln.tasks.evals.heldout_task import HF_CACHE_DIR, task_name_for
from kiln.tasks.evals.categories import TOXICITY_MODEL, SuiteConfig, TokenView, build_category_suite
from kiln.tasks.evals.trust import TrustConfig
from kiln.tasks.evals.suite import (
    STANDARD_SUITE,
    ChoiceTaskConfig,
    LinesTaskConfig,
    LocalTask,
    build_local_suite,
    primary_metric,
)
from kiln.tasks.library_output import LIBRARY_LOG, library_output_to

if TYPE_CHECKING:
    from lm_eval.api.model import LM

log = logging.getLogger(__name__)

RESULTS_FILE = "results.json"
TASKS_DIR = "tasks"
# The parts of lm-eval's results that depend only on the model and the data: its timing,
# date, git hash and model-argument fields would make reruns differ.
_DETERMINISTIC_KEYS = (
    "results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples",
)


class EvaluateConfig(Section):
    # Held-out documents (JSON lines: text, optional id and domain), one domain per file: each
    # gives a bits-per-byte task, a multiple-choice task and, for `lines.domains`, a line-completion task.
    eval_files: list[str] = ["data/evals/heldout.jsonl", "data/evals/heldout_code.jsonl"]
    choice: ChoiceTaskConfig = ChoiceTaskConfig()
    lines: LinesTaskConfig = LinesTaskConfig()
    # The bundled category tasks (reasoning, coding, multilingual, long_context, safety) and the levels
    # (proxy, mid, production) of every task: `tasks.evals.categories`.
    suite: SuiteConfig = added_field(SuiteConfig())
    # Thresholds per level under which a task is not trusted, and how many last checkpoints measure its noise.
    trust: TrustConfig = added_field(TrustConfig())
    # lm-eval's standard suite (hellaswag, arc_easy, arc_challenge, piqa, winogrande, lambada_openai,
    # mmlu): data from the Hugging Face hub, so online only; decontamination then indexes it too.
    standard_suite: bool = False
    # Further built-in lm-eval task names; these fetch data from the hub and so need a network.
    extra_tasks: list[str] = []
    # Evaluate only the first `limit` items of each task (for quick checks).
    limit: int | None = Field(None, gt=0)
    batch_size: int = runtime_field(8, gt=0)

    def online_tasks(self) -> list[str]:
        """The lm-eval tasks whose data comes from the hub: the standard suite if chosen, then `extra_tasks`."""
        return list(dict.fromkeys([*(STANDARD_SUITE if self.standard_suite else ()), *self.extra_tasks]))


@dataclass(frozen=True)
class Contamination:
    """What the decontaminate stage found, keyed by the evaluate stage's task names."""

    rates: dict[str, float] = field(default_factory=dict)  # an eval file's bits-per-byte task, or an online task
    contaminated_ids: dict[str, set[str]] = field(default_factory=dict)  # eval file's task -> its documents found

    def rate(self, task: LocalTask | str, limit: int | None = None) -> float | None:
        """A local task's rate over the items scored under `limit` (`LocalTask.selected`); an online task's as reported."""
        if isinstance(task, str):
            return self.rates.get(task)
        if task.eval_file is None:
            return None  # generated items: exempt
        ids = self.contaminated_ids.get(task_name_for(task.eval_file))
        if ids is None:
            return None
        sources = [task.source_ids[i] for i in task.selected(limit)]
        return sum(i in ids for i in sources) / len(sources)


def require_hub(tasks: Sequence[str]) -> None:
    """Fail at once, with the fix, when hub tasks are configured in a process told to stay offline."""
    if not tasks:
        return
    from huggingface_hub import constants  # imported here: only hub tasks need it

    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    if offline:
        raise InputError(
            f"lm-eval tasks {list(tasks)} (evaluate.standard_suite / evaluate.extra_tasks) load their data from the "
            "Hugging Face hub, but this process is offline (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set). "
            "Run on a machine with network access without those variables, or set evaluate.standard_suite: false "
            "and evaluate.extra_tasks: [] to evaluate on the local held-out suite only"
        )


def evaluate_model(
    cfg: EvaluateConfig,
    model_dir: Path,
    tokenizer_path: Path,
    out_dir: Path,
    *,
    contamination: Contamination | None = None,
    tasks: Collection[str] | None = None,
    log_file: Path | None = None,
) -> dict:
    """Evaluate the model in `model_dir`; writes `tasks/` and `results.json` into `out_dir`, and what
    lm-eval and `datasets` print into `log_file` (default `out_dir/libraries.log`), not the terminal.

    Returns flat metrics `{"<task>/<metric>": value, ..., "num_eval_docs": n}`. Given what the
    decontaminate stage found, each task's contamination rate is recorded beside its score as
    `"<task>/contamination_rate"` (and under `contamination_rates` in results.json). `tasks`
    evaluates only the named tasks of the suite.
    """
    from kiln.tasks.evals.adapter import KilnLM  # defers torch

    # Check the inputs before paying for loading the model.
    eval_paths = eval_paths_of(cfg)
    lm = KilnLM.from_dirs(model_dir, tokenizer_path, batch_size=cfg.batch_size)
    return evaluate_lm(cfg, lm, out_dir, eval_paths, contamination=contamination, tasks=tasks, log_file=log_file)


def evaluate_lm(
    cfg: EvaluateConfig,
    lm: LM,
    out_dir: Path,
    eval_paths: list[Path] | None = None,
    *,
    contamination: Contamination | None = None,
    tasks: Collection[str] | None = None,
    log_file: Path | None = None,
) -> dict:
    """`evaluate_model` for a model already wrapped in an lm-eval `LM` (e.g. `KilnLM`)."""
    # Imported here: lm-eval takes seconds to import and only this stage needs it.
    from lm_eval.tasks import TaskManager

    eval_paths = eval_paths_of(cfg) if eval_paths is None else eval_paths
    task_dir = out_dir / TASKS_DIR
    suite, skipped = build_suite(cfg, eval_paths, task_dir, token_view(lm))
    for name, reason in skipped.items():
        log.warning("eval task %s not built: %s", name, reason)
    online = cfg.online_tasks()
    names = [task.name for task in suite] + online
    # a wanted task this model cannot be given (skipped above, e.g. a passkey longer than its context) is
    # recorded as skipped with its reason, not an error: only a name the suite does not have at all is
    check_wanted_tasks(set(tasks or ()) - set(skipped), names)
    if tasks is not None:
        suite = [task for task in suite if task.name in tasks]
        online = [name for name in online if name in tasks]
        names = [task.name for task in suite] + online
    with library_output_to(log_file or out_dir / LIBRARY_LOG):
        task_manager = TaskManager(include_path=str(task_dir), include_defaults=bool(online))
        unknown = [name for name in online if name not in task_manager.all_tasks]
        if unknown:
            raise ConfigError(f"evaluate.extra_tasks: {unknown} are not lm-eval tasks; see `lm_eval ls tasks`")
        require_hub(online)
        results = _run_lm_eval(lm, task_manager, names, cfg.limit, {task.name: task for task in suite})
    samples = results.pop("samples", {})
    # The dataset cache is a copy of the documents already beside the task files; the toxicity classifier
    # (128 MB a model scored) is trained again from the bundled data whenever the suite is built.
    shutil.rmtree(task_dir / HF_CACHE_DIR, ignore_errors=True)
    (task_dir / TOXICITY_MODEL).unlink(missing_ok=True)
    kept = {key: results[key] for key in _DETERMINISTIC_KEYS if key in results}
    kept["kiln_tasks"] = {task.name: {"kind": task.kind, "eval_file": task.eval_file and str(task.eval_file),
                                      "num_items": len(task.source_ids), "category": task.category, "level": task.level,
                                      "exempt": task.eval_file is None}
                          for task in suite}
    kept["kiln_skipped_tasks"] = skipped
    rates: dict[str, float] = {}
    if contamination is not None:
        for task in suite:
            rate = contamination.rate(task, cfg.limit)
            if rate is not None:
                rates[task.name] = rate
        rates.update({name: contamination.rates[name] for name in online if name in contamination.rates})
        kept["contamination_rates"] = rates
    kept["kiln_item_scores"] = {task.name: item_scores(task, samples.get(task.name, []), kept, contamination)
                                for task in suite if task.name in samples}
    (out_dir / RESULTS_FILE).write_text(json.dumps(_json_safe(kept), indent=2, sort_keys=True), encoding="utf-8")
    flat = flatten_results(kept)
    for task, item in kept["kiln_item_scores"].items():
        for group, summary in item.get("groups", {}).items():
            flat[f"{task}[{group}]/{item['metric']}"] = float(summary["score"])
    for task, rate in rates.items():
        flat[f"{task}/contamination_rate"] = float(rate)
    return flat


def suite_task_names(cfg: EvaluateConfig) -> list[str]:
    """The task names `evaluate_lm` computes for `cfg`, without a model: which local tasks exist depends
    on the items their builders draw, so the suite is built, into a temporary folder."""
    return [task.name for task in suite_tasks(cfg)] + cfg.online_tasks()


def suite_tasks(cfg: EvaluateConfig) -> list[LocalTask]:
    """The local tasks of `cfg` with their versions, without a model (the held-out files' are built in a
    temporary folder; the category tasks are listed)."""
    with tempfile.TemporaryDirectory(prefix="kiln-suite-") as task_dir:
        held_out, _ = build_local_suite(eval_paths_of(cfg), Path(task_dir), cfg.choice, cfg.lines)
    return [t for t in held_out if t.level in cfg.suite.levels] + build_category_suite(cfg.suite, None, None)[0]


def build_suite(cfg: EvaluateConfig, eval_paths: Sequence[Path], task_dir: Path, view: TokenView | None
                ) -> tuple[list[LocalTask], dict[str, str]]:
    """Every local task of `cfg` written into `task_dir`: the held-out files' and the bundled categories', at
    the configured levels; and the tasks not built, with the reason."""
    suite, skipped = build_local_suite(eval_paths, task_dir, cfg.choice, cfg.lines)
    suite = [t for t in suite if t.level in cfg.suite.levels]
    categories, not_built = build_category_suite(cfg.suite, task_dir, view)
    return suite + categories, {**skipped, **not_built}


def token_view(lm: LM) -> TokenView | None:
    """The model's tokenizer and context length, where the `LM` is Kiln's (the generated tasks need them)."""
    tokenizer, max_len = getattr(lm, "tokenizer", None), getattr(lm, "max_length", None)
    if tokenizer is None or not isinstance(max_len, int):
        return None
    return TokenView(lambda text: tokenizer.encode(text, add_special_tokens=False).ids, tokenizer.decode, max_len)


def item_scores(task: LocalTask, samples: Sequence[dict[str, Any]], results: dict[str, Any],
                contamination: Contamination | None) -> dict[str, Any]:
    """The task's main metric item by item, with a bootstrap 95% interval, and the score on the items not
    found in the training data (`clean_score`; the score itself when nothing was found or the task is exempt)."""
    metrics = [key.split(",", 1)[0] for key in results["results"].get(task.name, {})]
    metric = primary_metric(metrics)
    if metric is None or not samples:
        return {}
    ordered = sorted(samples, key=lambda s: s["doc_id"])
    values = [s[metric] for s in ordered]
    ids = [task.source_ids[s["doc_id"]] for s in ordered]
    contaminated = set() if contamination is None or task.eval_file is None else \
        contamination.contaminated_ids.get(task_name_for(task.eval_file), set())
    out = _summary(values, [i not in contaminated for i in ids], metric)
    out["chance"] = chance(task, ordered)
    if any(task.groups):
        groups = [task.groups[s["doc_id"]] for s in ordered]
        out["groups"] = {g: _summary([v for v, h in zip(values, groups, strict=True) if h == g],
                                     [i not in contaminated for i, h in zip(ids, groups, strict=True) if h == g], metric)
                         for g in dict.fromkeys(groups)}
    return {"metric": metric, **out}


def chance(task: LocalTask, samples: Sequence[dict[str, Any]]) -> float | None:
    """The score of guessing: one over the number of choices (a choice task), 0 (exact match, pass@1), or
    None where there is no such level (bits per byte; a bias or toxicity share, whose ideal is not a guess)."""
    if task.kind in ("choice",):
        return sum(1 / len(s["doc"]["choices"]) for s in samples) / len(samples)
    return 0.0 if task.kind in ("lines", "code_execution", "passkey_generation") else None


def _summary(values: Sequence[Any], clean_flags: Sequence[bool], metric: str) -> dict[str, Any]:
    clean = [v for v, ok in zip(values, clean_flags, strict=True) if ok]
    low, high = bootstrap_interval(values, metric)
    return {"score": aggregate(values, metric), "ci_low": low, "ci_high": high, "num_items": len(values),
            "num_clean": len(clean), "clean_score": aggregate(clean, metric) if clean else None}


def aggregate(values: Sequence[Any], metric: str) -> float:
    """A metric over items as lm-eval aggregates it: bits per byte from (log-likelihood, bytes) pairs, else the mean."""
    if metric == "bits_per_byte":
        return -sum(v[0] for v in values) / sum(v[1] for v in values) / math.log(2)
    return sum(float(v) for v in values) / len(values)


def bootstrap_interval(values: Sequence[Any], metric: str, resamples: int = 1000) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the metric over resampled items (seeded: reruns agree)."""
    import numpy as np  # defers numpy

    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(values), size=(resamples, len(values)))
    if metric == "bits_per_byte":
        pairs = np.array([[v[0], v[1]] for v in values], dtype=float)
        stats = -pairs[picks, 0].sum(1) / pairs[picks, 1].sum(1) / math.log(2)
    else:
        stats = np.array([float(v) for v in values])[picks].mean(1)
    return float(np.percentile(stats, 2.5)), float(np.percentile(stats, 97.5))


def check_wanted_tasks(tasks: Collection[str] | None, names: Sequence[str]) -> None:
    """A ConfigError naming the wanted tasks that are not among the suite's `names`."""
    unknown = sorted(set(tasks or ()) - set(names))
    if unknown:
        raise ConfigError(f"eval tasks {unknown} are not in the configured suite {list(names)}: name tasks of "
                          "evaluate.eval_files / evaluate.standard_suite (e.g. validate.capabilities.tasks)")


def _run_lm_eval(lm: LM, task_manager: Any, names: list[str], limit: int | None,
                 local: dict[str, LocalTask] | None = None) -> dict[str, Any]:
    """`lm_eval.simple_evaluate` for an `LM` object, zero-shot, with its seeds, without what it adds for
    humans: its environment report runs `torch.utils.collect_env`'s subprocesses, seconds per call, and
    continuous eval scores checkpoints one call each. Under a `limit`, each task's items are named to
    lm-eval (its `samples`): a local task's `LocalTask.selected` (stratified by group), any other's first
    `limit`."""
    import random

    import numpy as np  # defers numpy
    import torch
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED
    from lm_eval.evaluator import evaluate

    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    torch.manual_seed(DEFAULT_OTHER_SEED)
    loaded = task_manager.load(names)
    for task in loaded["tasks"].values():
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
    samples = None
    if limit is not None:
        local = local or {}
        samples = {name: (local[name].selected(limit) if name in local else list(range(min(limit, len(task.eval_docs)))))
                   for name, task in loaded["tasks"].items()}
    # Samples: each item's score, for the interval and the clean-items score (`item_scores`).
    results = evaluate(lm=lm, task_dict=loaded, samples=samples, log_samples=True)
    assert results is not None, "a single-process evaluation returns its results"
    return results


def eval_paths_of(cfg: EvaluateConfig) -> list[Path]:
    """The eval files as absolute paths (relative ones from the current directory, else Kiln's shipped
    ones: `tasks.bundled`), checked."""
    eval_paths = [locate(name).absolute() for name in cfg.eval_files]
    for name, path in zip(cfg.eval_files, eval_paths, strict=True):
        if not path.is_file():
            raise InputError(
                f"evaluate.eval_files: {name} (resolved to {path}) does not exist; "
                "fix the path (relative paths are taken from the current directory) or remove it"
            )
    task_names = [task_name_for(path) for path in eval_paths]
    if len(set(task_names)) != len(task_names):
        raise ConfigError(
            f"evaluate.eval_files: {cfg.eval_files} give duplicate task names {task_names}; "
            "each eval file needs a distinct file name"
        )
    if not task_names and not cfg.online_tasks():
        raise ConfigError("evaluate.eval_files is empty and neither evaluate.standard_suite nor evaluate.extra_tasks "
                          "names a task: give at least one")
    return eval_paths


def flatten_results(results: dict[str, Any]) -> dict[str, float | int]:
    """`{"kiln_heldout/word_perplexity": ..., "kiln_heldout/num_docs": n, "num_eval_docs": total}`."""
    flat: dict[str, float | int] = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # aliases, sample counts and "N/A" stderrs are not metrics
            metric, filter_name = key.split(",", 1)
            name = metric if filter_name == "none" else f"{metric}_{filter_name}"
            flat[f"{task}/{name}"] = float(value)
    total = 0
    for task, counts in results.get("n-samples", {}).items():
        flat[f"{task}/num_docs"] = int(counts["effective"])
        total += int(counts["effective"])
    flat["num_eval_docs"] = total
    return flat


def _json_safe(value: Any) -> Any:
    """Plain JSON: numpy scalars become Python numbers, NaN/inf become null, other objects text."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
