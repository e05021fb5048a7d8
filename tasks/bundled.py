"""Files Kiln ships (configs, presets, launch templates, the quality classifier, the held-out eval
sets, the sample corpus), found from any folder and from an installed wheel alike.

They are package data: `kiln.configs`, `kiln.infra` and `kiln.data` (the repository's configs/,
infra/ and data/, mapped by setup.py), read through `importlib.resources`; this module is the only
place that knows where they are. Config defaults name them as paths inside Kiln's checkout
(`data/models/quality_classifier.ftz`), and paths in a config are relative to the folder Kiln runs
in. Run in a user's project folder, such a default names a file the project does not have: a
relative path that is missing in the working directory but present among Kiln's files is Kiln's
file. A project's own file of that name wins.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

# the first part of a shipped path -> its package
PACKAGES = {"configs": "kiln.configs", "infra": "kiln.infra", "data": "kiln.data"}


def shipped(folder: str) -> Path:
    """The folder of Kiln's own files named `folder` ("configs", "infra" or "data"), wherever Kiln is
    installed. Installed as files (a wheel, an editable install), never from a zip."""
    root = files(PACKAGES[folder])
    assert isinstance(root, Path), f"{PACKAGES[folder]} is not installed as files: {root!r}"
    return root


def shipped_file(path: str | Path) -> Path | None:
    """Kiln's own file at `path` as its checkout names it (`configs/tiny.yaml`), or None when Kiln ships none."""
    parts = Path(path).parts
    if not parts or parts[0] not in PACKAGES or Path(path).is_absolute():
        return None
    candidate = shipped(parts[0]).joinpath(*parts[1:])
    return candidate if candidate.exists() else None


def locate(path: str | Path) -> Path:
    """`path` as the working directory has it, else Kiln's shipped file of that name, else `path` (so
    the caller's error names what the config said)."""
    path = Path(path)
    if path.is_absolute() or path.exists():
        return path
    return shipped_file(path) or path
