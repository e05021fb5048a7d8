"""Stage `decontaminate`: remove training documents whose n-grams overlap the eval suite."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kiln.tasks.data.decontaminate import DecontaminateConfig, decontaminate_documents
from kiln.tasks.data.shards import shard_paths
from kiln.tasks.stage import Stage, StageContext
from kiln.tasks.stages._common import document_headline, eval_file_paths, executor_settings, suite_eval_files

if TYPE_CHECKING:
    from kiln.tasks.settings import KilnConfig


def run(ctx: StageContext) -> dict:
    evals = eval_file_paths(ctx.cfg)  # first: a config naming a missing eval file is told so before any input is read
    return decontaminate_documents(ctx.cfg.decontaminate, shard_paths(ctx.inputs["dedup"]), evals,
                                   ctx.out_dir, eval_tasks=ctx.cfg.evaluate.online_tasks(),
                                   executor=executor_settings(ctx))


def external_files(cfg: KilnConfig) -> list[Path]:
    """The eval files (held-out and the suite's bundled sets) and the user's boilerplate texts: their content is in the key."""
    return [*suite_eval_files(cfg), *(Path(p) for p in cfg.decontaminate.boilerplate_files)]


STAGE = Stage(
    name="decontaminate", description="remove training docs that overlap the eval suite", body=run,
    inputs=("dedup",), config=DecontaminateConfig,
    reads=("evaluate.eval_files", "evaluate.standard_suite", "evaluate.extra_tasks", "evaluate.suite.categories"),
    external_files=external_files, headline=document_headline, reports=("contamination.md", "removals.md"),
    # 3: removals by domain (removals.json/.md/.png)
    # 4: character n-grams for scripts without spaces; shards scanned a task each; documents as shards
    # 5: character n-grams over mixed tokens (a Latin word between unspaced characters is one token)
    version=5,
    resumable=True,  # a retry keeps the shards its scan finished
)
