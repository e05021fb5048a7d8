"""Stage `dedup`: exact and MinHash near-duplicate removal, with a persisted LSH index for later batches."""

from __future__ import annotations

from tasks.data.documents import DOCUMENTS_FILE
from tasks.data.dedup import DedupConfig
from tasks.data.dedup_job import dedup_on_executor
from tasks.data.executors import ExecutorSettings
from tasks.stage import Stage, StageContext
from tasks.stages._common import document_headline


def run(ctx: StageContext) -> dict:
    input_file = ctx.inputs["clean"] / DOCUMENTS_FILE
    executor = ExecutorSettings.from_cluster(ctx.cfg.cluster, ctx.recorder.job_launched)
    if ctx.cfg.dedup.engine == "datatrove":
        from tasks.data.dedup_datatrove import dedup_with_datatrove

        return dedup_with_datatrove(ctx.cfg.dedup, input_file, ctx.out_dir, tasks=ctx.cfg.dedup.num_workers,
                                    executor=executor)
    return dedup_on_executor(ctx.cfg.dedup, input_file, ctx.out_dir, executor)


STAGE = Stage(
    name="dedup", description="exact and MinHash near-duplicate removal", body=run, inputs=("clean",),
    config=DedupConfig, headline=document_headline,
    # A retry keeps the failed attempt's folder: the datatrove engine's finished ranks are skipped.
    resumable=True,
    # 2: removals by domain and reason (removals.json/.md/.png); kept and removed documents unchanged
    version=2,
    reports=("removals.md",),
)
