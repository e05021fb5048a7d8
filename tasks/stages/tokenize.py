"""Stage `tokenize`: train the BPE tokenizer and write memory-mapped token shards per domain."""

from __future__ import annotations

from kiln.tasks.data.tokenize import TokenizeConfig, tokenize_corpus
from kiln.tasks.stage import Stage, StageContext
from kiln.tasks.stages._common import executor_settings


def run(ctx: StageContext) -> dict:
    return tokenize_corpus(ctx.cfg.tokenize, ctx.inputs["decontaminate"], ctx.out_dir,
                           executor_settings(ctx))


def headline(stats: dict) -> dict:
    return {"docs": stats["num_kept"], "tokens": stats["num_tokens"], "vocab": stats["vocab_size"],
            "bytes_per_token": stats["bytes_per_token"]}


# version 2: a document index (end offset, quality_score) beside each shard, for the anneal's quality selections
# version 3: trained on a sample (tokenize.train_sample_bytes); a token shard per input shard, domain and split
STAGE = Stage(
    name="tokenize", description="train BPE, write token shards per domain", body=run, inputs=("decontaminate",),
    config=TokenizeConfig, headline=headline, version=3, resumable=True,
)
