"""Pieces several stage declarations share: the document-count headline, the eval-file check, and where
the data stages' pipelines run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.tasks.bundled import locate
from kiln.tasks.data.executors import ExecutorSettings
from kiln.tasks.errors import InputError
from kiln.tasks.settings import KilnConfig

SLURM_LOGS = "logs"  # in a data stage's folder: its Slurm jobs' output, scripts and journal

if TYPE_CHECKING:
    from kiln.tasks.stage import StageContext


def document_headline(stats: dict[str, Any]) -> dict[str, Any]:
    return {"docs_in": stats["num_in"], "kept": stats["num_kept"], "removed": stats["num_removed"],
            "quarantined": stats["num_quarantined"]}


def eval_file_paths(cfg: KilnConfig) -> list[Path]:
    """The configured eval files, each checked to exist (decontamination and evaluation read them)."""
    paths = suite_eval_files(cfg)
    for i, path in enumerate(paths):
        if not path.is_file():
            where = f"evaluate.eval_files[{i}]" if i < len(cfg.evaluate.eval_files) else "evaluate.suite"
            raise InputError(f"eval file {path} does not exist (config key {where}); fix the path or remove the entry")
    return paths


def configured_eval_files(cfg: KilnConfig) -> list[Path]:
    """The eval files whose content a key hashes (missing ones hash as missing; the stage reports them);
    the defaults are Kiln's own held-out sets (`tasks.bundled`)."""
    return [locate(p) for p in cfg.evaluate.eval_files]


def suite_eval_files(cfg: KilnConfig) -> list[Path]:
    """Every file of the evaluate suite whose items a model is scored on: the held-out files and the bundled
    category sets of `evaluate.suite.categories` (decontamination indexes them all; the evaluate stage's key
    hashes them)."""
    return [*configured_eval_files(cfg), *(locate(p) for p in cfg.evaluate.suite.files())]


def executor_settings(ctx: StageContext) -> ExecutorSettings:
    """Where the stage's data pipelines run: `cluster.executor` and, on Slurm, what its jobs need; each
    job's launch record goes to the stage's manifest, its output files to the stage's `logs/` (committed
    with the stage: `logs/<job>_<task>.out`)."""
    cluster = ctx.cfg.cluster
    if cluster.executor != "slurm":  # the Slurm fields mean nothing to the other executors
        return ExecutorSettings(cluster.executor, on_job=ctx.recorder.job_launched)
    return ExecutorSettings("slurm", cluster.partition, cluster.time_limit, cluster.slurm, cluster.image,
                            ctx.recorder.job_launched, ctx.recorder.job_submitted, logs_dir=ctx.out_dir / SLURM_LOGS,
                            job_prefix=f"kiln-{ctx.recorder.stage}-{ctx.recorder.key[:12]}")
