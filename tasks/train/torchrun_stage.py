"""Run a training stage under torchrun and report it as a `TrainResult`, like the in-process loop.

The distributed worker (`tasks.train.dist_worker`) trains with the configured parallel layout
and sharded DCP checkpoints in `out_dir` (a crashed attempt resumes there); this module owns
the launch, then measures the validation loss of the gathered model in this process, so later
stages (anneal, evaluate) read the same `model/` and `metrics.json` whichever path trained it.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import asdict
from pathlib import Path

import torch

from tasks.errors import ConfigError
from tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig
from tasks.train.data_loader import Mixture, validation_batches
from tasks.train.launch import LaunchError, TorchrunLauncher, record_failed_hosts
from tasks.train.loop import FINAL_LOSS_WINDOW, TrainResult, evaluate
from tasks.train.model import load_model
from tasks.train.planner import ClusterSpec

WORKER_CONFIG = "dist_config.json"
WORKER_RESULT = "dist_result.json"
FAILED_HOSTS_FILE = "failed_hosts.json"


def train_with_torchrun(model_cfg: ModelConfig, optim_cfg: OptimConfig, run_cfg: TrainRunConfig, dims: ParallelDims,
                        cluster: ClusterSpec, manifest: Path, data_root: Path, out_dir: Path, *,
                        fault_injection: dict | None = None) -> TrainResult:
    """Train under torchrun; a failed job is relaunched (up to `cluster.max_restarts` times) and resumes
    from its last DCP checkpoint. Each failure is a `process_failure` event with the failed host and
    the measured time from failure to the relaunched job's first step. `fault_injection` is for tests."""
    unsupported = [name for name, on in (("optim.z_loss", optim_cfg.z_loss != 0), ("run.compile", run_cfg.compile),
                                         ("run.activation_checkpointing (use parallel.activation_checkpointing)",
                                          run_cfg.activation_checkpointing)) if on]
    if unsupported:
        raise ConfigError(f"train.parallel spans {dims.world_size} processes, and the distributed worker does not "
                          f"apply {', '.join(unsupported)} yet: turn them off or train in one process")
    if run_cfg.health.enabled:
        logging.getLogger(__name__).warning(
            "the distributed worker has no loss-spike rollback yet: train.run.health is not applied under torchrun")
    started = time.perf_counter()
    config = {
        "model": model_cfg.model_dump(mode="json"), "optim": optim_cfg.model_dump(mode="json"),
        "train": run_cfg.model_dump(mode="json"), "parallel": dims.model_dump(mode="json"),
        "manifest": str(manifest.resolve()), "data_root": str(data_root.resolve()), "out_dir": str(out_dir.resolve()),
        **({"fault_injection": fault_injection} if fault_injection else {}),
    }
    (out_dir / WORKER_CONFIG).write_text(json.dumps(config, indent=2))
    failures_file = out_dir / FAILED_HOSTS_FILE
    launcher = TorchrunLauncher(cluster, out_dir, job_name="kiln-train", nproc_per_node=dims.world_size,
                                env={"OMP_NUM_THREADS": "1"}, failed_hosts_file=failures_file)
    command = ["-m", "tasks.train.dist_worker", "--config", str(out_dir / WORKER_CONFIG),
               "--out", str(out_dir / WORKER_RESULT)]
    events: list[dict] = []
    for attempt in range(cluster.max_restarts + 1):
        try:
            launcher.launch(command)
            break
        except LaunchError as error:
            if attempt == cluster.max_restarts:
                raise
            # On one node the failed host is this one: it is recorded (Slurm/Kubernetes renders exclude
            # recorded hosts) and the job is relaunched here, resuming from its last checkpoint.
            host = socket.gethostname()
            record_failed_hosts(failures_file, [host])
            events.append({"kind": "process_failure", "action": "relaunch", "attempt": attempt + 1, "host": host,
                           "failed_at_unix": time.time(), "error": str(error)[-400:]})
            logging.getLogger(__name__).warning("training job failed on %s (attempt %d); relaunching", host, attempt + 1)
    worker = json.loads((out_dir / WORKER_RESULT).read_text())
    if events:
        events[-1]["step"] = worker["resumed_from_step"]
        events[-1]["time_to_resume_s"] = worker["first_step_unix"] - events[-1]["failed_at_unix"]

    model, _ = load_model(out_dir / "model")
    mixture = Mixture.from_manifest(manifest, data_root)
    val = evaluate(model, validation_batches(mixture, run_cfg.seq_len, run_cfg.eval_batches, run_cfg.batch_size),
                   torch.device("cpu"))
    curve = [tuple(point) for point in worker["loss_curve"]]
    tail = [loss for _, loss in curve[-FINAL_LOSS_WINDOW:]]
    result = TrainResult(
        steps=run_cfg.steps, tokens_seen=run_cfg.steps * run_cfg.batch_size * run_cfg.grad_accum * run_cfg.seq_len,
        num_params=sum(p.numel() for p in model.parameters()), final_train_loss=sum(tail) / len(tail),
        val_loss=sum(val.values()) / len(val), val_loss_by_domain=val, loss_curve=curve,
        lr_curve=[tuple(point) for point in worker["lr_curve"]], wall_s=time.perf_counter() - started,
        tokens_per_s=worker["tokens_per_s"], model_dir=out_dir / "model", resumed_from_step=worker["resumed_from_step"],
        num_rollbacks=0, health_events=events,
    )
    metrics = {k: v for k, v in asdict(result).items() if k != "model_dir"}
    (out_dir / "metrics.json").write_text(json.dumps({**metrics, "world_size": dims.world_size}, indent=2))
    return result
