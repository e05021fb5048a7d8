"""Stage `research`: model and objective variants against the baseline, small first, then scaled.

On demand (`kiln research CONFIG`, `kiln stage research`), not part of `kiln run`. Every (variant,
scale, seed) is a sub-run keyed by its content in the store (`research_runs/<key>`), trained where
`cluster.launcher` says exactly like the sweep's trials (`tasks.scaling.trial_runs`), each an MLflow
child run of this stage's run; a rerun trains only the runs not committed yet. The decision, its
report and plots are this stage's outputs (`tasks.scaling.research`).
"""

from __future__ import annotations

import json
import math
import time

from kiln.tasks.constants import SHARDS_FILE, TOKENIZER_FILE
from kiln.tasks.errors import ConfigError
from kiln.tasks.scaling.plots import plot_research_gap, plot_research_loss
from kiln.tasks.scaling.research import (
    BASELINE,
    DECISION_FILE,
    GAP_PLOT,
    LOSS_PLOT,
    REPORT_FILE,
    RUNS_FILE,
    ResearchConfig,
    bytes_per_token_by_domain,
    chosen_runs,
    decide_study,
    resolve_study,
    run_study,
    variant_costs,
    write_report,
)
from kiln.tasks.scaling.trial_runs import JOBS_DIR, JobTrials, PoolTrials
from kiln.tasks.stage import Stage, StageContext
from kiln.tasks.train.config import ModelConfig


def production_flops(ctx: StageContext) -> float | None:
    """The compute the gap is extrapolated to: train.model on train.run's tokens when the config names
    a model, else fit.budget_flops (research.production_flops overrides both, in `resolve_study`)."""
    from kiln.tasks.train.model import count_parameters  # defers torch

    train = ctx.cfg.train
    if isinstance(train.model, ModelConfig):
        vocab = ctx.read_json("tokenize", SHARDS_FILE)["vocab_size"]
        return 6.0 * count_parameters(train.model, vocab) * train.run.steps * train.run.batch_size * train.run.seq_len
    return ctx.cfg.fit.budget_flops


def run(ctx: StageContext) -> dict:
    started = time.perf_counter()
    cfg, cluster = ctx.cfg.research, ctx.cfg.cluster
    if not cfg.variants:
        raise ConfigError("research.variants is empty: name at least one variant, e.g. research.variants: "
                          "{layernorm: {model.norm: layernorm}} (see configs/research/example.yaml)")
    config_model = ctx.cfg.train.model if isinstance(ctx.cfg.train.model, ModelConfig) else None
    study = resolve_study(cfg, ctx.cfg.sweep, config_model, production_flops(ctx))
    shards = ctx.read_json("tokenize", SHARDS_FILE)
    if cluster.launcher == "local":
        where = PoolTrials(cfg.max_parallel, cluster.max_restarts)
    else:
        where = JobTrials(cluster.launcher, cluster, cfg.max_parallel, ctx.out_dir / JOBS_DIR,
                          committed_dir=ctx.committed_dir / JOBS_DIR, on_submit=ctx.recorder.job_submitted,
                          earlier_jobs=ctx.recorder.earlier_jobs)
    runs = run_study(study, shards, ctx.inputs["tokenize"], ctx.subruns(ctx.store.root), ctx.inputs["tokenize"].name,
                     where=where)
    (ctx.out_dir / RUNS_FILE).write_text(json.dumps(
        [{"variant": r.variant, "scale": r.scale, "seed": r.seed, "lr_multiplier": r.multiplier, **vars(res)}
         for r, res in runs], indent=1))
    chosen = chosen_runs(runs)
    tokenize = ctx.inputs["tokenize"]
    decision = decide_study(study, chosen, bytes_per_token_by_domain(shards, tokenize, tokenize / TOKENIZER_FILE))
    vocab = shards["vocab_size"]
    decision["baseline"] = variant_costs(study, BASELINE, vocab, chosen)
    for name in cfg.variants:
        decision["variants"][name].update(variant_costs(study, name, vocab, chosen))
    (ctx.out_dir / DECISION_FILE).write_text(json.dumps(decision, indent=2))
    points = {}
    for name in study.variants():
        family, _ = study.family(name)
        rows = []
        for scale in study.scales:
            losses = [r.val_loss for (v, s, _), r in chosen.items() if v == name and s == study.scale_name(scale) and r.ok]
            tokens = next(r.tokens for (v, s, _), r in chosen.items() if v == name and s == study.scale_name(scale))
            params = next(r.num_params for (v, s, _), r in chosen.items() if v == name and s == study.scale_name(scale))
            if losses:
                mean = sum(losses) / len(losses)
                sd = math.sqrt(sum((x - mean) ** 2 for x in losses) / max(len(losses) - 1, 1))
                rows.append((6.0 * params * tokens, mean, sd))
        points[name] = rows
    plot_research_loss(points, ctx.out_dir / LOSS_PLOT)
    plot_research_gap(decision, ctx.out_dir / GAP_PLOT)
    write_report(study, decision, ctx.out_dir, time.perf_counter() - started)
    return {"num_runs": len(runs), "num_variants": len(cfg.variants), "noise_floor": decision["noise_floor"],
            "decisions": {n: v["decision"] for n, v in decision["variants"].items()},
            "crossovers": [n for n, v in decision["variants"].items() if v["crossover"]],
            "lr_sweep": bool(cfg.lr_sweep)}


def headline(stats: dict) -> dict:
    return {"runs": stats["num_runs"], **stats["decisions"]}


STAGE = Stage(
    name="research", description="model and objective variants against the baseline across proxy sizes and seeds",
    body=run, inputs=("tokenize",), config=ResearchConfig,
    reads=("sweep", "fit.budget_flops", "train.model", "train.run"),
    version=2, resumable=True, headline=headline, reports=(REPORT_FILE,), in_pipeline=False,
)
