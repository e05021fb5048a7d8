"""Kiln: an end-to-end LLM pretraining pipeline on Prefect and MLflow.

The repository keeps `tasks/` (the work, plain Python), `flows/` (Prefect flows and the `kiln` CLI),
`configs/`, `infra/` and `data/` at its root; installed, they are `kiln.tasks`, `kiln.flows` and the
package data `kiln.configs`, `kiln.infra`, `kiln.data` (setup.py maps the folders), so Kiln claims
one import name and finds its own files from any folder (`kiln.tasks.bundled`).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kiln")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"
