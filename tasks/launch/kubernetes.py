"""The Kubernetes launcher: an indexed Job of torchrun pods, applied with kubectl."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from tasks.errors import ConfigError
from tasks.launch.launchers import INFRA_DIR, Launcher, LaunchError, LaunchResult, render_template


class KubernetesLauncher(Launcher):
    """An indexed Job (one pod per node, kept off failed nodes) plus the headless Service its pods
    use to find pod 0, from `infra/k8s/train-job.yaml.j2`."""

    name = "kubernetes"
    template = "k8s/train-job.yaml.j2"
    filename = "train-job.yaml"

    def __init__(self, *args, template_dir: Path = INFRA_DIR, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.template_dir = template_dir

    def render(self, command: list[str]) -> str:
        c = self.cluster
        if not c.image:
            raise ConfigError("cluster.image is not set: the kubernetes launcher needs the training container image")
        rdzv_host = f"{self.job_name}-0.{self.job_name}"  # indexed pods are named {job}-{index}
        torchrun = ["torchrun", "--nnodes", str(c.nodes), "--nproc_per_node", str(self.nproc_per_node),
                    "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{rdzv_host}:{c.rdzv_port}",
                    "--rdzv_id", self.job_name, *command]
        return render_template(self.template_dir, self.template,
            job_name=self.job_name, namespace=c.namespace, nodes=c.nodes, gpus_per_node=c.gpus_per_node,
            image=c.image, exclude=self.exclude_hosts(), workdir=str(self.workdir), env=self.env,
            rdzv_port=c.rdzv_port, shell_command="exec " + shlex.join(torchrun),
        )

    def launch(self, command: list[str]) -> LaunchResult:
        path = self._write(self.filename, self.render(command))
        kubectl = self._client("kubectl")
        if kubectl is None:
            return LaunchResult(self.name, submitted=False, rendered=path,
                                message=f"kubectl is not on PATH: wrote {path}; apply it with `kubectl apply -f {path}`")
        done = subprocess.run([kubectl, "apply", "-f", str(path)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise LaunchError(f"kubectl apply -f {path} failed (exit {done.returncode}): {done.stderr.strip()}")
        return LaunchResult(self.name, submitted=True, job_id=self.job_name, rendered=path,
                            message=f"applied {path}: Job {self.cluster.namespace}/{self.job_name}")
