"""Stage bodies: how each stage maps the config and its inputs in the store onto the work.

Plain Python (no Prefect, no MLflow): a body reads its inputs' folders, calls the domain
functions, writes into `ctx.out_dir` and returns its stats. Flows wrap these with
orchestration and tracking; a Slurm job or a notebook can call them directly.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.config import KilnConfig
from tasks.data.clean import clean_documents
from tasks.data.collect import collect_documents
from tasks.data.decontaminate import decontaminate_documents
from tasks.data.dedup import dedup_documents
from tasks.data.documents import DOCUMENTS_FILE
from tasks.data.tokenize import SHARDS_FILE, TOKENIZER_FILE, tokenize_corpus
from tasks.errors import InputError
from tasks.scaling.fit import PLAN_FILE, PLOT_FILE, fit_plan, plot_plan
from tasks.scaling.mix import MIXTURE_FILE, build_mixture_manifest
from tasks.scaling.sweep import TRIALS_FILE, TrialResult, load_trials, mixture_with_weights, run_sweep
from tasks.scaling.validate import REPORT_FILE, ValidationGateError, check_gate
from tasks.train.anneal import anneal_settings
from tasks.train.data_loader import Mixture
from tasks.train.loop import TrainResult, train_model
from tasks.train.model import count_parameters

Metrics = Callable[[int, dict[str, float]], None]


@dataclass
class StageContext:
    """Where a stage body writes, what it reads, and where it reports progress."""

    out_dir: Path
    inputs: dict[str, Path]
    store_root: Path
    on_metrics: Metrics | None = None
    on_trial: Callable[[TrialResult], None] | None = None
    on_event: Callable[[dict[str, Any]], None] | None = None  # training health events (rollbacks, aborts)
    extras: dict[str, Any] = field(default_factory=dict)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def _train_headline(result: TrainResult) -> dict[str, Any]:
    return {"steps": result.steps, "tokens": result.tokens_seen, "params": result.num_params,
            "train_loss": round(result.final_train_loss, 4), "val_loss": round(result.val_loss, 4)}


def _train_stats(result: TrainResult, **extra: Any) -> dict[str, Any]:
    return {"headline": _train_headline(result), "steps": result.steps, "tokens_seen": result.tokens_seen,
            "num_params": result.num_params, "final_train_loss": result.final_train_loss, "val_loss": result.val_loss,
            "val_loss_by_domain": result.val_loss_by_domain, "tokens_per_s": result.tokens_per_s,
            "resumed_from_step": result.resumed_from_step, "num_rollbacks": result.num_rollbacks, **extra}


def _doc_headline(stats: dict[str, Any]) -> dict[str, Any]:
    return {"docs_in": stats["num_in"], "kept": stats["num_kept"], "removed": stats["num_removed"],
            "quarantined": stats["num_quarantined"]}


def run_collect(cfg: KilnConfig, ctx: StageContext) -> dict[str, Any]:
    stats = collect_documents(cfg.collect, ctx.out_dir)
    return {"headline": _doc_headline(stats), **stats}


def run_clean(cfg: KilnConfig, ctx: StageContext) -> dict[str, Any]:
    stats = clean_documents(cfg.clean, ctx.inputs["collect"] / DOCUMENTS_FILE, ctx.out_dir)
    return {"headline": _doc_headline(stats), **stats}


def run_dedup(cfg: KilnConfig, ctx: StageContext) -> dict[str, Any]:
    input_file = ctx.inputs["clean"] / DOCUMENTS_FILE
    if cfg.dedup.engine == "datatrove":
        from tasks.data.dedup_datatrove import dedup_with_datatrove

        options = {"partition": cfg.cluster.partition, "time": cfg.cluster.time_limit} if cfg.cluster.executor == "slurm" else None
        stats = dedup_with_datatrove(cfg.dedup, input_file, ctx.out_dir, executor=cfg.cluster.executor,
                                     tasks=cfg.dedup.num_workers, executor_options=options)
    else:
        stats = dedup_documents(cfg.dedup, input_file, ctx.out_dir)
    return {"headline": _doc_headline(stats), **stats}


def eval_file_paths(cfg: KilnConfig) -> list[Path]:
    paths = [Path(p) for p in cfg.evaluate.eval_files]
    for i, path in enumerate(paths):
        if not path.is_file():
            raise InputError(f"eval file {path} does not exist (config key evaluate.eval_files[{i}]); "
                             "fix the path or remove the entry")
    return paths


def run_decontaminate(cfg: KilnConfig, ctx: StageContext) -> dict[str, Any]:
    stats = decontaminate_documents(cfg.decontaminate, ctx.inputs["dedup"] / DOCUMENTS_FILE,
                                    eval_file_paths(cfg), ctx.out_dir, eval_tasks=cfg.evaluate.extra_tasks)
    return {"headline": _doc_headline(stats), **stats}


def run_tokenize(cfg: KilnConfig, ctx: StageContext) -> dict[str, Any]:
    stats = tokenize_corpus(cfg.tokenize, ctx.inputs["decontaminate"] / DOCUMENTS_FILE, ctx.out_dir)
    headline = {"docs": stats["num_kept"], "tokens": stats["num_tokens"], "vocab": stats["vocab_size"],
                "bytes_per_token": stats["bytes_per_token"]}
    return {"headline": headline, **stats}


def run_sweep_stage(cfg: KilnConfig, ctx: StageContext) -> dict[str, Any]:
    tokenized = ctx.inputs["tokenize"]
    results = run_sweep(cfg.sweep, _read_json(tokenized / SHARDS_FILE), tokenized, ctx.out_dir, ctx.on_trial)
    best = min(results, key=lambda r: r.val_loss)
    return {"headline": {"trials": len(results), "best": best.name, "best_val_loss": round(best.val_loss, 4)},
            "num_trials": len(results), "best_trial": best.name, "best_val_loss": best.val_loss,
            "trial_val_loss": {r.name: r.val_loss for r in results}}


def run_fit(cfg: KilnConfig, ctx: StageContext) -> dict[str, Any]:
    trials = load_trials(ctx.inputs["sweep"] / TRIALS_FILE)
    targets = {"validate": count_parameters(cfg.validate_.model, 0)}  # non-embedding N, as the sweep's points
    plan = fit_plan(cfg.fit, trials, cfg.sweep.model.d_model, cfg.sweep.mixtures, targets)
    (ctx.out_dir / PLAN_FILE).write_text(json.dumps(plan, indent=2))
    plot_plan(plan, trials, ctx.out_dir / PLOT_FILE)
    headline = {"lr": plan["lr"], "mixture": plan["mixture"]["name"]}
    if plan["predictions"]:
        headline["predicted_val_loss"] = round(plan["predictions"]["validate"]["loss"], 4)
    return {"headline": headline, "plan": plan}


def run_mix(cfg: KilnConfig, ctx: StageContext) -> dict[str, Any]:
    tokenized = ctx.inputs["tokenize"]
    plan = _read_json(ctx.inputs["fit"] / PLAN_FILE)
    run = cfg.train.run
    train_tokens = run.steps * run.batch_size * run.seq_len * run.grad_accum
    manifest = build_mixture_manifest(cfg.mix, _read_json(tokenized / SHARDS_FILE),
                                      tokenized.relative_to(ctx.store_root).as_posix(),
                                      plan["mixture"]["weights"], train_tokens, run.seq_len)
    (ctx.out_dir / MIXTURE_FILE).write_text(json.dumps(manifest, indent=2))
    domains = manifest["domains"]
    return {"headline": {"mixture": plan["mixture"]["name"], "train_tokens": train_tokens,
                         "max_epochs": max(d["epochs"] for d in domains.values())},
            "weights": {d: v["weight"] for d, v in domains.items()},
            "epochs": {d: v["epochs"] for d, v in domains.items()}}


def _plan_mixture(ctx: StageContext) -> Mixture:
    return Mixture.from_manifest(ctx.inputs["mix"] / MIXTURE_FILE, ctx.store_root)


def run_validate(cfg: KilnConfig, ctx: StageContext) -> dict[str, Any]:
    plan = _read_json(ctx.inputs["fit"] / PLAN_FILE)
    optim = cfg.sweep.optim.model_copy(update={"lr": plan["lr"]})
    result = train_model(cfg.validate_.model, optim, cfg.sweep.run, _plan_mixture(ctx), ctx.out_dir,
                         on_metrics=ctx.on_metrics, on_event=ctx.on_event)
    predicted = plan["predictions"].get("validate")
    report = check_gate(result.val_loss, result.loss_curve, predicted)
    (ctx.out_dir / REPORT_FILE).write_text(json.dumps(report.as_dict(), indent=2))
    if predicted:
        plan["predictions"]["validate"]["observed"] = result.val_loss
        plot_plan(plan, load_trials(ctx.inputs["sweep"] / TRIALS_FILE), ctx.out_dir / PLOT_FILE)
    if not report.passed and cfg.validate_.enforce:
        raise ValidationGateError(report.describe())
    return _train_stats(result, gate=report.as_dict(), gate_passed=report.passed)


def run_train(cfg: KilnConfig, ctx: StageContext) -> dict[str, Any]:
    plan = _read_json(ctx.inputs["fit"] / PLAN_FILE)
    lr = cfg.train.lr_override or plan["lr"]
    if cfg.train.parallel.world_size > 1:
        from tasks.train.torchrun_stage import train_with_torchrun

        result = train_with_torchrun(cfg.train.model, cfg.train.optim.model_copy(update={"lr": lr}), cfg.train.run,
                                     cfg.train.parallel, cfg.cluster, ctx.inputs["mix"] / MIXTURE_FILE,
                                     ctx.store_root, ctx.out_dir, on_metrics=ctx.on_metrics, on_event=ctx.on_event)
        restarts = sum(e["kind"] == "process_failure" for e in result.health_events)
        return _train_stats(result, lr=lr, world_size=cfg.train.parallel.world_size,
                            num_restarts=restarts)
    result = train_model(cfg.train.model, cfg.train.optim.model_copy(update={"lr": lr}), cfg.train.run,
                         _plan_mixture(ctx), ctx.out_dir, on_metrics=ctx.on_metrics, on_event=ctx.on_event)
    return _train_stats(result, lr=lr)


def run_anneal(cfg: KilnConfig, ctx: StageContext) -> dict[str, Any]:
    plan = _read_json(ctx.inputs["fit"] / PLAN_FILE)
    lr = cfg.train.lr_override or plan["lr"]
    optim, run = anneal_settings(cfg.anneal, cfg.train.optim, cfg.train.run, lr)
    tokenized = ctx.inputs["tokenize"]
    mixture = mixture_with_weights(_read_json(tokenized / SHARDS_FILE), tokenized, cfg.anneal.mixture, "anneal.mixture")
    result = train_model(cfg.train.model, optim, run, mixture, ctx.out_dir,
                         init_model_dir=ctx.inputs["train"] / "model", on_metrics=ctx.on_metrics, on_event=ctx.on_event)
    before = _read_json(ctx.inputs["train"] / "metrics.json")["val_loss"]
    stats = _train_stats(result, start_lr=optim.lr, val_loss_before=before)
    stats["headline"]["val_loss_before"] = round(before, 4)
    return stats


def run_evaluate(cfg: KilnConfig, ctx: StageContext) -> dict[str, Any]:
    from tasks.evals.evaluate import evaluate_model

    eval_file_paths(cfg)
    tokenizer = ctx.inputs["tokenize"] / TOKENIZER_FILE
    rates = _read_json(ctx.inputs["decontaminate"] / "contamination_rates.json")
    results = {}
    for name in ("anneal", "train"):
        out = ctx.out_dir / name
        out.mkdir()
        results[name] = evaluate_model(cfg.evaluate, ctx.inputs[name] / "model", tokenizer, out,
                                       contamination_rates=rates)
    headline = {f"{model}/{metric.split('/')[-1]}": round(value, 4)
                for model, metrics in results.items() for metric, value in metrics.items()
                if metric.endswith(("byte_perplexity", "bits_per_byte", "contamination_rate")) and isinstance(value, float)}
    return {"headline": headline, "metrics": results}


STAGE_BODIES: dict[str, Callable[[KilnConfig, StageContext], dict[str, Any]]] = {
    "collect": run_collect,
    "clean": run_clean,
    "dedup": run_dedup,
    "decontaminate": run_decontaminate,
    "tokenize": run_tokenize,
    "sweep": run_sweep_stage,
    "fit": run_fit,
    "mix": run_mix,
    "validate": run_validate,
    "train": run_train,
    "anneal": run_anneal,
    "evaluate": run_evaluate,
}
