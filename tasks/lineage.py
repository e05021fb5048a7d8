"""Which data and settings produced this output? The chain of store entries behind one, from raw sources.

Every committed stage folder holds a manifest naming its inputs' keys, its config identity, its
MLflow run, the Prefect flow run that built it, its files' sha256 and the code version. Walking the
inputs from any entry (found by stage key, MLflow run id, or any path inside it, such as a
checkpoint) gives its lineage without asking MLflow or Prefect: the store is the source of truth.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln.tasks.errors import KilnError
from kiln.tasks.store import MANIFEST_FILE, Store

COMPLIANCE_FILE = "compliance.json"  # collect's licence report


@dataclass
class Link:
    stage: str
    key: str
    inputs: dict[str, str]
    config_sections: list[str]
    config_sha256: str  # of the identity the key hashes (config sections and external files)
    outputs_sha256: str  # of the manifest's file listing: names, sizes and sha256 of every output
    mlflow_run_id: str | None
    prefect_flow_run_id: str | None
    git_sha: str | None
    git_dirty: bool | None
    created_at: str | None
    licences: dict[str, int] = field(default_factory=dict)  # SPDX -> kept documents (collect only)
    # an adjusted train run (train.branch): "train <prefix key> up to step N, then schedule ..."
    continues: str | None = None
    promoted_from: str | None = None  # the research decision its model config came from (train.promoted_from)


def continuation(stage: str, identity: dict[str, Any]) -> str | None:
    """What an adjusted run goes on from, in words: the prefix run up to its step, then this run's
    schedule (its data phases, or the mix stage's mixture) and steps; None for a run from step 0."""
    section = identity.get(stage, {})
    branch = section.get("branch") if isinstance(section, dict) else None
    if not branch:
        return None
    phases = section.get("phases") or []
    schedule = " -> ".join(
        f"{p['name']}" + (f" (to step {p['until_step']})" if p.get("until_step") else "")
        + (f" (to {p['until_tokens']:.0%} of the tokens)" if p.get("until_tokens") else "")
        + (f" {p['mixture']}" if p.get("mixture") else "") + (f" order {p['order']}" if p.get("order", "random") != "random" else "")
        + (f" seq_len {p['seq_len']}" if p.get("seq_len") else "")
        + (f" rope_theta {p['rope_theta']:g}" if p.get("rope_theta") else "")
        + (f" rope_scaling {p['rope_scaling']['kind']} x{p['rope_scaling']['factor']:g}" if p.get("rope_scaling") else "")
        + (f" long documents (>= {p['long_documents']['min_tokens']} tokens) x{p['long_documents']['upweight']}"
           if p.get("long_documents") else "") for p in phases) or "the mix stage's mixture"
    steps = section.get("run", {}).get("steps", "plan")
    batches = section.get("batches") or []
    joined = f", with new batches {', '.join(batches)}" if batches else ""
    return f"{stage} {branch['prefix']} up to step {branch['from_step']}, then schedule {schedule}{joined} to step {steps}"


def _sha256(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _manifests(store: Store) -> list[Path]:
    return sorted(store.root.glob(f"*/*/{MANIFEST_FILE}"))


def locate(store: Store, ref: str) -> tuple[str, str]:
    """The (stage, key) that `ref` names: a stage key, `stage/key`, an MLflow run id, or a path inside an entry."""
    path = Path(ref).resolve()
    if path.exists():
        for parent in (path, *path.parents):
            if (parent / MANIFEST_FILE).is_file():
                return parent.parent.name, parent.name
        raise KilnError(f"{ref} is not inside a committed store entry (no {MANIFEST_FILE} above it)")
    stage, _, key = ref.rpartition("/")
    matches = []
    for manifest_path in _manifests(store):
        entry_stage, entry_key = manifest_path.parent.parent.name, manifest_path.parent.name
        if entry_key == key and stage in ("", entry_stage):
            matches.append((entry_stage, entry_key))
        elif json.loads(manifest_path.read_text()).get("mlflow_run_id") == ref:
            matches.append((entry_stage, entry_key))
    if not matches:
        raise KilnError(f"{ref!r} names no committed entry of {store.root} (give a stage key, stage/key, "
                        "an MLflow run id, or a path such as a checkpoint inside the store)")
    if len(set(matches)) > 1:
        raise KilnError(f"{ref!r} matches {sorted(set(matches))}: write it as stage/key")
    return matches[0]


def _licences(folder: Path) -> dict[str, int]:
    report = folder / COMPLIANCE_FILE
    if not report.is_file():
        return {}
    kept: dict[str, int] = {}
    for source in json.loads(report.read_text()).get("sources", []):
        for label, info in source.get("licences", {}).items():
            if info.get("allowed"):
                kept[label] = kept.get(label, 0) + int(info.get("num_docs", 0))
    return dict(sorted(kept.items()))


def _link(store: Store, stage: str, key: str) -> Link:
    manifest = store.manifest(stage, key)
    code = manifest.get("provenance", {}).get("code", {})
    identity = manifest.get("identity", {})
    return Link(stage=stage, key=key, inputs=manifest.get("inputs", {}),
                config_sections=[s for s in identity if s != "external_files_sha256"],
                config_sha256=_sha256(identity), outputs_sha256=_sha256(manifest.get("files", {})),
                mlflow_run_id=manifest.get("mlflow_run_id"), prefect_flow_run_id=manifest.get("prefect_flow_run_id"),
                git_sha=code.get("git_sha"), git_dirty=code.get("git_dirty"), created_at=manifest.get("created_at"),
                licences=_licences(store.path(stage, key)), continues=continuation(stage, identity),
                promoted_from=next((section["promoted_from"] for section in identity.values()
                                    if isinstance(section, dict) and section.get("promoted_from")), None))


def lineage_manifests(store: Store, stage: str, key: str) -> dict[str, dict[str, Any]]:
    """The manifests of `stage`/`key` and of every entry it was built from, by stage, sources first."""
    manifests: dict[str, dict[str, Any]] = {}

    def visit(entry_stage: str, entry_key: str) -> None:
        if entry_stage in manifests:
            return
        if not store.is_complete(entry_stage, entry_key):
            raise KilnError(f"{entry_stage}/{entry_key} is not complete in {store.root}: its lineage is broken "
                            "(was it pruned or damaged?)")
        manifest = store.manifest(entry_stage, entry_key)
        for input_stage, input_key in manifest.get("inputs", {}).items():
            visit(input_stage, input_key)
        manifests[entry_stage] = manifest

    visit(stage, key)
    return manifests


def lineage(store: Store, stage: str, key: str) -> list[Link]:
    """`stage`/`key` and every entry it was built from, sources first, as table rows."""
    return [_link(store, entry_stage, manifest["key"])
            for entry_stage, manifest in lineage_manifests(store, stage, key).items()]


def render_table(links: list[Link]) -> str:
    rows = [("stage", "key", "inputs", "config", "outputs", "mlflow run", "prefect flow run", "code")]
    for link in links:
        code = f"{(link.git_sha or '?')[:10]}{'+dirty' if link.git_dirty else ''}"
        rows.append((link.stage, link.key, ",".join(link.inputs) or "-", link.config_sha256[:10],
                     link.outputs_sha256[:10], (link.mlflow_run_id or "-")[:12], (link.prefect_flow_run_id or "-")[:12],
                     code))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines += [f"\n{link.stage} {link.key}: {link.continues}" for link in links if link.continues]
    for link in links:
        if link.promoted_from:
            research, _, variant = link.promoted_from.rpartition(":")
            lines.append(f"\n{link.stage} {link.key}: model promoted from the research decision {research} (variant "
                         f"{variant}: {research}/decision.json in the store)")
    licences = {label: n for link in links for label, n in link.licences.items()}
    if licences:
        kept = ", ".join(f"{label} {n}" for label, n in licences.items())
        lines.append(f"\nlicences of the documents collect kept (the training data before cleaning): {kept}")
    return "\n".join(lines)


def as_json(links: list[Link]) -> str:
    return json.dumps([asdict(link) for link in links], indent=2)
