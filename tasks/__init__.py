"""Kiln's work as plain, typed Python: data, training, scaling and evals.

Nothing under `tasks` imports Prefect; only `tasks.tracking` imports MLflow. That keeps
every function callable from a notebook, a Slurm job or a Ray worker.
"""
