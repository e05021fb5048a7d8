"""Stage `export`: the annealed model and its tokenizer as a Hugging Face Llama folder, with a model card."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kiln.tasks.configbase import Section
from kiln.tasks.constants import TOKENIZER_FILE
from kiln.tasks.evals.model_card import render_model_card
from kiln.tasks.lineage import COMPLIANCE_FILE, lineage_manifests
from kiln.tasks.stage import Stage, StageContext

HF_DIR = "hf"  # the folder to hand over: `from_pretrained(...)` and `lm_eval --model hf` read it


class ExportConfig(Section):
    """How the `export` stage writes the annealed model as a Hugging Face folder."""

    # float32 is the trained weights exactly; bfloat16 halves the folder (logits then differ ~1e-2)
    dtype: Literal["float32", "bfloat16"] = "float32"
    # the model card's title and the repository name it suggests; None: `kiln-<anneal key>`
    name: str | None = Field(None, min_length=1)


def run(ctx: StageContext) -> dict:
    from kiln.tasks.evals.export_hf import export_hf  # defers torch
    from kiln.tasks.train.model import load_model  # defers torch

    model, model_cfg = load_model(ctx.inputs["anneal"] / "model")
    anneal_key = ctx.inputs["anneal"].name
    # the evaluate stage's lineage holds the model's (collect … anneal) and the evaluation itself
    manifests = lineage_manifests(ctx.store, "evaluate", ctx.inputs["evaluate"].name)
    evaluations = ctx.read_json("evaluate", "stats.json")["metrics"]["anneal"]
    name = ctx.cfg.export.name or f"kiln-{anneal_key}"

    def card(summary: dict) -> str:
        return render_model_card(name=name, exported_from=f"Kiln stage `anneal` output `{anneal_key}`", export=summary,
                                 model_config=model_cfg.model_dump(mode="json"), manifests=manifests,
                                 evaluations=evaluations, compliance=ctx.read_json("collect", COMPLIANCE_FILE))

    written = export_hf(model, ctx.inputs["tokenize"] / TOKENIZER_FILE, ctx.out_dir / HF_DIR, card=card,
                        dtype=ctx.cfg.export.dtype)
    return {**written, "name": name, "folder": HF_DIR, "lineage": {stage: m["key"] for stage, m in manifests.items()}}


STAGE = Stage(
    name="export", description="Hugging Face folder and model card", body=run,
    inputs=("anneal", "tokenize", "evaluate", "collect"), config=ExportConfig,
    headline=lambda s: {"architecture": s["architecture"], "params": s["num_params"], "MB": round(s["num_bytes"] / 1e6, 2)},
)
