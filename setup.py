"""Where Kiln's folders go in the installed package (the rest of the metadata is in pyproject.toml).

The repository keeps tasks/, flows/, configs/, infra/ and data/ at its root; installed, each lives
under the one import name `kiln`, so a wheel claims no generic top-level name (`tasks`, `flows`)
and carries every file Kiln reads. Every folder below them whose name is an identifier is listed as
a package (setuptools refuses to install unlisted folders as data quietly); a folder's files are its
package data.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
FOLDERS = {"kiln": "kiln", "kiln.tasks": "tasks", "kiln.flows": "flows",
           "kiln.configs": "configs", "kiln.infra": "infra", "kiln.data": "data"}
SKIPPED = {"__pycache__", ".pytest_cache"}


def packages() -> dict[str, str]:
    """Every package name -> its folder: the mapped folders and each identifier-named folder below."""
    found = {}
    for name, folder in FOLDERS.items():
        found[name] = folder
        for sub in sorted((ROOT / folder).rglob("*")):
            parts = sub.relative_to(ROOT / folder).parts
            if sub.is_dir() and not SKIPPED & set(parts) and all(part.isidentifier() for part in parts):
                found[".".join((name, *parts))] = str(Path(folder, *parts))
    return found


PACKAGES = packages()
# Bytecode caches are no data: a package's own __pycache__ (configs/ once imported) would be shipped with a
# warning that it is an unlisted package, one in the sample code tree would be overwritten by pip's compile.
setup(packages=list(PACKAGES), package_dir=PACKAGES,
      package_data={name: ["*", "**/*"] for name in PACKAGES if not name.startswith(("kiln.tasks", "kiln.flows"))}
      | {"kiln.tasks": ["py.typed"]},
      exclude_package_data={name: ["__pycache__/*", "**/__pycache__/*"] for name in PACKAGES})
