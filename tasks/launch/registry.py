"""Every launcher by its `cluster.launcher` name: the local ones (`kiln.tasks.launch.launchers`) and the
cluster ones (Slurm, Kubernetes), which build on them; callers choose through `make_launcher`."""

from __future__ import annotations

from pathlib import Path

from kiln.tasks.errors import ConfigError
from kiln.tasks.launch.cluster import ClusterSpec
from kiln.tasks.launch.kubernetes import KubernetesLauncher
from kiln.tasks.launch.launchers import Launcher, LocalLauncher, TorchrunLauncher
from kiln.tasks.launch.slurm import SlurmLauncher

LAUNCHERS: dict[str, type[Launcher]] = {cls.name: cls for cls in (LocalLauncher, TorchrunLauncher, SlurmLauncher,
                                                                  KubernetesLauncher)}


def make_launcher(kind: str, cluster: ClusterSpec, out_dir: Path, **kwargs) -> Launcher:
    """The launcher named by `cluster.launcher` (local, torchrun, slurm, kubernetes)."""
    if kind not in LAUNCHERS:
        raise ConfigError(f"cluster.launcher={kind!r} is not one of {', '.join(LAUNCHERS)}")
    return LAUNCHERS[kind](cluster, out_dir, **kwargs)
