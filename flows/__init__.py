"""Kiln's orchestration: one Prefect flow per stage, the pipeline flow, and the `kiln` CLI.

Flows are thin: they resolve inputs from the store, call `tasks.stages`, record to MLflow
through `tasks.tracking`, publish Prefect artifacts and commit the stage's manifest.
"""
