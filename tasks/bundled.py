"""Files Kiln ships beside its code (the quality classifier, the held-out eval sets), found from any folder.

Config defaults name them as paths inside Kiln's checkout (`data/models/quality_classifier.ftz`),
and paths in a config are relative to the folder Kiln runs in. Run in a user's project folder, with
Kiln installed from elsewhere, such a default names a file the project does not have: a relative
path that is missing in the working directory but present in Kiln's checkout is Kiln's file. A
project's own file of that name wins.
"""

from __future__ import annotations

from pathlib import Path

KILN_ROOT = Path(__file__).resolve().parents[1]


def locate(path: str | Path) -> Path:
    """`path` as the working directory has it, else Kiln's shipped file of that name, else `path` (so
    the caller's error names what the config said)."""
    path = Path(path)
    if path.is_absolute() or path.exists():
        return path
    shipped = KILN_ROOT / path
    return shipped if shipped.exists() else path
