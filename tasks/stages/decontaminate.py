"""Stage `decontaminate`: remove training documents whose n-grams overlap the eval suite."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tasks.data.decontaminate import DecontaminateConfig, decontaminate_documents
from tasks.data.documents import DOCUMENTS_FILE
from tasks.stage import Stage, StageContext
from tasks.stages._common import configured_eval_files, document_headline, eval_file_paths

if TYPE_CHECKING:
    from tasks.config import KilnConfig


def run(ctx: StageContext) -> dict:
    return decontaminate_documents(ctx.cfg.decontaminate, ctx.inputs["dedup"] / DOCUMENTS_FILE,
                                   eval_file_paths(ctx.cfg), ctx.out_dir, eval_tasks=ctx.cfg.evaluate.online_tasks())


def external_files(cfg: KilnConfig) -> list[Path]:
    """The eval files and the user's boilerplate texts: their content is in the key."""
    return [*configured_eval_files(cfg), *(Path(p) for p in cfg.decontaminate.boilerplate_files)]


STAGE = Stage(
    name="decontaminate", description="remove training docs that overlap the eval suite", body=run,
    inputs=("dedup",), config=DecontaminateConfig,
    reads=("evaluate.eval_files", "evaluate.standard_suite", "evaluate.extra_tasks"),
    external_files=external_files, headline=document_headline, reports=("contamination.md", "removals.md"),
    version=3,  # 3: removals by domain (removals.json/.md/.png)
)
