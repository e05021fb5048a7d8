"""Stage `clean`: blocklists, language ID, prose and code rules, the fastText quality score, PII redaction."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kiln.tasks.bundled import locate
from kiln.tasks.data.clean import CleanConfig, clean_documents
from kiln.tasks.data.datatrove_logs import LOG_FILE
from kiln.tasks.data.quality_training import REPORT_FILE, classifier_metrics, reference_paths, resolve_quality_model
from kiln.tasks.stage import Stage, StageContext
from kiln.tasks.stages._common import document_headline, executor_settings

if TYPE_CHECKING:
    from kiln.tasks.settings import KilnConfig


def run(ctx: StageContext) -> dict:
    # A classifier trained from references is a sub-run kept in the store under its own key, and reused.
    cfg = resolve_quality_model(ctx.cfg.clean, ctx.inputs["collect"], ctx.out_dir, ctx.subruns(ctx.store.root))
    ctx.recorder.metrics(0, classifier_metrics(ctx.out_dir / REPORT_FILE))  # held-out precision, recall, ROC-AUC
    stats = clean_documents(cfg, ctx.inputs["collect"], ctx.out_dir,
                            executor_settings(ctx))
    if (ctx.out_dir / LOG_FILE).is_file():  # every rank's datatrove log, to MLflow
        ctx.recorder.tracker.log_artifact(ctx.recorder.run_id, ctx.out_dir / LOG_FILE)
    return stats


def external_files(cfg: KilnConfig) -> list[Path]:
    """The quality model, the classifier's references and the user's blocklists: their content, not
    their names, is in the key."""
    model = [locate(cfg.clean.quality_model)] if cfg.clean.quality_model is not None else []
    blocklists = [Path(path) for path in (cfg.clean.url_blocklist, cfg.clean.word_blocklist) if path is not None]
    return model + blocklists + reference_paths(cfg.clean.quality_training)


STAGE = Stage(
    name="clean",
    description="blocklists, language ID, prose and code rules, quality classifier, PII redaction (datatrove)",
    body=run, inputs=("collect",), config=CleanConfig,
    external_files=external_files,
    # 2: C4, FineWeb, code rules and blocklists; phone and card PII; stats by domain
    # 3: a classifier trained from references; every document scored; top-fraction thresholds
    # 4: documents, removed and quarantined records as shards, one datatrove task per input shard
    version=4,
    # A retry keeps the failed attempt's folder: ranks that finished (datatrove's markers) are skipped.
    resumable=True,
    headline=document_headline,
    reports=("removals.md",),
)
