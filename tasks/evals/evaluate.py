"""The evaluate stage: runs lm-eval on a trained Kiln model through Kiln's own adapter.

Held-out JSON-lines files become local perplexity tasks that run fully offline. Built-in
lm-eval tasks named in `extra_tasks` (e.g. `hellaswag`) download their data from the
Hugging Face hub, so they work only on a machine that is online; offline they fail with
lm-eval's `OfflineModeIsEnabled`/connection error.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from tasks.configbase import Section, runtime_field
from tasks.errors import ConfigError, InputError
from tasks.evals.heldout_task import HF_CACHE_DIR, task_name_for, write_heldout_task

if TYPE_CHECKING:
    from lm_eval.api.model import LM

RESULTS_FILE = "results.json"
TASKS_DIR = "tasks"
# The parts of lm-eval's results that depend only on the model and the data: its timing,
# date, git hash and model-argument fields would make reruns differ.
_DETERMINISTIC_KEYS = (
    "results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples",
)


class EvaluateConfig(Section):
    eval_files: list[str] = ["data/evals/heldout.jsonl"]
    # Evaluate only the first `limit` documents of each task (for quick checks).
    limit: int | None = Field(None, gt=0)
    # Built-in lm-eval task names; these fetch data from the hub and so need a network.
    extra_tasks: list[str] = []
    batch_size: int = runtime_field(8, gt=0)


def evaluate_model(
    cfg: EvaluateConfig,
    model_dir: Path,
    tokenizer_path: Path,
    out_dir: Path,
    *,
    contamination_rates: dict[str, float] | None = None,
) -> dict:
    """Evaluate the model in `model_dir`; writes `tasks/` and `results.json` into `out_dir`.

    Returns flat metrics `{"<task>/<metric>": value, ..., "num_eval_docs": n}`. Given the
    decontaminate stage's `{task: rate}`, each task's contamination rate is recorded beside its
    score as `"<task>/contamination_rate"` (and under `contamination_rates` in results.json).
    """
    from tasks.evals.adapter import KilnLM

    # Check the inputs before paying for loading the model.
    eval_paths = _eval_paths(cfg)
    lm = KilnLM.from_dirs(model_dir, tokenizer_path, batch_size=cfg.batch_size)
    return evaluate_lm(cfg, lm, out_dir, eval_paths, contamination_rates=contamination_rates)


def evaluate_lm(
    cfg: EvaluateConfig,
    lm: LM,
    out_dir: Path,
    eval_paths: list[Path] | None = None,
    *,
    contamination_rates: dict[str, float] | None = None,
) -> dict:
    """`evaluate_model` for a model already wrapped in an lm-eval `LM` (e.g. `KilnLM`)."""
    # Imported here: lm-eval takes seconds to import and only this stage needs it.
    import lm_eval
    from lm_eval.tasks import TaskManager

    eval_paths = _eval_paths(cfg) if eval_paths is None else eval_paths
    task_names = [task_name_for(path) for path in eval_paths]
    task_dir = out_dir / TASKS_DIR
    for path, task_name in zip(eval_paths, task_names, strict=True):
        write_heldout_task(path, task_dir, task_name)

    task_manager = TaskManager(include_path=str(task_dir), include_defaults=bool(cfg.extra_tasks))
    unknown = [name for name in cfg.extra_tasks if name not in task_manager.all_tasks]
    if unknown:
        raise ConfigError(f"evaluate.extra_tasks: {unknown} are not lm-eval tasks; see `lm_eval ls tasks`")

    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=task_names + list(cfg.extra_tasks),
        task_manager=task_manager,
        limit=cfg.limit,
        log_samples=False,
    )
    # The dataset cache is a copy of the documents already beside the task files.
    shutil.rmtree(task_dir / HF_CACHE_DIR, ignore_errors=True)
    kept = {key: results[key] for key in _DETERMINISTIC_KEYS if key in results}
    if contamination_rates is not None:
        kept["contamination_rates"] = dict(contamination_rates)
    (out_dir / RESULTS_FILE).write_text(json.dumps(_json_safe(kept), indent=2, sort_keys=True), encoding="utf-8")
    flat = flatten_results(kept)
    for task, rate in (contamination_rates or {}).items():
        flat[f"{task}/contamination_rate"] = float(rate)
    return flat


def _eval_paths(cfg: EvaluateConfig) -> list[Path]:
    """The eval files as absolute paths (relative ones from the current directory), checked."""
    eval_paths = [Path(name).absolute() for name in cfg.eval_files]
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
    if not task_names and not cfg.extra_tasks:
        raise ConfigError("evaluate.eval_files and evaluate.extra_tasks are both empty: name at least one")
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
