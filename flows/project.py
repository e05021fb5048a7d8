"""`kiln init DIR`: a project folder of one's own, for a Kiln installed anywhere (a wheel, a container).

It holds a config that extends one of Kiln's own (`kiln:configs/default.yaml` unless told otherwise),
so `kiln run` there works at once on Kiln's bundled sample; the config's comments say what to set for
the user's data, and `data/` is laid out for it. The files are rendered from Kiln's template
(`kiln:configs/project/`). Nothing the folder already has is overwritten: a `kiln.yaml` there stops
it, a README is kept, and a `.gitignore` only gains the lines it lacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from string import Template

from kiln import __version__
from kiln.tasks.bundled import is_packaged, shipped
from kiln.tasks.config import PACKAGED_DEFAULT, load_config
from kiln.tasks.errors import ConfigError

TEMPLATE = shipped("configs") / "project"
CONFIG = "kiln.yaml"
# template file -> the project's file; rendered with ${project}, ${extends}, ${version}
FILES = {"kiln.yaml": CONFIG, "README.md": "README.md", "data/README.md": "data/README.md"}
GITIGNORE = "gitignore"  # appended to the project's .gitignore, line by line (a package holds no dotfile)
DATA_FOLDERS = ("data/raw", "data/evals", "data/lists")  # each kept in git by an empty .gitkeep


@dataclass
class Scaffold:
    """What `init_project` did: files written, files the folder already had and kept."""

    root: Path
    written: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def init_project(root: Path, extends: str = PACKAGED_DEFAULT) -> Scaffold:
    """Write a project into `root` (created if missing) whose config extends `extends`: a `kiln:` name,
    or a path (written absolute, so the project may move). ConfigError, writing nothing, when `root`
    already has a kiln.yaml or `extends` does not load."""
    if (root / CONFIG).exists():
        raise ConfigError(f"{root / CONFIG} exists: this folder is a Kiln project already (kiln init writes into a "
                          "new or empty folder, or one without a kiln.yaml)")
    if not is_packaged(extends):
        extends = str(Path(extends).resolve())
    load_config(extends)  # the base must load before anything is written
    values = {"project": root.resolve().name, "extends": extends, "version": __version__}
    scaffold = Scaffold(root)
    for template, name in FILES.items():
        target = root / name
        if target.exists():
            scaffold.kept.append(name)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(Template((TEMPLATE / template).read_text(encoding="utf-8")).substitute(values),
                          encoding="utf-8")
        scaffold.written.append(name)
    for folder in DATA_FOLDERS:
        keep = root / folder / ".gitkeep"
        if not (root / folder).exists():
            keep.parent.mkdir(parents=True)
            keep.touch()
            scaffold.written.append(f"{folder}/")
    _extend_gitignore(root / ".gitignore", scaffold)
    return scaffold


def _extend_gitignore(path: Path, scaffold: Scaffold) -> None:
    """The template's lines the project's .gitignore lacks, appended (all of them to a new file)."""
    wanted = (TEMPLATE / GITIGNORE).read_text(encoding="utf-8").splitlines()
    existing = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    missing = [line for line in wanted if line.startswith("#") or line not in existing]
    if not existing:
        path.write_text("\n".join(wanted) + "\n", encoding="utf-8")
        scaffold.written.append(".gitignore")
    elif any(not line.startswith("#") for line in missing):
        separator = "" if path.read_text(encoding="utf-8").endswith("\n") else "\n"
        with path.open("a", encoding="utf-8") as handle:
            handle.write(separator + "\n".join(missing) + "\n")
        scaffold.written.append(".gitignore (lines added)")
    else:
        scaffold.kept.append(".gitignore")
