"""Stage `tokenize`: train the BPE tokenizer and write memory-mapped token shards per domain."""

from __future__ import annotations

from tasks.data.documents import DOCUMENTS_FILE
from tasks.data.tokenize import TokenizeConfig, tokenize_corpus
from tasks.stage import Stage, StageContext


def run(ctx: StageContext) -> dict:
    return tokenize_corpus(ctx.cfg.tokenize, ctx.inputs["decontaminate"] / DOCUMENTS_FILE, ctx.out_dir)


def headline(stats: dict) -> dict:
    return {"docs": stats["num_kept"], "tokens": stats["num_tokens"], "vocab": stats["vocab_size"],
            "bytes_per_token": stats["bytes_per_token"]}


# version 2: a document index (end offset, quality_score) beside each shard, for the anneal's quality selections
STAGE = Stage(
    name="tokenize", description="train BPE, write token shards per domain", body=run, inputs=("decontaminate",),
    config=TokenizeConfig, headline=headline, version=2,
)
