"""Stage `mix`: the mixture manifest (weights, token budgets, epochs, shard lists) the training loader reads."""

from __future__ import annotations

import json

from kiln.tasks.constants import SHARDS_FILE
from kiln.tasks.scaling.fit import PLAN_FILE
from kiln.tasks.scaling.mix import MIXTURE_FILE, MixConfig, build_mixture_manifest
from kiln.tasks.stage import Stage, StageContext
from kiln.tasks.stages.train import planned_run


def run(ctx: StageContext) -> dict:

    tokenized = ctx.inputs["tokenize"]
    plan = ctx.read_json("fit", PLAN_FILE)
    _, run_cfg, _ = planned_run(ctx)  # the train stage's budget: the plan's under train.model: plan
    train_tokens = run_cfg.steps * run_cfg.batch_size * run_cfg.seq_len
    manifest = build_mixture_manifest(ctx.cfg.mix, ctx.read_json("tokenize", SHARDS_FILE),
                                      tokenized.relative_to(ctx.store.root).as_posix(),
                                      plan["mixture"]["weights"], train_tokens, run_cfg.seq_len)
    (ctx.out_dir / MIXTURE_FILE).write_text(json.dumps(manifest, indent=2))
    domains = manifest["domains"]
    return {"mixture": plan["mixture"]["name"], "train_tokens": train_tokens,
            "weights": {d: v["weight"] for d, v in domains.items()},
            "epochs": {d: v["epochs"] for d, v in domains.items()}}


STAGE = Stage(
    name="mix", description="write the mixture manifest", body=run, inputs=("tokenize", "fit"), config=MixConfig,
    reads=("train.run_identity", "train.model"),  # the train budget: the plan's, or what train.run sets
    headline=lambda s: {"mixture": s["mixture"], "train_tokens": s["train_tokens"], "max_epochs": max(s["epochs"].values())},
)
