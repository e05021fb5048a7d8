"""Stage `anneal-ablation`: short anneals from one train checkpoint, one per candidate high-quality
mixture, each scored by the evaluate suite, and a report of which candidate helps most.

Each candidate is the anneal stage's own run (`anneal_into`) in `branches/<name>/`, its metrics
logged under `<name>/` in the stage's MLflow run; the start model is scored too, so every change is
against the weights all candidates began from. Candidates are ranked by the mean change of their
bits per byte over the suite's perplexity tasks: on the few steps an ablation affords, perplexity
moves measurably where accuracies over a few items are noise. A crashed attempt resumes: a finished
branch (its `branch.json` written) is not run again, one that was training resumes from its checkpoints.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from tasks.data.tokenize import TOKENIZER_FILE
from tasks.evals.evaluate import RESULTS_FILE
from tasks.evals.report import report_markdown, report_rows
from tasks.runner import StageRecorder
from tasks.stage import Stage, StageContext
from tasks.stages._common import configured_eval_files, eval_file_paths
from tasks.stages.anneal import anneal_into, start_model
from tasks.train.anneal import AnnealAblationConfig

BRANCHES_DIR = "branches"
START = "start"  # the report's baseline: the model every candidate starts from
REPORT_FILE = "ablation.md"
SUMMARY_FILE = "ablation.json"
METRICS_FILE = "metrics.json"  # beside each evaluation's results.json: the flat scores
BRANCH_FILE = "branch.json"  # a finished branch: its mixture, losses and quality selections
RANK_METRIC = "bits_per_byte"


class BranchRecorder(StageRecorder):
    """The stage's recorder, with one candidate's training metrics and settings under `<name>/` and its
    anneal's forecast in the stage's, as `branches/<name>` (the stage's forecast is the sum over its anneals)."""

    def __init__(self, parent: StageRecorder, name: str) -> None:
        super().__init__(parent.tracker, parent.run_id, parent.stage, parent.key, parent._on_event)
        self.parent, self.name, self.prefix = parent, name, f"{name}/"

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        super().metrics(step, {self.prefix + key: value for key, value in metrics.items()})

    def record_forecast(self, forecast: dict[str, Any], run: str | None = None) -> None:
        self.parent.record_forecast(forecast, run or f"{BRANCHES_DIR}/{self.name}")

    def used(self, settings: dict[str, Any], run: str | None = None) -> None:
        super().used(settings, run or self.name)


def _evaluate(ctx: StageContext, model_dir: Path, out: Path, contamination: Any) -> dict[str, Any]:
    """The suite's results for the model in `model_dir`, written in `out` with its flat metrics (read
    back when a previous attempt wrote them: the metrics file is written last)."""
    from tasks.evals.evaluate import evaluate_model  # lm-eval takes seconds to import

    if not (out / METRICS_FILE).is_file():
        out.mkdir(parents=True, exist_ok=True)
        metrics = evaluate_model(ctx.cfg.evaluate, model_dir, ctx.inputs["tokenize"] / TOKENIZER_FILE, out,
                                 contamination=contamination)
        (out / METRICS_FILE).write_text(json.dumps(metrics, indent=1) + "\n", encoding="utf-8")
    return json.loads((out / RESULTS_FILE).read_text(encoding="utf-8"))


def ablation_results(ablation_dir: Path) -> dict[str, dict[str, Any]]:
    """Each branch of a committed ablation output as `ablation/<name>`: its flat metrics and lm-eval
    results (what the evaluate stage's report adds as columns); empty when it ran no candidates."""
    summary = json.loads((ablation_dir / SUMMARY_FILE).read_text(encoding="utf-8"))
    out = {}
    for name in summary["candidates"]:
        folder = ablation_dir / BRANCHES_DIR / name / "eval"
        out[f"ablation/{name}"] = {"metrics": json.loads((folder / METRICS_FILE).read_text(encoding="utf-8")),
                                   "results": json.loads((folder / RESULTS_FILE).read_text(encoding="utf-8"))}
    return out


def rank_candidates(rows: list[dict[str, Any]], candidates: list[str]) -> dict[str, float | None]:
    """Each candidate's mean change in bits per byte against the start over the perplexity tasks
    (negative: better), best first; None for a candidate with no such score."""
    def mean_change(name: str) -> float | None:
        changes = [r[f"{name} - {START}"] for r in rows if r["metric"] == RANK_METRIC and r[f"{name} - {START}"] is not None]
        return sum(changes) / len(changes) if changes else None

    scores = {name: mean_change(name) for name in candidates}
    return dict(sorted(scores.items(), key=lambda item: (item[1] is None, item[1] or 0.0)))


def summary_markdown(summary: dict[str, Any], table: str) -> str:
    if not summary["candidates"]:
        return ("# Anneal ablation\n\nNo candidates (`anneal_ablation.candidates` is empty): nothing was run. Name "
                "candidate mixtures there to compare short anneals from one train checkpoint.\n")
    lines = ["# Anneal ablation", "",
             f"{len(summary['candidates'])} anneals of {summary['steps']} steps ({summary['schedule']}) from train step "
             f"{summary['from_step']}, ranked by the mean change in bits per byte over the perplexity tasks "
             "against the start model (lower is better).", "",
             "| candidate | mean Δ bits per byte | val loss | mixture |", "|---|---:|---:|---|"]
    for name, change in summary["ranking"].items():
        info = summary["candidates"][name]
        lines.append(f"| {name} | {'–' if change is None else f'{change:+.4f}'} | {info['val_loss']:.4f} | "
                     f"`{json.dumps(info['mixture'])}` |")
    best = summary["best"]
    lines += ["", f"**Best: `{best}`** ({summary['ranking'][best]:+.4f} bits per byte)." if best else
              "**No candidate has a bits-per-byte score to rank by.**", ""]
    return "\n".join(lines) + "\n" + table.replace("# Evaluation\n", "## Scores\n", 1)


def run(ctx: StageContext) -> dict:
    from tasks.data.decontaminate import read_contamination

    cfg: AnnealAblationConfig = ctx.cfg.anneal_ablation
    summary: dict[str, Any] = {"candidates": {}, "ranking": {}, "best": None, "steps": cfg.steps,
                               "schedule": cfg.schedule, "from_step": None}
    table = ""
    num_accelerators = 0  # held by the anneals this attempt trains: the runner prices the stage's wall time by it
    if cfg.candidates:
        eval_file_paths(ctx.cfg)
        contamination = read_contamination(ctx.inputs["decontaminate"])
        start = start_model(ctx, cfg.from_step, "anneal_ablation.from_step")
        summary["from_step"] = start.step
        results = {START: _evaluate(ctx, start.model_dir, ctx.out_dir / START, contamination)}
        for name, mixture in cfg.candidates.items():
            branch = ctx.out_dir / BRANCHES_DIR / name
            if not (branch / BRANCH_FILE).is_file():  # written last: an earlier attempt finished this branch
                branch.mkdir(parents=True, exist_ok=True)
                branch_ctx = replace(ctx, out_dir=branch, recorder=BranchRecorder(ctx.recorder, name))
                stats = anneal_into(branch_ctx, cfg.anneal_config(mixture), start, f"anneal_ablation.candidates.{name}")
                num_accelerators = max(num_accelerators, stats["num_accelerators"])
                _evaluate(ctx, branch / "model", branch / "eval", contamination)
                info = {"mixture": cfg.model_dump(mode="json")["candidates"][name], "val_loss": stats["val_loss"],
                        "final_train_loss": stats["final_train_loss"], "quality_selections": stats["quality_selections"]}
                (branch / BRANCH_FILE).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
            summary["candidates"][name] = json.loads((branch / BRANCH_FILE).read_text(encoding="utf-8"))
            results[name] = json.loads((branch / "eval" / RESULTS_FILE).read_text(encoding="utf-8"))
        rows = report_rows(results, START)
        summary["ranking"] = rank_candidates(rows, list(cfg.candidates))
        summary["best"] = next((n for n, change in summary["ranking"].items() if change is not None), None)
        summary["rows"] = rows
        table = report_markdown(rows, list(results), START)
    (ctx.out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    (ctx.out_dir / REPORT_FILE).write_text(summary_markdown(summary, table), encoding="utf-8")
    return {key: summary[key] for key in ("best", "ranking", "from_step", "steps")} | {
        "candidates": {name: {k: v for k, v in info.items() if k != "mixture"}
                       for name, info in summary["candidates"].items()}, "num_accelerators": num_accelerators}


def headline(stats: dict[str, Any]) -> dict[str, Any]:
    if not stats["ranking"]:
        return {"candidates": 0}
    best = stats["best"]
    return {"candidates": len(stats["ranking"]), "best": best or "–",
            **({"best_bpb_change": round(stats["ranking"][best], 4)} if best else {})}


STAGE = Stage(
    name="anneal-ablation", description="short anneals of candidate mixtures from one checkpoint, evaluated",
    body=run, inputs=("train", "tokenize", "fit", "decontaminate"), config=AnnealAblationConfig,
    reads=("evaluate",), external_files=configured_eval_files, resumable=True, headline=headline,
    reports=(REPORT_FILE,),
)
