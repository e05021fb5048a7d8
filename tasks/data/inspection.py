"""What a data stage kept and removed, for a person: documents and bytes per domain and filter, a plot, samples.

Every data stage writes shards of kept documents, removed and quarantined records (each with its
`reason`; `tasks.data.shards`), so one reader serves them all. A reason's filter is its part before the
first colon (`gopher_quality:gopher_below_avg_threshold` → `gopher_quality`,
`licence_not_allowed:GFDL-1.3` → `licence_not_allowed`). A record's domain is its own, its
document's, or (for collect's quarantine, which has no document) its source's domain.

`write_removal_report` leaves `removals.json`, `removals.md` and `removals.png` in a stage's
folder: the runner logs them to MLflow, Prefect shows the Markdown. Stages fill a `RemovalTally`
as they write each shard, and add up the shards' tables (`RemovalTally.merge`), instead of reading
their files back; `accounting` reads them back, to check a stage's tally. `samples` feeds `kiln
inspect`, so a person can judge a filter in a minute.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln.tasks.data.documents import read_records
from kiln.tasks.data.shards import DOCUMENTS, QUARANTINE, REMOVED, shard_paths

REPORT_JSON, REPORT_MD, REPORT_PNG = "removals.json", "removals.md", "removals.png"
OUTCOMES = {"kept": DOCUMENTS, "removed": REMOVED, "quarantined": QUARANTINE}  # outcome -> shard kind
UNKNOWN_DOMAIN = "unknown"


def _records(out_dir: Path, outcome: str) -> Iterator[dict[str, Any]]:
    for path in shard_paths(out_dir, OUTCOMES[outcome]):
        yield from read_records(path)


def _document(record: dict[str, Any]) -> dict[str, Any]:
    return record["document"] if isinstance(record.get("document"), dict) else record


def _domain(record: dict[str, Any], source_domains: dict[str, str]) -> str:
    doc = _document(record)
    return doc.get("domain") or source_domains.get(record.get("source", ""), UNKNOWN_DOMAIN)


def _text(record: dict[str, Any]) -> str:
    doc = _document(record)
    text = doc.get("text")
    return text if isinstance(text, str) else record.get("raw") or record.get("raw_prefix") or ""


def filter_of(reason: str) -> str:
    return reason.split(":", 1)[0]


def source_domains(out_dir: Path) -> dict[str, str]:
    """Source → domain, from collect's compliance report (the only stage whose quarantine lacks domains)."""
    path = out_dir / "compliance.json"
    if not path.is_file():
        return {}
    return {s["name"]: s["domain"] for s in json.loads(path.read_text())["sources"]}


def text_bytes(text: str) -> int:
    """A text's size as the report counts it: UTF-8 bytes (lone surrogates, valid in JSON, as written)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", errors="surrogatepass"))


class RemovalTally:
    """Documents and bytes per domain: in, kept, removed by filter and quarantined by reason. A stage
    that sees every outcome as it writes it fills one directly; `accounting` fills one from the files."""

    def __init__(self) -> None:
        self._rows: dict[str, Any] = defaultdict(lambda: {
            "in": {"docs": 0, "bytes": 0}, "kept": {"docs": 0, "bytes": 0},
            "removed": defaultdict(lambda: {"docs": 0, "bytes": 0}),
            "quarantined": defaultdict(lambda: {"docs": 0, "bytes": 0}),
        })

    def add(self, outcome: str, domain: str, num_bytes: int, reason: str | None = None) -> None:
        """One document of `domain` kept, or removed or quarantined for `reason`."""
        row = self._rows[domain]
        cell = row["kept"] if outcome == "kept" else row[outcome][filter_of(reason or "")]
        for target in (cell, row["in"]):
            target["docs"] += 1
            target["bytes"] += num_bytes

    def merge(self, table: dict[str, Any]) -> None:
        """Add another tally's `table()` (a shard's) to this one."""
        for domain, other in table.items():
            row = self._rows[domain]
            for outcome in ("in", "kept"):
                for key in ("docs", "bytes"):
                    row[outcome][key] += other[outcome][key]
            for outcome in ("removed", "quarantined"):
                for name, cell in other[outcome].items():
                    for key in ("docs", "bytes"):
                        row[outcome][name][key] += cell[key]

    def table(self) -> dict[str, Any]:
        return {domain: {key: dict(sorted(value.items())) if key in ("removed", "quarantined") else dict(value)
                         for key, value in row.items()} for domain, row in sorted(self._rows.items())}


def accounting(out_dir: Path) -> dict[str, Any]:
    """Per domain: documents and bytes in, kept, removed by filter and quarantined by reason, read back
    from the stage's shards (what its own tally must equal)."""
    sources = source_domains(out_dir)
    tally = RemovalTally()
    for outcome in OUTCOMES:
        for record in _records(out_dir, outcome):
            tally.add(outcome, _domain(record, sources), text_bytes(_text(record)), record.get("reason"))
    return tally.table()


def markdown(table: dict[str, Any], stage: str) -> str:
    lines = [f"# {stage}: documents and bytes by domain and filter", "",
             "| domain | outcome | filter / reason | docs | MB | share of the domain's docs |", "|---|---|---|---:|---:|---:|"]
    for domain, row in table.items():
        total = row["in"]["docs"] or 1
        lines.append(f"| {domain} | in | | {row['in']['docs']} | {row['in']['bytes'] / 1e6:.3f} | 100.0% |")
        lines.append(f"| {domain} | kept | | {row['kept']['docs']} | {row['kept']['bytes'] / 1e6:.3f} | "
                     f"{100 * row['kept']['docs'] / total:.1f}% |")
        for outcome in ("removed", "quarantined"):
            for name, cell in row[outcome].items():
                lines.append(f"| {domain} | {outcome} | {name} | {cell['docs']} | {cell['bytes'] / 1e6:.3f} | "
                             f"{100 * cell['docs'] / total:.1f}% |")
    return "\n".join(lines) + "\n"


def plot(table: dict[str, Any], path: Path, stage: str) -> None:
    """Horizontal bars, one per filter (removed and quarantined), stacked by domain."""
    # The object API, not pyplot: pyplot's import and state cost more than the plot in a short stage.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    filters = sorted({f"{outcome}: {name}" for row in table.values() for outcome in ("removed", "quarantined")
                      for name in row[outcome]})
    width, height = 8, 1.2 + 0.35 * max(1, len(filters))
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    left = [0] * len(filters)
    for domain, row in table.items():
        counts = [row[label.split(": ", 1)[0]].get(label.split(": ", 1)[1], {}).get("docs", 0) for label in filters]
        if any(counts):
            ax.barh(filters, counts, left=left, label=domain)
            left = [a + b for a, b in zip(left, counts)]
    ax.set_xlabel("documents")
    ax.xaxis.set_major_locator(MaxNLocator(5, integer=True))  # whole documents: no fractional ticks
    ax.set_title(f"{stage}: documents removed by filter and domain")
    if filters:
        ax.legend(fontsize="small", loc="lower right")
    ax.invert_yaxis()
    # Margins in inches from the longest label (about 0.085 in a character at 10 pt), not tight_layout,
    # which measures every artist by drawing the figure once more.
    margin = (0.3 + 0.085 * max((len(label) for label in filters), default=0)) / width
    fig.subplots_adjust(left=min(margin, 0.6), right=0.97, bottom=0.55 / height, top=1 - 0.4 / height)
    fig.savefig(path, dpi=100)


def write_removal_report(out_dir: Path, stage: str, table: dict[str, Any], *, draw: bool = True) -> dict[str, Any]:
    """The accounting table (a stage's `RemovalTally`) as removals.json/.md/.png in `out_dir`; returns it.
    `draw=False` leaves the PNG to the caller (`plot`), to draw off its timed path."""
    (out_dir / REPORT_JSON).write_text(json.dumps(table, indent=2) + "\n", encoding="utf-8")
    (out_dir / REPORT_MD).write_text(markdown(table, stage), encoding="utf-8")
    if draw:
        plot(table, out_dir / REPORT_PNG, stage)
    return table


def samples(out_dir: Path, *, outcome: str = "removed", reason: str | None = None, domain: str | None = None,
            n: int = 5) -> Iterator[dict[str, Any]]:
    """Up to `n` records of `outcome` (kept, removed or quarantined), in file order, whose reason is
    `reason` or starts with `reason:` (a filter), and whose domain is `domain`."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome {outcome!r} is not one of {sorted(OUTCOMES)}")
    sources = source_domains(out_dir)
    shown = 0
    for record in _records(out_dir, outcome):
        if shown >= n:
            return
        if reason is not None and record.get("reason") != reason and filter_of(record.get("reason", "")) != reason:
            continue
        if domain is not None and _domain(record, sources) != domain:
            continue
        shown += 1
        yield {"reason": record.get("reason"), "domain": _domain(record, sources), "record": record}


def render_sample(sample: dict[str, Any], max_chars: int = 600) -> str:
    """One sample for a terminal: a header line (id, domain, reason, where, score) and the text's start."""
    record = sample["record"]
    doc = _document(record)
    metadata = doc.get("metadata") or {}
    where = {k: record.get(k, metadata.get(k)) for k in ("source", "path", "line", "row", "offset")
             if record.get(k, metadata.get(k)) is not None}
    score = metadata.get("quality_score")
    header = " | ".join(str(part) for part in (
        doc.get("id", "(no document)"), sample["domain"], sample["reason"] or "kept",
        ", ".join(f"{k}={v}" for k, v in where.items()), None if score is None else f"quality_score={score}",
        record.get("detail")) if part)
    text = _text(record)
    body = text[:max_chars] + ("…" if len(text) > max_chars else "")
    return f"── {header}\n{body}\n"
