"""Launchers: real local and torchrun processes, rendered Slurm scripts and Kubernetes manifests,
and failed hosts carried into the next render."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import pytest
import yaml

from kiln.tasks.errors import ConfigError
from kiln.tasks.launch.cluster import ClusterSpec
from kiln.tasks.launch.kubernetes import KubernetesLauncher
from kiln.tasks.launch.launchers import (
    LaunchError,
    LocalLauncher,
    TorchrunLauncher,
    read_failed_hosts,
    record_failed_hosts,
)
from kiln.tasks.launch.registry import make_launcher
from kiln.tasks.launch.slurm import SlurmLauncher

SLURM = ClusterSpec(nodes=4, gpus_per_node=8, partition="gpu", time_limit="12:00:00", rdzv_port=29400,
                    exclude_hosts=("node-bad",))
K8S = ClusterSpec(nodes=3, gpus_per_node=8, image="ghcr.io/kiln/train:1", namespace="ml")
COMMAND = ["-m", "flows.train_worker", "--config", "run config.yaml"]

ALL_REDUCE = """
import json, sys
from pathlib import Path
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
Path(sys.argv[1], f"rank{rank}.json").write_text(
    json.dumps({"rank": rank, "world": dist.get_world_size(), "sum": value.item()}))
dist.destroy_process_group()
"""


def test_local_launcher_runs_and_propagates_failure(tmp_path: Path) -> None:
    launcher = LocalLauncher(ClusterSpec(), tmp_path / "out", job_name="ok", workdir=tmp_path)
    result = launcher.launch(["-c", "print('hello from the job')"])
    assert result.returncode == 0 and result.submitted
    assert result.log.read_text() == "hello from the job\n"
    failing = LocalLauncher(ClusterSpec(), tmp_path / "out", job_name="bad", workdir=tmp_path)
    with pytest.raises(LaunchError, match="failed with exit code 3") as error:
        failing.launch(["-c", "import sys; print('boom'); sys.exit(3)"])
    assert "boom" in str(error.value)  # the log tail comes with the error


def test_local_launcher_kills_the_job_on_timeout(tmp_path: Path) -> None:
    launcher = LocalLauncher(ClusterSpec(), tmp_path, job_name="slow", timeout_s=0.5, workdir=tmp_path)
    start = time.monotonic()
    with pytest.raises(LaunchError, match="timeout"):
        launcher.launch(["-c", "import time; time.sleep(60)"])
    assert time.monotonic() - start < 10


@pytest.mark.distributed
def test_torchrun_runs_two_gloo_processes(tmp_path: Path) -> None:
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    launcher = TorchrunLauncher(ClusterSpec(), tmp_path / "out", job_name="gloo", nproc_per_node=2,
                                timeout_s=120, workdir=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert launcher.render([str(script)]).split()[3:] == [
        "--nnodes", "1", "--nproc_per_node", "2", "--standalone", str(script)]
    result = launcher.launch([str(script), str(tmp_path)])
    assert result.returncode == 0
    outputs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert outputs == [{"rank": 0, "world": 2, "sum": 3.0}, {"rank": 1, "world": 2, "sum": 3.0}]


def test_multinode_torchrun_needs_a_rendezvous_host(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rdzv_host"):
        TorchrunLauncher(SLURM, tmp_path).render(COMMAND)
    argv = shlex.split(TorchrunLauncher(SLURM, tmp_path, rdzv_host="node-01").render(COMMAND))
    assert argv[argv.index("--rdzv_endpoint") + 1] == "node-01:29400"


def sbatch_directives(script: str) -> dict[str, str]:
    lines = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]
    return dict(line.split("=", 1) for line in lines)


def test_slurm_script_renders_from_the_cluster(tmp_path: Path) -> None:
    failed = tmp_path / "failed_hosts.json"
    record_failed_hosts(failed, ["node-07"])
    launcher = SlurmLauncher(SLURM, tmp_path / "out", job_name="run-7b", failed_hosts_file=failed,
                             workdir=Path("/shared/kiln"), env={"NCCL_DEBUG": "WARN"})
    script = launcher.render(COMMAND)
    assert script.startswith("#!/bin/bash\n")
    assert sbatch_directives(script) == {
        "--job-name": "run-7b", "--nodes": "4", "--ntasks-per-node": "1", "--gpus-per-node": "8",
        "--partition": "gpu", "--time": "12:00:00", "--output": f"{tmp_path / 'out'}/%x-%j.out",
        "--exclude": "node-07,node-bad",
    }
    srun = script[script.index("srun "):].replace("\\\n", " ")
    argv = shlex.split(srun)
    # torchrun as this interpreter's module: a node needs no torchrun on its PATH
    assert argv[:5] == ["srun", "--kill-on-bad-exit=1", sys.executable, "-m", "torch.distributed.run"]
    assert argv[5:10] == ["--nnodes=4", "--nproc_per_node=8", "--rdzv_id=$SLURM_JOB_ID", "--rdzv_backend=c10d",
                          "--rdzv_endpoint=$head_addr:$rdzv_port"]
    assert "\nrdzv_port=29400\n" in script  # cluster.rdzv_port as given (unset: a free port on the first node)
    assert argv[10:] == COMMAND  # the quoted argument survives the shell
    assert "export NCCL_DEBUG=WARN" in script and "cd /shared/kiln" in script
    # a second failure is carried into the next render
    record_failed_hosts(failed, ["node-02", "node-07"])
    assert sbatch_directives(launcher.render(COMMAND))["--exclude"] == "node-02,node-07,node-bad"


def test_slurm_without_sbatch_writes_the_script_and_says_so(tmp_path: Path) -> None:
    empty_path = tmp_path / "bin"
    empty_path.mkdir()
    launcher = SlurmLauncher(SLURM, tmp_path / "out", search_path=str(empty_path))
    result = launcher.launch(COMMAND)
    assert not result.submitted and result.job_id is None
    assert result.rendered == tmp_path / "out" / "train.sbatch"
    assert result.rendered.read_text() == launcher.render(COMMAND)
    assert "sbatch is not on PATH" in result.message and f"sbatch {result.rendered}" in result.message


def test_kubernetes_manifest(tmp_path: Path) -> None:
    failed = tmp_path / "failed_hosts.json"
    record_failed_hosts(failed, ["gpu-node-3"])
    launcher = KubernetesLauncher(K8S, tmp_path / "out", job_name="run-13b", failed_hosts_file=failed,
                                  workdir=Path("/workspace"), env={"NCCL_DEBUG": "WARN"})
    service, job = yaml.safe_load_all(launcher.render(COMMAND))
    assert (service["kind"], service["spec"]["clusterIP"]) == ("Service", "None")  # the string: a headless Service
    assert job["kind"] == "Job" and job["metadata"]["namespace"] == "ml"
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == "run-13b"
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"] == [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["gpu-node-3"]}]
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"] == spec["template"]["metadata"]["labels"]
    container = pod["containers"][0]
    assert container["image"] == "ghcr.io/kiln/train:1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["env"] == [
        {"name": "KILN_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "NCCL_DEBUG", "value": "WARN"},
    ]
    argv = shlex.split(container["args"][0])
    assert argv[:8] == ["exec", "torchrun", "--nnodes", "3", "--nproc_per_node", "8", "--rdzv_backend", "c10d"]
    assert argv[argv.index("--rdzv_endpoint") + 1] == "run-13b-0.run-13b:29500"
    assert argv[-len(COMMAND):] == COMMAND


def test_kubernetes_without_failures_or_image(tmp_path: Path) -> None:
    _, job = yaml.safe_load_all(KubernetesLauncher(K8S, tmp_path).render(COMMAND))
    affinity = job["spec"]["template"]["spec"]["affinity"]
    assert "nodeAffinity" not in affinity and "podAntiAffinity" in affinity
    with pytest.raises(ConfigError, match="cluster.image"):
        KubernetesLauncher(ClusterSpec(nodes=2, gpus_per_node=8), tmp_path).render(COMMAND)
    empty = tmp_path / "bin"
    empty.mkdir()
    result = KubernetesLauncher(K8S, tmp_path / "out", search_path=str(empty)).launch(COMMAND)
    assert not result.submitted and "kubectl apply -f" in result.message


def test_failed_hosts_accumulate(tmp_path: Path) -> None:
    path = tmp_path / "run" / "failed_hosts.json"
    assert read_failed_hosts(path) == []
    assert record_failed_hosts(path, ["b", "a"]) == ["a", "b"]
    assert record_failed_hosts(path, ["c", "a", ""]) == ["a", "b", "c"]
    assert read_failed_hosts(path) == ["a", "b", "c"]


def test_make_launcher_by_name(tmp_path: Path) -> None:
    assert isinstance(make_launcher("slurm", SLURM, tmp_path), SlurmLauncher)
    with pytest.raises(ConfigError, match="one of local, torchrun, slurm, kubernetes"):
        make_launcher("ray", SLURM, tmp_path)
