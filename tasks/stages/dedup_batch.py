"""Stage `dedup-batch` (on demand, `kiln dedup-batch PATH`): deduplicate a newly delivered batch against
everything the dedup stage kept, through its persisted LSH index (no old signature is recomputed)."""

from __future__ import annotations

from pathlib import Path

from kiln.tasks.configbase import Section
from kiln.tasks.data.dedup_index import INDEX_DIR
from kiln.tasks.data.dedup_job import dedup_documents
from kiln.tasks.data.shards import document_files
from kiln.tasks.errors import ConfigError, InputError
from kiln.tasks.stage import Stage, StageContext
from kiln.tasks.stages._common import document_headline, executor_settings


class DedupBatchConfig(Section):
    """The new batch: a folder of Kiln document shards (e.g. a clean stage's output folder, or any folder
    of `.jsonl` / `.jsonl.zst` files), or one such file."""

    batch: str | None = None


def _batch_files(ctx: StageContext) -> list[Path]:
    batch = ctx.cfg.dedup_batch.batch
    if batch is None:
        raise ConfigError("dedup-batch needs dedup_batch.batch=PATH (or: kiln dedup-batch PATH)")
    if not Path(batch).exists():
        raise InputError(f"new batch {batch} does not exist (dedup_batch.batch: a folder of Kiln document shards "
                         "or a jsonl file of Kiln documents)")
    return document_files(Path(batch))


def run(ctx: StageContext) -> dict:
    executor = executor_settings(ctx)  # a task per shard there
    return dedup_documents(ctx.cfg.dedup, _batch_files(ctx), ctx.out_dir, executor,
                           index_dir=ctx.inputs["dedup"] / INDEX_DIR)


STAGE = Stage(
    name="dedup-batch", description="deduplicate a new batch against the dedup stage's persisted index",
    body=run, inputs=("dedup",), config=DedupBatchConfig, reads=("dedup",),
    external_files=lambda cfg: [Path(cfg.dedup_batch.batch)] if cfg.dedup_batch.batch else [],
    headline=document_headline, in_pipeline=False, resumable=True,
    version=2,  # 2: the batch may be a folder of shards; documents and removed records as shards
)
