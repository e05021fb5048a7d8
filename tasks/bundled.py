"""Files Kiln ships (configs, presets, launch templates, the quality classifier, the held-out eval
sets, the sample corpus), found from any folder and from an installed wheel alike.

They are package data: `kiln.configs`, `kiln.infra` and `kiln.data` (the repository's configs/,
infra/ and data/, mapped by setup.py), read through `importlib.resources`; this module is the only
place that knows where they are. Config defaults name them as paths inside Kiln's checkout
(`data/models/quality_classifier.ftz`), and paths in a config are relative to the folder Kiln runs
in. Run in a user's project folder, such a default names a file the project does not have: a
relative path that is missing in the working directory but present among Kiln's files is Kiln's
file. A project's own file of that name wins. `kiln:configs/default.yaml` names Kiln's file
whatever the folder holds (a project config's `extends:`, `kiln run kiln:configs/tiny.yaml`).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from kiln.tasks.errors import ConfigError

# the first part of a shipped path -> its package
PACKAGES = {"configs": "kiln.configs", "infra": "kiln.infra", "data": "kiln.data"}
PREFIX = "kiln:"  # `kiln:configs/tiny.yaml`: Kiln's own file, never the working directory's


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


def is_packaged(ref: str | Path) -> bool:
    """Whether `ref` names Kiln's own file by the `kiln:` prefix."""
    return isinstance(ref, str) and ref.startswith(PREFIX)


def packaged(ref: str) -> Path:
    """Kiln's own file that `ref` (`kiln:configs/default.yaml`) names; ConfigError, listing the files
    of that folder Kiln ships, when there is none."""
    name = ref.removeprefix(PREFIX)
    found = shipped_file(name)
    if found is not None:
        return found
    parts = Path(name).parts
    if not parts or parts[0] not in PACKAGES:
        raise ConfigError(f"{ref}: Kiln's own files are under {', '.join(PREFIX + p + '/' for p in PACKAGES)} "
                          f"(e.g. {PREFIX}configs/default.yaml)")
    folder = shipped(parts[0]).joinpath(*parts[1:-1])
    known = sorted(p.name for p in folder.iterdir() if not p.name.startswith(("_", "."))) if folder.is_dir() else []
    raise ConfigError(f"{ref}: Kiln ships no such file" + (f"; {PREFIX}{Path(name).parent}/ holds {', '.join(known)}"
                                                            if known else ""))


def packaged_name(path: str | Path) -> str | None:
    """`kiln:...` for a path inside Kiln's shipped folders, else None (how `kiln config` names a file)."""
    resolved = Path(path).resolve()
    for folder in PACKAGES:
        root = shipped(folder).resolve()
        if resolved.is_relative_to(root):
            return PREFIX + str(Path(folder, resolved.relative_to(root)))
    return None


def locate(path: str | Path) -> Path:
    """`path` as the working directory has it, else Kiln's shipped file of that name, else `path` (so
    the caller's error names what the config said). A `kiln:` path is always Kiln's own."""
    if is_packaged(path):
        return packaged(str(path))
    path = Path(path)
    if path.is_absolute() or path.exists():
        return path
    return shipped_file(path) or path
