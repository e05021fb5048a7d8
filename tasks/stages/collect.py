"""Stage `collect`: read the configured sources (files, globs, fsspec URLs, datasets, code trees) into
documents, check licences, write a compliance report."""

from __future__ import annotations

from kiln.tasks.data.collect import CollectConfig, collect_documents, source_paths
from kiln.tasks.errors import ConfigError
from kiln.tasks.stage import Stage, StageContext
from kiln.tasks.stages._common import document_headline, executor_settings


def run(ctx: StageContext) -> dict:
    if not ctx.cfg.collect.sources:  # no config found and none named: a pipeline of nothing is no result
        raise ConfigError("collect.sources is empty, so there is nothing to collect (no config names any source). "
                          "Start a project with `kiln init DIR` (its kiln.yaml runs Kiln's sample corpus and says how "
                          "to name your own data), or name a config that has sources: kiln run kiln:configs/tiny.yaml")
    return collect_documents(ctx.cfg.collect, ctx.out_dir, executor_settings(ctx))


# version 2: licences normalised to SPDX (documents carry the SPDX expression, the written one in
# metadata.licence_as_written); lone surrogates repaired; new quarantine reasons; compliance report v2
# version 3: typed sources (warc, parquet, compressed jsonl, hf, code), positions by row/offset, weights, by_format
# version 4: a jsonl record's other fields kept in metadata; a domain per record (domain_field); WARC pages
# by their HTTP Content-Type; licence names as PyPI writes them
# version 5: documents, removed and quarantined records as shards (tasks.data.shards)
# version 6: a code tree's __pycache__ folders are no input (pip writes them into an installed Kiln's sample)
# version 7: licence names as package metadata spells them (The MIT License (MIT), MIT Licence, Apache Software License)
STAGE = Stage(
    name="collect", description="read sources, check licences", body=run, config=CollectConfig, version=7,
    external_files=lambda cfg: source_paths(cfg.collect), headline=document_headline, reports=("compliance.md", "removals.md"),
    # A retry keeps the failed attempt's folder: tasks that finished (their records in the run ledger) are skipped.
    resumable=True,
)
