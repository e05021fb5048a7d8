"""Stage `collect`: read the configured sources into documents, check licences, write a compliance report."""

from __future__ import annotations

from tasks.data.collect import CollectConfig, collect_documents, source_paths
from tasks.stage import Stage, StageContext
from tasks.stages._common import document_headline


def run(ctx: StageContext) -> dict:
    return collect_documents(ctx.cfg.collect, ctx.out_dir)


STAGE = Stage(
    name="collect", description="read sources, check licences", body=run, config=CollectConfig,
    external_files=lambda cfg: source_paths(cfg.collect), headline=document_headline, reports=("compliance.md",),
)
