"""Kiln's launch templates and deployments (package data `kiln.infra`): prefect.yaml, work-pool
templates, Slurm and Kubernetes templates, the container recipe. Read through `kiln.tasks.bundled`."""
