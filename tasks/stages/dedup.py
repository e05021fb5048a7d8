"""Stage `dedup`: exact and MinHash near-duplicate removal, with a persisted LSH index for later batches."""

from __future__ import annotations

from kiln.tasks.data.dedup import DedupConfig
from kiln.tasks.data.dedup_datatrove import dedup_with_datatrove
from kiln.tasks.data.dedup_job import dedup_documents
from kiln.tasks.data.shards import shard_paths
from kiln.tasks.stage import Stage, StageContext
from kiln.tasks.stages._common import document_headline, executor_settings


def run(ctx: StageContext) -> dict:
    inputs = shard_paths(ctx.inputs["clean"])
    executor = executor_settings(ctx)
    if ctx.cfg.dedup.engine == "datatrove":

        return dedup_with_datatrove(ctx.cfg.dedup, inputs, ctx.out_dir, tasks=ctx.cfg.dedup.num_workers,
                                    executor=executor)
    return dedup_documents(ctx.cfg.dedup, inputs, ctx.out_dir, executor)


STAGE = Stage(
    name="dedup", description="exact and MinHash near-duplicate removal", body=run, inputs=("clean",),
    config=DedupConfig, headline=document_headline,
    # A retry keeps the failed attempt's folder: the ranks its jobs finished are skipped.
    resumable=True,
    # 2: removals by domain and reason (removals.json/.md/.png); kept and removed documents unchanged
    # 3: documents and removed records as shards, signatures and writing a task per shard
    version=3,
    reports=("removals.md",),
)
