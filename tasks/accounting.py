"""Document accounting: every data stage proves in = kept + removed + quarantined."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class DocCounts:
    """Counts of one data stage: documents in, kept, removed by reason, quarantined by reason."""

    num_in: int = 0
    num_kept: int = 0
    removed: Counter[str] = field(default_factory=Counter)
    quarantined: Counter[str] = field(default_factory=Counter)

    @property
    def num_removed(self) -> int:
        return sum(self.removed.values())

    @property
    def num_quarantined(self) -> int:
        return sum(self.quarantined.values())

    def check(self) -> None:
        """Raise if any document is unaccounted for (a bug in the stage, never user error)."""
        accounted = self.num_kept + self.num_removed + self.num_quarantined
        if accounted != self.num_in:
            raise AssertionError(
                f"document accounting broken: in={self.num_in} but kept={self.num_kept} "
                f"+ removed={dict(self.removed)} + quarantined={dict(self.quarantined)} = {accounted}"
            )

    def as_dict(self) -> dict[str, Any]:
        self.check()
        return {
            "num_in": self.num_in,
            "num_kept": self.num_kept,
            "num_removed": self.num_removed,
            "num_quarantined": self.num_quarantined,
            "removed": dict(sorted(self.removed.items())),
            "quarantined": dict(sorted(self.quarantined.items())),
        }
