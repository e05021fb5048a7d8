"""Stage `clean`: blocklists, language ID, prose and code rules, the fastText quality score, PII redaction."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tasks.data.clean import CleanConfig, clean_documents
from tasks.data.documents import DOCUMENTS_FILE
from tasks.stage import Stage, StageContext
from tasks.stages._common import document_headline

if TYPE_CHECKING:
    from tasks.config import KilnConfig


def run(ctx: StageContext) -> dict:
    return clean_documents(ctx.cfg.clean, ctx.inputs["collect"] / DOCUMENTS_FILE, ctx.out_dir)


def external_files(cfg: KilnConfig) -> list[Path]:
    """The quality model and the user's blocklists: their content, not their names, is in the key."""
    paths = (cfg.clean.quality_model, cfg.clean.url_blocklist, cfg.clean.word_blocklist)
    return [Path(path) for path in paths if path is not None]


STAGE = Stage(
    name="clean",
    description="blocklists, language ID, prose and code rules, quality classifier, PII redaction (datatrove)",
    body=run, inputs=("collect",), config=CleanConfig,
    external_files=external_files,
    # 2: C4, FineWeb, code rules and blocklists; phone and card PII; stats by domain
    version=2,
    headline=document_headline,
)
