"""The model card of an exported model: where it came from, read from the store's manifests.

Every committed stage output carries a manifest naming its inputs' keys, so a model's whole
lineage (collect … anneal) follows from its own manifest. The card lists that lineage, the
training and annealing mixtures, the evaluate stage's scores of the model, and the licences of
the documents the collect stage kept (its compliance report).
"""

from __future__ import annotations

import json
from typing import Any

from kiln.tasks.lineage import COMPLIANCE_FILE
from kiln.tasks.store import MANIFEST_FILE, Store


def evaluations_of(store: Store, stage: str, key: str) -> dict[str, float | int]:
    """The evaluate stage's scores of the model `stage`/`key` (the newest evaluation, if several)."""
    found = []
    for folder in sorted((store.root / "evaluate").glob("*/")) if (store.root / "evaluate").is_dir() else []:
        manifest_path = folder / MANIFEST_FILE
        if manifest_path.is_file():
            manifest = json.loads(manifest_path.read_text())
            if manifest["inputs"].get(stage) == key and stage in manifest["stats"].get("metrics", {}):
                found.append((manifest["created_at"], manifest["stats"]["metrics"][stage]))
    return max(found, key=lambda pair: pair[0])[1] if found else {}


def read_compliance(store: Store, manifests: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    collect = manifests.get("collect")
    if collect is None:
        return None
    path = store.path("collect", collect["key"]) / COMPLIANCE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def render_model_card(
    *,
    name: str,
    exported_from: str,
    export: dict[str, Any],
    model_config: dict[str, Any],
    manifests: dict[str, dict[str, Any]],
    evaluations: dict[str, float | int],
    compliance: dict[str, Any] | None,
) -> str:
    """Markdown with YAML front matter (the Hugging Face hub reads `license` and `tags` from it)."""
    licences = _licences(compliance)
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags: [kiln, causal-lm]"]
    if licences:
        lines.append("license: other  # the training data carries several licences; see below")
    lines += ["---", "", f"# {name}", "",
              f"A {export['architecture']} ({export['num_params']:,} parameters, {export['dtype']}) trained by Kiln; "
              f"exported from {exported_from}.", "",
              "```python",
              "from transformers import AutoModelForCausalLM, AutoTokenizer",
              'model = AutoModelForCausalLM.from_pretrained("<this folder>")',
              'tokenizer = AutoTokenizer.from_pretrained("<this folder>")',
              "```", "",
              "`lm_eval --model hf --model_args pretrained=<this folder> --tasks ...` evaluates it.", "",
              "## Architecture", "", "| setting | value |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in sorted(model_config.items())]
    lines += [f"| vocab_size | {export['vocab_size']} |", ""]

    lines += ["## Lineage", "",
              "Each Kiln stage output is addressed by a key that hashes its settings and its inputs' keys; "
              "these are the outputs this model was made from (`kiln status` and the store under "
              "`{work_dir}/store/<stage>/<key>` hold them).", "",
              "| stage | key | headline |", "|---|---|---|"]
    for stage, manifest in manifests.items():
        headline = ", ".join(f"{k}={v}" for k, v in manifest["stats"].get("headline", {}).items())
        lines.append(f"| {stage} | `{manifest['key']}` | {headline} |")
    if not manifests:
        lines.append("| (not from a committed stage output: no lineage recorded) | | |")
    lines.append("")

    mixture_lines = _mixtures(manifests)
    if mixture_lines:
        lines += ["## Data mixture", "", *mixture_lines, ""]

    lines += ["## Evaluation", ""]
    if evaluations:
        lines += ["Scores from Kiln's evaluate stage (lm-eval through Kiln's adapter, on held-out text).", "",
                  "| task | metric | value |", "|---|---|---|"]
        for metric, value in evaluations.items():
            task, _, metric_name = metric.rpartition("/")
            lines.append(f"| {task or '(all)'} | {metric_name} | {_number(value)} |")
    else:
        lines.append("No evaluate stage output scores this model.")
    lines.append("")

    lines += ["## Training data licences", ""]
    if licences:
        lines += ["Licences (SPDX) of the documents the collect stage kept, per source, from its compliance report.", "",
                  "| source | domain | documents kept | licences |", "|---|---|---|---|"]
        lines += [f"| {row['source']} | {row['domain']} | {row['num_kept']} | {', '.join(row['licences'])} |"
                  for row in licences]
        in_use = sorted({licence for row in licences for licence in row["licences"]})
        lines += ["", f"All licences in the training data: {', '.join(in_use)}."]
    else:
        lines.append("No compliance report of the collect stage was found for this model.")
    return "\n".join(lines) + "\n"


def _mixtures(manifests: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    mix = manifests.get("mix")
    if mix is not None:
        stats = mix["stats"]
        lines += [f"Training (mix stage, mixture `{stats['mixture']}`, {stats['train_tokens']:,} tokens):", "",
                  "| domain | weight | epochs |", "|---|---|---|"]
        lines += [f"| {domain} | {_number(weight)} | {_number(stats['epochs'].get(domain, ''))} |"
                  for domain, weight in stats["weights"].items()]
        lines.append("")
    anneal = manifests.get("anneal")
    if anneal is not None and "mixture" in anneal["identity"].get("anneal", {}):
        entries = anneal["identity"]["anneal"]["mixture"]
        total = sum(_anneal_weight(entry) for entry in entries.values())
        lines += [f"Annealing ({anneal['identity']['anneal'].get('steps', '?')} steps, LR decayed to zero):", "",
                  "| domain | weight |", "|---|---|"]
        lines += [f"| {_anneal_label(name, entry)} | {_number(_anneal_weight(entry) / total)} |"
                  for name, entry in entries.items()]
    return lines


def _anneal_weight(entry: float | dict[str, Any]) -> float:
    """An anneal mixture entry's weight: a domain's number, or a quality selection's `weight`."""
    return entry["weight"] if isinstance(entry, dict) else entry


def _anneal_label(name: str, entry: float | dict[str, Any]) -> str:
    if not isinstance(entry, dict):
        return name
    domains = ", ".join(entry.get("domains") or ["every scored domain"])
    return f"{name}: the top {entry['quality_top']:.0%} of {domains} by quality score"


def _licences(compliance: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Per source: the licences of its kept documents (only allowed licences survive collect)."""
    if not compliance:
        return []
    rows = []
    for source in compliance["sources"]:
        kept = sorted(label for label, info in source["licences"].items() if info["allowed"])
        if source["num_kept"] > 0:
            rows.append({"source": source["name"], "domain": source["domain"], "num_kept": source["num_kept"],
                         "licences": kept})
    return rows


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)

