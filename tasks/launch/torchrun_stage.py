"""Run a training stage under torchrun and report it as the in-process loop would.

Every rank of the torchrun job runs `tasks.launch.dist_worker`, i.e. `train_model` with the
configured parallel layout: sharded DCP checkpoints in `out_dir` (a crashed attempt resumes
there), the loss monitor's rollbacks, and — from rank 0 — the gathered `model/`, `metrics.json`,
`train_metrics.jsonl` and the loss plot, so later stages (anneal, evaluate) read the same files
whichever path trained. This module owns the launch and the relaunch after a failed process, and
replays the worker's metrics and health events to this process's callbacks.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tasks.launch.cluster import ClusterSpec
from tasks.launch.launchers import LaunchError, TorchrunLauncher, record_failed_hosts
from tasks.launch.rank_hosts import REGISTRY_DIR, failed_ranks, hosts_of_failed_ranks, reset_registry
from tasks.train.callbacks import METRICS_LOG, CallbackSpec
from tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig
from tasks.train.loop import TrainResult, read_result, write_metrics

WORKER_CONFIG = "dist_config.json"
WORKER_RESULT = "dist_result.json"
FAILED_HOSTS_FILE = "failed_hosts.json"


def train_with_torchrun(model_cfg: ModelConfig, optim_cfg: OptimConfig, run_cfg: TrainRunConfig, dims: ParallelDims,
                        cluster: ClusterSpec, manifest: Path, data_root: Path, out_dir: Path, *,
                        on_metrics: Callable[[int, dict[str, float]], None] | None = None,
                        on_event: Callable[[dict[str, Any]], None] | None = None,
                        callbacks: Sequence[CallbackSpec] = (), init_model_dir: Path | None = None) -> TrainResult:
    """Train under torchrun; a failed job is relaunched (up to `cluster.max_restarts` times) and resumes
    from its last DCP checkpoint. Each failure is a `process_failure` event with the failed host and
    the measured time from failure to the relaunched job's first step; it joins the worker's own
    health events (rollbacks) in the result. `callbacks` are built in every worker (see `CallbackSpec`);
    `init_model_dir` is a saved model to start from (anneal), as in `train_model`."""
    config = {
        "model": model_cfg.model_dump(mode="json"), "optim": optim_cfg.model_dump(mode="json"),
        "train": run_cfg.model_dump(mode="json"), "parallel": dims.model_dump(mode="json"),
        "manifest": str(manifest.resolve()), "data_root": str(data_root.resolve()), "out_dir": str(out_dir.resolve()),
        **({"callbacks": [spec.to_json() for spec in callbacks]} if callbacks else {}),
        **({"init_model_dir": str(init_model_dir.resolve())} if init_model_dir is not None else {}),
    }
    (out_dir / WORKER_CONFIG).write_text(json.dumps(config, indent=2))
    failures_file = out_dir / FAILED_HOSTS_FILE
    launcher = TorchrunLauncher(cluster, out_dir, job_name="kiln-train", nproc_per_node=dims.world_size,
                                env={"OMP_NUM_THREADS": "1"}, failed_hosts_file=failures_file)
    command = ["-m", "tasks.launch.dist_worker", "--config", str(out_dir / WORKER_CONFIG),
               "--out", str(out_dir / WORKER_RESULT)]
    registry = out_dir / REGISTRY_DIR
    failures: list[dict] = []
    for attempt in range(cluster.max_restarts + 1):
        reset_registry(registry)  # so a record cannot be an earlier launch's
        try:
            launcher.launch(command)
            break
        except LaunchError as error:
            if attempt == cluster.max_restarts:
                raise
            # The failed ranks' hosts (from torchrun's failure summary and the ranks' own records) are
            # recorded, so Slurm/Kubernetes renders exclude them; this launcher relaunches here and
            # the job resumes from its last checkpoint.
            log = error.log.read_text(errors="replace") if error.log is not None else str(error)
            hosts = hosts_of_failed_ranks(registry, log) or [socket.gethostname()]
            record_failed_hosts(failures_file, hosts)
            failures.append({"kind": "process_failure", "action": "relaunch", "attempt": attempt + 1,
                             "failed_ranks": failed_ranks(log), "hosts": hosts, "failed_at_unix": time.time(),
                             "error": str(error)[-400:]})
            logging.getLogger(__name__).warning("training job failed: ranks %s on %s (attempt %d); relaunching",
                                                failed_ranks(log), ", ".join(hosts), attempt + 1)
    result = read_result(out_dir / WORKER_RESULT)
    if failures:
        failures[-1]["step"] = result.resumed_from_step or 0
        failures[-1]["time_to_resume_s"] = result.first_step_unix - failures[-1]["failed_at_unix"]
    result.health_events = [*result.health_events, *failures]
    if on_metrics is not None:
        # a relaunched job logs the steps after its checkpoint again: the last record of a step wins
        by_step = {}
        for line in (out_dir / METRICS_LOG).read_text().splitlines():
            metrics = json.loads(line)
            by_step[metrics.pop("step")] = metrics
        for step, metrics in sorted(by_step.items()):
            on_metrics(step, metrics)
        val = {"val_loss": result.val_loss, **{f"val_loss/{d}": v for d, v in result.val_loss_by_domain.items()}}
        on_metrics(result.steps, val)
    if on_event is not None:
        for event in result.health_events:
            on_event(event)
    write_metrics(result, out_dir)  # with the relaunches' events
    return result
