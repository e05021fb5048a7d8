"""Stage `anneal-ablation`: short anneals from one train checkpoint, one per candidate high-quality
mixture, each scored by the evaluate suite, and a report of which candidate helps most.

Each candidate is a sub-run, `branches/<name>/`: the anneal stage's own run (`anneal_into`) and its
evaluation, with its manifest and MLflow child run; the start model's evaluation is one too
(`baseline/start/`), so every change is against the weights all candidates began from. Candidates are
ranked by the mean change of their bits per byte over the suite's perplexity tasks: on the few steps
an ablation affords, perplexity moves measurably where accuracies over a few items are noise. A
crashed attempt resumes as any stage does: committed sub-runs are reused, a branch that was training
resumes from its checkpoints.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from kiln.tasks.constants import TOKENIZER_FILE
from kiln.tasks.data.decontaminate import read_contamination
from kiln.tasks.evals.evaluate import RESULTS_FILE, evaluate_model
from kiln.tasks.evals.report import report_markdown, report_rows
from kiln.tasks.ledger import SubRun
from kiln.tasks.stage import Stage, StageContext
from kiln.tasks.stages._common import eval_file_paths, suite_eval_files
from kiln.tasks.stages.anneal import anneal_into, start_model
from kiln.tasks.train.anneal import AnnealAblationConfig

BRANCHES_DIR = "branches"
BASELINE_DIR = "baseline"  # baseline/start/: the start model's evaluation
START = "start"  # the report's baseline: the model every candidate starts from
REPORT_FILE = "ablation.md"
SUMMARY_FILE = "ablation.json"
METRICS_FILE = "metrics.json"  # beside each evaluation's results.json: the flat scores
RANK_METRIC = "bits_per_byte"


def _evaluate(ctx: StageContext, model_dir: Path, out: Path, contamination: Any) -> dict[str, float]:
    """The suite on the model in `model_dir`, its results and flat metrics written in `out`; the metrics."""

    out.mkdir(parents=True, exist_ok=True)
    metrics = evaluate_model(ctx.cfg.evaluate, model_dir, ctx.inputs["tokenize"] / TOKENIZER_FILE, out,
                             contamination=contamination)
    (out / METRICS_FILE).write_text(json.dumps(metrics, indent=1) + "\n", encoding="utf-8")
    return metrics


def _results(folder: Path) -> dict[str, Any]:
    return json.loads((folder / RESULTS_FILE).read_text(encoding="utf-8"))


def _branch(ctx: StageContext, cfg: AnnealAblationConfig, name: str, start: Any, contamination: Any) -> dict[str, Any]:
    """One candidate's anneal and evaluation, in its sub-run folder (ctx.out_dir); its summary."""
    stats = anneal_into(ctx, cfg.anneal_config(cfg.candidates[name]), start, f"anneal_ablation.candidates.{name}")
    _evaluate(ctx, ctx.out_dir / "model", ctx.out_dir / "eval", contamination)
    return {"mixture": cfg.model_dump(mode="json")["candidates"][name], "val_loss": stats["val_loss"],
            "final_train_loss": stats["final_train_loss"], "quality_selections": stats["quality_selections"],
            "num_accelerators": stats["num_accelerators"]}


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
        subruns = ctx.subruns()
        baseline = subruns.run(SubRun(BASELINE_DIR, START, {"from_step": start.step}),
                               lambda folder, _: _evaluate(ctx, start.model_dir, folder, contamination))
        results = {START: _results(baseline.path)}
        for name in cfg.candidates:
            identity = {"from_step": start.step, "anneal": cfg.anneal_config(cfg.candidates[name]).model_dump(mode="json")}
            branch = subruns.run(SubRun(BRANCHES_DIR, name, identity, params={"from_step": start.step}),
                                 lambda folder, recorder: _branch(replace(ctx, out_dir=folder, recorder=recorder), cfg,
                                                                  name, start, contamination))
            if branch.status == "ran":
                num_accelerators = max(num_accelerators, branch.stats["num_accelerators"])
            summary["candidates"][name] = {k: v for k, v in branch.stats.items() if k != "num_accelerators"}
            results[name] = _results(branch.path / "eval")
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
    reads=("evaluate",), external_files=suite_eval_files, resumable=True, headline=headline,
    # 2: each branch, and the start model's evaluation (baseline/start/), a sub-run with its manifest
    reports=(REPORT_FILE,), version=2,
)
