"""The cluster's shape: how many nodes and devices, what they can do, and how to reach them; and the
record of where a run went on it (`launch_record`).

The launchers (`tasks.launch.launchers`) read how to reach it; the parallelism planner
(`tasks.train.planner`) reads what the hardware can do; the cluster config section
(`tasks.config.ClusterConfig`) is this plus the launcher choice.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import field_validator, model_validator

from kiln.tasks.configbase import Section, runtime_field

DEFAULT_RDZV_PORT = 29500  # torchrun's; where each job has its own network (a Kubernetes pod)
_WORD = re.compile(r"^[^\s'\"\\]+$")  # one shell word, nothing to quote or escape
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SlurmSettings(Section):
    """`cluster.slurm`: what a real site's jobs need beyond the cluster's shape. Runtime only.

    Read by the Slurm launcher (training jobs, sweep trials: `infra/slurm/train.sbatch.j2`) and by the
    data stages' Slurm executor (datatrove's array jobs), except `gres`, which only training asks for.
    The image both run in is `cluster.image` (pyxis); `container_mounts` go with it. Without an image a
    job runs the orchestrator's own environment, found at its path on the node (so on a shared
    filesystem) after `modules` are loaded; a data job in an image loads none (the image is its
    environment), a training job loads them before `srun` as the site's script would.
    """

    account: str | None = runtime_field(None)  # sbatch --account
    qos: str | None = runtime_field(None)  # sbatch --qos
    mem: str | None = runtime_field(None, pattern=r"^\d+[KMGT]?$")  # --mem per node (64G); 0: all of it
    constraint: str | None = runtime_field(None)  # --constraint node features, e.g. "h100&ib"
    gres: str | None = runtime_field(None)  # --gres, e.g. gpu:h100:8, instead of --gpus-per-node
    # --cpus-per-task of every job's task: a training node's (default: one per process on a CPU-only
    # cluster, Slurm's default with GPUs) and each data array task's (default 1: a rank is one process)
    cpus_per_task: int | None = runtime_field(None, gt=0)
    sbatch_lines: tuple[str, ...] = runtime_field(())  # more options, each an #SBATCH line: "--reservation=big"
    container_mounts: tuple[str, ...] = runtime_field(())  # with cluster.image: pyxis --container-mounts, SRC:DST each
    modules: tuple[str, ...] = runtime_field(())  # `module load` each before srun (cuda/12.4, nccl, ...)
    env: dict[str, str] = runtime_field({})  # exported in the job: NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...

    @model_validator(mode="before")
    @classmethod
    def _image_moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "container_image" in data:
            raise ValueError(f"cluster.slurm.container_image is now cluster.image (one image for Slurm's training "
                             f"and data jobs and for Kubernetes): set cluster.image={data['container_image']}")
        return data

    @field_validator("account", "qos", "constraint", "gres")
    @classmethod
    def _one_word(cls, value: str | None) -> str | None:
        if value is not None and not _WORD.match(value):
            raise ValueError(f"{value!r} must be one word without spaces or quotes (it goes on an #SBATCH line)")
        return value

    @field_validator("sbatch_lines")
    @classmethod
    def _options(cls, lines: tuple[str, ...]) -> tuple[str, ...]:
        for line in lines:
            if not line.startswith("-") or "\n" in line:
                raise ValueError(f"{line!r} is not an sbatch option: give it as on the command line, e.g. "
                                 "--reservation=big (Kiln writes the #SBATCH)")
        return lines

    @field_validator("container_mounts", "modules")
    @classmethod
    def _words(cls, words: tuple[str, ...]) -> tuple[str, ...]:
        for word in words:
            cls._one_word(word)
        return words

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        bad = [name for name in env if not _ENV_NAME.match(name)]
        if bad:
            raise ValueError(f"{bad} are not environment variable names")
        return env


def container_flags(image: str | None, mounts: tuple[str, ...], workdir: Path | str) -> dict[str, str]:
    """pyxis's `srun` options that run a job step in `image` (none without an image), starting in `workdir`
    (the orchestrator's folder, at the same path on the nodes) with `mounts` (cluster.slurm.container_mounts)."""
    if not image:
        return {}
    return {"container-image": image, "container-workdir": str(workdir),
            **({"container-mounts": ",".join(mounts)} if mounts else {})}


class ClusterSpec(Section):
    """The hardware a run gets and how to reach it. Runtime only: it never changes a result's key.

    Field names shared with `ClusterConfig` (nodes, gpus_per_node, partition) keep their meaning
    and defaults, so the cluster section can be this class plus the executor/launcher choice.
    Memory is in GiB (an "80 GB" H100 has 80 GiB); bandwidths are GB/s per device, one direction.
    """

    nodes: int = runtime_field(1, gt=0)
    gpus_per_node: int = runtime_field(0, ge=0)
    partition: str | None = runtime_field(None)
    accelerator: str = runtime_field("H100-SXM-80GB")
    memory_gb: float = runtime_field(80.0, gt=0)
    peak_tflops: float = runtime_field(989.0, gt=0)  # dense bf16 (H100 SXM)
    intra_node_gbps: float = runtime_field(450.0, gt=0)  # NVLink 4, per GPU per direction
    inter_node_gbps: float = runtime_field(50.0, gt=0)  # one 400 Gb/s NIC per GPU
    mfu: float = runtime_field(0.4, gt=0, le=1)  # model-FLOPs utilisation assumed for the matmuls
    reserved_gb: float = runtime_field(4.0, ge=0)  # CUDA context, NCCL buffers, fragmentation
    time_limit: str = runtime_field("24:00:00")  # Slurm --time
    # the image Kiln's jobs run in: Kubernetes pods, and Slurm's training and data jobs under pyxis
    # (srun --container-image); None on Slurm: the orchestrator's environment (README, "Container image")
    image: str | None = runtime_field(None)
    namespace: str = runtime_field("default")  # Kubernetes namespace
    # None: Slurm jobs pick a port free on their first node (two jobs may share it); torchrun over
    # several nodes and Kubernetes pods use DEFAULT_RDZV_PORT
    rdzv_port: int | None = runtime_field(None, gt=0, lt=65536)
    exclude_hosts: tuple[str, ...] = runtime_field(())  # never schedule here (plus recorded failures)
    max_restarts: int = runtime_field(2, ge=0)  # relaunches of a failed training job (it resumes from checkpoints)
    slurm: SlurmSettings = runtime_field(SlurmSettings())

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def launch_record(launcher: str, job_name: str | None, attempts: list[dict], worker_cpu: float) -> dict[str, Any]:
    """Where a run ran, for its stage's manifest, MLflow tags and `kiln status`: the launcher (or
    executor), the job's name, each attempt (job id, nodes, what failed and on which hosts, what the
    next one excluded, the time to resume) and its workers' own CPU seconds."""
    return {"launcher": launcher, "job_name": job_name, "job_ids": [a["job_id"] for a in attempts if a["job_id"]],
            "nodes": sorted({node for a in attempts for node in a["nodes"]}), "attempts": attempts,
            "worker_cpu_s": worker_cpu}


def where_it_ran(launch: dict[str, Any]) -> list[str]:
    """A stage manifest's `launch` block as lines (`kiln status`, the stage's Prefect artifact): each
    run's launcher, jobs, nodes, and the attempts that failed and how fast the next one resumed."""
    lines = []
    for run, record in launch.get("runs", {}).items():
        jobs = f" job {','.join(record['job_ids'])} ({record['job_name']})" if record["job_ids"] else ""
        line = f"{run}: {record['launcher']}{jobs} on {','.join(record['nodes']) or 'no node recorded'}"
        failed = [a for a in record["attempts"] if a.get("failed")]
        if failed:
            # a sweep trial's attempt says how its job ended (a cancelled job blames no node)
            line += "; " + "; ".join(f"attempt {a['attempt']} failed "
                                     + (f"(job {a['job_id']} {a['state']})" if a.get("state") else
                                        f"on {','.join(a.get('failed_hosts') or []) or '?'}") for a in failed)
            resumed = record["attempts"][-1].get("time_to_resume_s")
            line += f", resumed in {resumed:.1f} s" if resumed is not None else ""
        lines.append(line)
        lines += [f"  {line}" for attempt in record["attempts"] if "tasks" in attempt for line in _job_lines(attempt)]
    return lines


def _job_lines(attempt: dict[str, Any]) -> list[str]:
    """A data pipeline's Slurm job as the scheduler recorded it (`slurm_jobs.journal_launch`): its ranks,
    whether Kiln adopted it from a driver that died, and each array task's state, node, start and end."""
    how = " (adopted from a driver that died)" if attempt.get("adopted") else ""
    ranks = f", ranks {','.join(map(str, attempt['ranks']))}" if "ranks" in attempt else ""
    head = f"job {attempt['job_id']}{how}{ranks}"
    log = [f"  log: {attempt['log']}"] if attempt.get("log") else []
    if not attempt["tasks"]:
        return [f"{head}: the scheduler kept no record of it", *log]
    return [f"{head}: " + "; ".join(task_line(t) for t in attempt["tasks"]), *log]


def task_line(task: dict[str, Any]) -> str:
    """One array task (or job) as the scheduler recorded it: `task 1 CANCELLED on kiln-n2 16:18:12-16:18:40`."""
    span = (f" {(task.get('start') or '?').rpartition('T')[2]}-{(task.get('end') or '?').rpartition('T')[2]}"
            if task.get("start") else "")
    name = f"task {task['task']}" if task.get("task") is not None else "ran"
    return f"{name} {task['state']} on {','.join(task['nodes']) or 'no node'}{span}"
