"""Stage `batch` (on demand, `kiln batch PATH --name NAME --domain DOMAIN [CONFIG]`): bring a
newly delivered data batch up to the corpus the production run trains on, so that `train.batches` can
make it eligible at the next adjustment point (`kiln adjust ... train.batches=[KEY]`).

The batch goes through the corpus's own data stages, in order, each with the corpus's settings:
collect (its sources, with `collect`'s licence policy and rules), clean (`clean`, with the quality
model and threshold the corpus's clean run resolved), dedup against everything the dedup stage kept
(its persisted LSH index, as `dedup-batch` does), decontaminate against the evaluation suite, and
tokenize with the corpus's tokenizer (every document into the train split). Only what survives
decontamination is tokenized, so only that can ever be drawn by the loader. Each step's counts are in
the stats (`steps`), and the tokens per domain (`tokens_by_domain`) are what the train stage adds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from kiln.tasks.configbase import Section
from kiln.tasks.constants import SHARDS_FILE, TOKENIZER_FILE
from kiln.tasks.data.clean import clean_documents
from kiln.tasks.data.collect import CollectConfig, collect_documents, source_paths
from kiln.tasks.data.decontaminate import decontaminate_documents
from kiln.tasks.data.dedup_index import INDEX_DIR
from kiln.tasks.data.dedup_job import dedup_documents
from kiln.tasks.data.quality_training import REPORT_FILE as CLASSIFIER_REPORT
from kiln.tasks.data.shards import shard_paths
from kiln.tasks.data.sources import Source
from kiln.tasks.data.tokenize import tokenize_corpus
from kiln.tasks.errors import ConfigError, InputError
from kiln.tasks.stage import Stage, StageContext
from kiln.tasks.stages._common import eval_file_paths, executor_settings

if TYPE_CHECKING:
    from kiln.tasks.settings import KilnConfig

STEPS = ("collect", "clean", "dedup-batch", "decontaminate", "tokenize")  # each a folder of the batch's output


class BatchConfig(Section):
    """A new data batch: its name (it names the batch's sources in the loader's accounting,
    `batch/<name>/<domain>`) and its sources, declared as `collect.sources` are."""

    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    sources: list[Source] = []


def _batch_clean(ctx: StageContext) -> Any:
    """The clean settings the corpus was cleaned with: its quality model and threshold as the clean stage
    resolved them (a classifier it trained, a top-fraction threshold), not trained again on the batch."""
    cfg = ctx.cfg.clean
    report = ctx.inputs["clean"] / CLASSIFIER_REPORT
    if not report.is_file():
        if cfg.quality_training is not None or (cfg.quality_model is not None and cfg.quality_top_fraction is not None):
            raise InputError(f"{ctx.inputs['clean']} has no {CLASSIFIER_REPORT}, so the quality model or threshold the "
                             "corpus was cleaned with (clean.quality_training, clean.quality_top_fraction) is not known: "
                             "rerun the clean stage under this config")
        return cfg.model_copy(update={"quality_top_fraction": None})  # no model: no threshold to resolve
    resolved = json.loads(report.read_text(encoding="utf-8"))
    return cfg.model_copy(update={"quality_model": resolved["model"], "quality_threshold": resolved["threshold"],
                                  "quality_training": None, "quality_top_fraction": None})


def run(ctx: StageContext) -> dict:
    batch = ctx.cfg.batch
    if batch.name is None or not batch.sources:
        raise ConfigError("the batch stage needs batch.name=NAME and batch.sources=[...] (declared as "
                          "collect.sources are): kiln batch PATH --name june --domain web CONFIG, or kiln stage batch "
                          "CONFIG batch.name=june 'batch.sources=[{name: june, path: /data/june, format: jsonl, "
                          "domain: web}]'")
    evals = eval_file_paths(ctx.cfg)  # first: a missing eval file is told before any document is read
    executor = executor_settings(ctx)
    folders = {step: ctx.out_dir / step for step in STEPS}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    steps: dict[str, dict] = {}
    steps["collect"] = collect_documents(ctx.cfg.collect.model_copy(update={"sources": batch.sources}),
                                         folders["collect"], executor)
    steps["clean"] = clean_documents(_batch_clean(ctx), folders["collect"], folders["clean"], executor)
    steps["dedup-batch"] = dedup_documents(ctx.cfg.dedup, shard_paths(folders["clean"]), folders["dedup-batch"],
                                           executor, index_dir=ctx.inputs["dedup"] / INDEX_DIR)
    steps["decontaminate"] = decontaminate_documents(
        ctx.cfg.decontaminate, shard_paths(folders["dedup-batch"]), evals, folders["decontaminate"],
        eval_tasks=ctx.cfg.evaluate.online_tasks(), executor=executor)
    steps["tokenize"] = tokenize_corpus(ctx.cfg.tokenize, folders["decontaminate"], folders["tokenize"], executor,
                                        tokenizer_file=ctx.inputs["tokenize"] / TOKENIZER_FILE)
    shards = json.loads((folders["tokenize"] / SHARDS_FILE).read_text())
    tokens = {domain: splits["train"]["num_tokens"] for domain, splits in shards["domains"].items()}
    return {"name": batch.name, "num_in": steps["collect"]["num_in"], "num_kept": steps["tokenize"]["num_kept"],
            "docs_by_step": {step: {"in": s["num_in"], "kept": s["num_kept"]} for step, s in steps.items()},
            "num_contaminated": steps["decontaminate"]["num_removed"],
            "tokens_by_domain": tokens, "num_tokens": sum(tokens.values()),
            "steps": {step: {k: v for k, v in s.items() if k != "shards"} for step, s in steps.items()}}


def headline(stats: dict[str, Any]) -> dict[str, Any]:
    return {"batch": stats["name"], "docs_in": stats["num_in"], "kept": stats["num_kept"],
            "contaminated": stats["num_contaminated"], "tokens": stats["num_tokens"]}


def external_files(cfg: KilnConfig) -> list[Path]:
    """The batch's own files (the eval files and the corpus's settings are in its inputs' keys)."""
    return source_paths(CollectConfig(sources=cfg.batch.sources))


STAGE = Stage(
    name="batch", description="bring a new data batch through collect, clean, dedup, decontaminate and tokenize",
    body=run, inputs=("clean", "dedup", "decontaminate", "tokenize"), config=BatchConfig,
    reads=("collect", "evaluate.eval_files", "evaluate.standard_suite", "evaluate.extra_tasks"),
    external_files=external_files, headline=headline, in_pipeline=False,
)
