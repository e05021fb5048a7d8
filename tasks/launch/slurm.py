"""The Slurm launcher: an sbatch script that runs torchrun under srun on every node of the allocation."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tasks.launch.launchers import INFRA_DIR, Launcher, LaunchError, LaunchResult, render_template


class SlurmLauncher(Launcher):
    """An sbatch script from `infra/slurm/train.sbatch.j2`: one srun task per node, each a torchrun
    whose c10d rendezvous runs on the allocation's first node."""

    name = "slurm"
    template = "slurm/train.sbatch.j2"
    filename = "train.sbatch"

    def __init__(self, *args, template_dir: Path = INFRA_DIR, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.template_dir = template_dir

    def render(self, command: list[str]) -> str:
        c = self.cluster
        return render_template(self.template_dir, self.template,
            job_name=self.job_name, nodes=c.nodes, gpus_per_node=c.gpus_per_node, nproc_per_node=self.nproc_per_node,
            partition=c.partition, time_limit=c.time_limit, exclude=self.exclude_hosts(), log_dir=str(self.out_dir),
            workdir=str(self.workdir), env=self.env, rdzv_port=c.rdzv_port, command=command,
        )

    def launch(self, command: list[str]) -> LaunchResult:
        path = self._write(self.filename, self.render(command))
        sbatch = self._client("sbatch")
        if sbatch is None:
            return LaunchResult(self.name, submitted=False, rendered=path,
                                message=f"sbatch is not on PATH: wrote {path}; submit it with `sbatch {path}`")
        done = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise LaunchError(f"sbatch rejected {path} (exit {done.returncode}): {done.stderr.strip()}")
        job_id = done.stdout.strip().split(";")[0]
        return LaunchResult(self.name, submitted=True, job_id=job_id, rendered=path,
                            message=f"submitted Slurm job {job_id} from {path}")
