"""The cluster's shape: how many nodes and devices, what they can do, and how to reach them.

The launchers (`tasks.launch.launchers`) read how to reach it; the parallelism planner
(`tasks.train.planner`) reads what the hardware can do; the cluster config section
(`tasks.config.ClusterConfig`) is this plus the launcher choice.
"""

from __future__ import annotations

from tasks.configbase import Section, runtime_field


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
    image: str | None = runtime_field(None)  # Kubernetes container image
    namespace: str = runtime_field("default")  # Kubernetes namespace
    rdzv_port: int = runtime_field(29500, gt=0, lt=65536)
    exclude_hosts: tuple[str, ...] = runtime_field(())  # never schedule here (plus recorded failures)
    max_restarts: int = runtime_field(2, ge=0)  # relaunches of a failed training job (it resumes from checkpoints)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node
