"""The collect stage's licence compliance report: per source, every licence seen, as written and as SPDX.

`compliance.json` is the record; `compliance.md` is the same for a person (logged as an artifact
and shown by the flows). Each licence is listed under its normalised SPDX expression with its
status (allowed, not allowed, unknown) and every spelling the input used for it, so a reviewer
sees that `GPL-2+` was read as `GPL-2.0-or-later`, and which strings could not be read at all.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from kiln.tasks.data.licences import LicenceVerdict


@dataclass
class SourceReport:
    """What one source contributed."""

    name: str
    path: str
    format: str
    domain: str
    declared_licence: str | None
    num_files: int = 0
    num_kept: int = 0
    num_chars: int = 0
    removed: Counter[str] = field(default_factory=Counter)
    quarantined: Counter[str] = field(default_factory=Counter)
    licences: Counter[str] = field(default_factory=Counter)  # label → documents (kept or removed)
    statuses: dict[str, str] = field(default_factory=dict)  # label → status
    unknown_keys: dict[str, tuple[str, ...]] = field(default_factory=dict)  # label → ids SPDX does not know
    spellings: defaultdict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    capped: bool = False

    def saw(self, verdict: LicenceVerdict) -> None:
        """Count one judged document's licence."""
        self.licences[verdict.label] += 1
        self.statuses[verdict.label] = verdict.status
        self.unknown_keys[verdict.label] = verdict.unknown_keys
        self.spellings[verdict.label][verdict.raw] += 1


def compliance_report(reports: list[SourceReport], allowed: tuple[str, ...]) -> dict[str, Any]:
    return {
        "allowed_licences": list(allowed),
        "sources": [
            {
                "name": r.name,
                "path": r.path,
                "format": r.format,
                "domain": r.domain,
                "declared_licence": r.declared_licence,
                "licences": {
                    label: {
                        "status": r.statuses[label],
                        "allowed": r.statuses[label] == "allowed",
                        "num_docs": n,
                        "as_written": dict(sorted(r.spellings[label].items())),
                        **({"unknown_ids": list(r.unknown_keys[label])} if r.unknown_keys[label] else {}),
                    }
                    for label, n in sorted(r.licences.items())
                },
                "num_files": r.num_files,
                "num_kept": r.num_kept,
                "num_removed": sum(r.removed.values()),
                "num_quarantined": sum(r.quarantined.values()),
                "quarantined": dict(sorted(r.quarantined.items())),
                "capped": r.capped,
            }
            for r in reports
        ],
    }


_STATUS_WORDS = {"allowed": "allowed", "not_allowed": "NOT allowed", "unknown": "UNKNOWN"}


def _cell(text: str) -> str:
    """Free-form text (a licence as written) made safe inside a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def compliance_markdown(compliance: dict[str, Any]) -> str:
    lines = [
        "# Collect: licence compliance",
        "",
        "| source | path | licences seen | kept | removed | quarantined |",
        "|---|---|---|---|---|---|",
    ]
    spelled: list[tuple[str, str, str, str, int]] = []
    for s in compliance["sources"]:
        seen = ", ".join(
            f"{_cell(label)} ({_STATUS_WORDS[info['status']]}, {info['num_docs']})"
            for label, info in s["licences"].items()
        )
        lines.append(
            f"| {s['name']} | `{s['path']}` | {seen or '-'} | {s['num_kept']} | "
            f"{s['num_removed']} | {s['num_quarantined']} |"
        )
        spelled += [(s["name"], raw, label, info["status"], n) for label, info in s["licences"].items()
                    for raw, n in info["as_written"].items() if raw != label or info["status"] == "unknown"]
    if spelled:
        lines += ["", "## Licences as written", "",
                  "Read as the SPDX expression shown; UNKNOWN ones were removed (reason `licence_unknown:...`).",
                  "", "| source | as written | read as | status | documents |", "|---|---|---|---|---|"]
        lines += [f"| {source} | {_cell(raw)} | {_cell(label) if status != 'unknown' or raw != label else '-'} | "
                  f"{_STATUS_WORDS[status]} | {n} |" for source, raw, label, status, n in spelled]
    return "\n".join(lines) + "\n"
