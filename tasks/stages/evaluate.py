"""Stage `evaluate`: lm-eval on the trained and the annealed model, with contamination rates."""

from __future__ import annotations

from tasks.data.tokenize import TOKENIZER_FILE
from tasks.evals.evaluate import EvaluateConfig
from tasks.stage import Stage, StageContext
from tasks.stages._common import configured_eval_files, eval_file_paths


def run(ctx: StageContext) -> dict:
    from tasks.evals.evaluate import evaluate_model  # lm-eval takes seconds to import

    eval_file_paths(ctx.cfg)
    tokenizer = ctx.inputs["tokenize"] / TOKENIZER_FILE
    rates = ctx.read_json("decontaminate", "contamination_rates.json")
    results = {}
    for name in ("anneal", "train"):
        out = ctx.out_dir / name
        out.mkdir()
        results[name] = evaluate_model(ctx.cfg.evaluate, ctx.inputs[name] / "model", tokenizer, out,
                                       contamination_rates=rates)
    return {"metrics": results}


def headline(stats: dict) -> dict:
    return {f"{model}/{metric.split('/')[-1]}": round(value, 4)
            for model, metrics in stats["metrics"].items() for metric, value in metrics.items()
            if metric.endswith(("byte_perplexity", "bits_per_byte", "contamination_rate")) and isinstance(value, float)}


STAGE = Stage(
    name="evaluate", description="lm-eval on held-out text", body=run,
    inputs=("anneal", "train", "tokenize", "decontaminate"), config=EvaluateConfig,
    external_files=configured_eval_files, headline=headline,
)
