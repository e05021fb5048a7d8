"""Stage `dedup-batch` (on demand, `kiln dedup-batch FILE`): deduplicate a newly delivered batch against
everything the dedup stage kept, through its persisted LSH index (no old signature is recomputed)."""

from __future__ import annotations

from pathlib import Path

from tasks.configbase import Section
from tasks.data.dedup_index import INDEX_DIR
from tasks.data.dedup_job import dedup_on_executor
from tasks.data.executors import ExecutorSettings
from tasks.errors import ConfigError, InputError
from tasks.stage import Stage, StageContext
from tasks.stages._common import document_headline


class DedupBatchConfig(Section):
    """The new batch: a jsonl file of Kiln documents (e.g. a clean stage's `documents.jsonl`)."""

    batch: str | None = None


def _batch_file(ctx: StageContext) -> Path:
    batch = ctx.cfg.dedup_batch.batch
    if batch is None:
        raise ConfigError("dedup-batch needs dedup_batch.batch=FILE (or: kiln dedup-batch FILE)")
    if not Path(batch).is_file():
        raise InputError(f"new batch {batch} does not exist (dedup_batch.batch: a jsonl file of Kiln documents)")
    return Path(batch)


def run(ctx: StageContext) -> dict:
    executor = ExecutorSettings.from_cluster(ctx.cfg.cluster, ctx.recorder.job_launched)  # the fast dedup as one job there
    return dedup_on_executor(ctx.cfg.dedup, _batch_file(ctx), ctx.out_dir, executor,
                             index_dir=ctx.inputs["dedup"] / INDEX_DIR)


STAGE = Stage(
    name="dedup-batch", description="deduplicate a new batch against the dedup stage's persisted index",
    body=run, inputs=("dedup",), config=DedupBatchConfig, reads=("dedup",),
    external_files=lambda cfg: [Path(cfg.dedup_batch.batch)] if cfg.dedup_batch.batch else [],
    headline=document_headline, in_pipeline=False,
)
