"""The per-process entry point torchrun runs: `python -m kiln.tasks.train.dist_worker --config C --out O`.

The config is one JSON object: `model`, `optim`, `train` and `parallel` sections (their fields
as in `ModelConfig`, `OptimConfig`, `TrainRunConfig`, `ParallelDims`), plus `manifest` (a mix
manifest), `data_root` (what its shard paths are relative to), `out_dir` (checkpoints, resume,
the final model and metrics go there) and optionally `stop_after` (stop once that many steps
are done, as a stopped job would), `init_model_dir` (a saved model to start from), `branch_from` (a checkpoint to go on from) and
`callbacks` (a list of `CallbackSpec`s as JSON: each rank builds them from their dotted paths
and hands them to `train_model`). Every rank runs `train_model` with the `parallel` layout and
registers the scheduler's name for its node (`rank_hosts.node_name`: the Slurm node, the
Kubernetes node) for failure reports; rank 0 writes the `TrainResult` as JSON to `--out`; every
process records its CPU seconds in `out_dir/worker_cpu/` as it ends (the stage's cost counts them).
Several `--config C --out O` pairs run one after another in the same process group, which saves
a torchrun start-up (seconds of imports per process) each.
Run without torchrun, it trains as a single process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
from pathlib import Path

import torch.distributed as dist
from pydantic import ValidationError

from kiln.tasks.errors import ConfigError
from kiln.tasks.launch.rank_hosts import REGISTRY_DIR, node_name, register_rank
from kiln.tasks.train.callbacks import CallbackSpec
from kiln.tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig
from kiln.tasks.train.data_loader import Mixture
from kiln.tasks.train.loop import train_model
from kiln.tasks.train.trainer import write_result

SECTIONS = {"model": ModelConfig, "optim": OptimConfig, "train": TrainRunConfig, "parallel": ParallelDims}
OPTIONS = {"stop_after", "callbacks", "init_model_dir", "branch_from"}
WORKER_CPU_DIR = "worker_cpu"  # in out_dir: each worker process's CPU seconds (`record_cpu`)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, action="append", required=True)
    parser.add_argument("--out", type=Path, action="append", required=True)
    args = parser.parse_args(argv)
    if len(args.config) != len(args.out):
        parser.error(f"got {len(args.config)} --config but {len(args.out)} --out: give one --out per --config")
    runs = [_load(config) for config in args.config]  # all validated before any training starts
    if "RANK" in os.environ:  # under torchrun: say which host this rank runs on, for failure reports
        for _, _, options in runs:
            register_rank(options["out_dir"] / REGISTRY_DIR, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]),
                          host=node_name())
    try:
        for (sections, mixture, options), out in zip(runs, args.out):
            result = train_model(sections["model"], sections["optim"], sections["train"], mixture,
                                 dims=sections["parallel"], **options)
            if not dist.is_initialized() or dist.get_rank() == 0:
                write_result(result, out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for _, _, options in runs:
            record_cpu(options["out_dir"] / WORKER_CPU_DIR)


def record_cpu(folder: Path) -> None:
    """This process's CPU seconds, for the stage's cost: a Slurm or Kubernetes job's processes are no
    children of the process that launched them, so its own accounting never sees them."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    folder.mkdir(parents=True, exist_ok=True)
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("KILN_JOB_ID") or "local"
    (folder / f"{job}-{socket.gethostname()}-{os.getpid()}.json").write_text(json.dumps({"cpu_s": usage.ru_utime + usage.ru_stime}) + "\n")


def worker_cpu_s(folder: Path) -> float:
    """The CPU seconds the workers recorded in `folder` (`record_cpu`)."""
    return sum(json.loads(path.read_text())["cpu_s"] for path in folder.glob("*.json"))


def _load(config: Path) -> tuple[dict, Mixture, dict]:
    raw = json.loads(config.read_text())
    required = {"manifest", "data_root", "out_dir"}
    unknown = set(raw) - set(SECTIONS) - OPTIONS - required
    if unknown or not required <= set(raw):
        raise ConfigError(
            f"{config}: needs keys {', '.join(sorted(required))} and optionally "
            f"{', '.join([*SECTIONS, *sorted(OPTIONS)])}; unknown: {sorted(unknown)}"
        )
    stop_after = raw.get("stop_after")
    if stop_after is not None and (not isinstance(stop_after, int) or stop_after < 1):
        raise ConfigError(f"{config}: stop_after must be a positive integer (steps), got {stop_after!r}")
    specs = raw.get("callbacks", [])
    if not isinstance(specs, list):
        raise ConfigError(f"{config}: callbacks must be a list of {{'target': ..., 'kwargs': ...}}, got {specs!r}")
    try:
        callbacks = [CallbackSpec.from_json(spec).build() for spec in specs]
    except ConfigError as error:
        raise ConfigError(f"{config}: {error}") from None
    init, branch = raw.get("init_model_dir"), raw.get("branch_from")
    options = {"out_dir": Path(raw["out_dir"]), "stop_after": stop_after, "callbacks": callbacks,
               "init_model_dir": Path(init) if init else None, "branch_from": Path(branch) if branch else None}
    sections = {}
    for key, cls in SECTIONS.items():
        try:
            sections[key] = cls.model_validate(raw.get(key, {}))
        except ValidationError as e:
            raise ConfigError(f"{config}: invalid '{key}' section: {e}") from None
    return sections, Mixture.from_manifest(Path(raw["manifest"]), Path(raw["data_root"])), options


if __name__ == "__main__":
    main()
