"""Stage `clean`: language ID, quality rules, PII redaction and the fastText quality score (datatrove)."""

from __future__ import annotations

from pathlib import Path

from tasks.data.clean import CleanConfig, clean_documents
from tasks.data.documents import DOCUMENTS_FILE
from tasks.stage import Stage, StageContext
from tasks.stages._common import document_headline


def run(ctx: StageContext) -> dict:
    return clean_documents(ctx.cfg.clean, ctx.inputs["collect"] / DOCUMENTS_FILE, ctx.out_dir)


STAGE = Stage(
    name="clean", description="language ID, quality rules, PII redaction, quality classifier (datatrove)",
    body=run, inputs=("collect",), config=CleanConfig,
    external_files=lambda cfg: [Path(cfg.clean.quality_model)] if cfg.clean.quality_model else [],
    headline=document_headline,
)
