"""`cluster.slurm`: the settings a real site needs (account, QOS, memory, constraints, GRES, extra #SBATCH
lines, modules, environment) and `cluster.image` under pyxis rendered into the training script, and that script read by
the local cluster's own `sbatch --test-only`, which refuses what its nodes cannot give."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from kiln.tasks.config import load_config
from kiln.tasks.errors import ConfigError
from kiln.tasks.launch.cluster import ClusterSpec, SlurmSettings
from kiln.tasks.launch.slurm import SlurmLauncher
from tests.tasks.launch.test_launchers import sbatch_directives

COMMAND = ["-m", "kiln.tasks.train.dist_worker", "--config", "run config.json"]
SITE = SlurmSettings(account="proj-llm", qos="high", mem="1G", sbatch_lines=("--comment=kiln-test", "--nice=10"),
                     modules=("cuda/12.4", "nccl"), env={"NCCL_SOCKET_IFNAME": "ib0", "NCCL_DEBUG": "WARN"})


def render(tmp_path: Path, slurm: SlurmSettings, **cluster) -> str:
    return SlurmLauncher(ClusterSpec(slurm=slurm, **cluster), tmp_path, job_name="kiln-train-abc",
                         env={"OMP_NUM_THREADS": "1"}, workdir=tmp_path).render(COMMAND)


def test_site_settings_render_as_sbatch_lines_modules_and_exports(tmp_path):
    script = render(tmp_path, SITE, gpus_per_node=8, partition="gpu")
    directives = sbatch_directives(script)
    assert {key: directives[key] for key in ("--account", "--qos", "--mem", "--comment", "--nice",
                                             "--gpus-per-node")} == {
        "--account": "proj-llm", "--qos": "high", "--mem": "1G", "--comment": "kiln-test", "--nice": "10",
        "--gpus-per-node": "8"}
    assert "--constraint" not in directives and "--gres" not in directives
    body = script[script.index("set -euo pipefail"):]
    assert body.index("module load cuda/12.4\nmodule load nccl\n") < body.index("srun ")
    for line in ("export NCCL_SOCKET_IFNAME=ib0", "export NCCL_DEBUG=WARN", "export OMP_NUM_THREADS=1"):
        assert line in body
    # no cluster.rdzv_port: the job picks a port free on its first node
    assert "rdzv_port=$(python3 -c" in script and '--rdzv_endpoint="$head_addr:$rdzv_port"' in script


def test_gres_replaces_gpus_per_node_and_the_image_runs_srun_under_pyxis(tmp_path):
    slurm = SlurmSettings(gres="gpu:h100:8", constraint="h100&ib", container_mounts=("/lustre:/lustre",))
    script = render(tmp_path, slurm, gpus_per_node=8, image="/lustre/images/kiln-0.1.0-cuda.sqsh")
    directives = sbatch_directives(script)
    assert (directives["--gres"], directives["--constraint"]) == ("gpu:h100:8", "h100&ib")
    assert "--gpus-per-node" not in directives
    srun = shlex.split(script[script.index("srun "):].replace("\\\n", " "))
    assert srun[:6] == ["srun", "--kill-on-bad-exit=1", "--container-image=/lustre/images/kiln-0.1.0-cuda.sqsh",
                        f"--container-workdir={tmp_path}", "--container-mounts=/lustre:/lustre",
                        "python"]  # the image's python, not this machine's interpreter


def test_the_image_is_one_setting_the_old_slurm_field_says_where_it_went():
    with pytest.raises(ConfigError, match=r"cluster\.slurm\.container_image is now cluster\.image .*"
                                          r"set cluster\.image=nvcr\.io#nvidia/pytorch:24\.05-py3"):
        load_config(None, ["cluster.slurm.container_image=nvcr.io#nvidia/pytorch:24.05-py3"])


def test_settings_that_would_break_the_script_are_refused_naming_the_key(tmp_path):
    config = tmp_path / "site.yaml"
    config.write_text("cluster:\n  slurm:\n    account: proj llm\n")
    with pytest.raises(ConfigError, match=r"cluster\.slurm\.account"):
        load_config(str(config), [])
    with pytest.raises(ConfigError, match=r"cluster\.slurm\.sbatch_lines"):
        load_config(None, ["cluster.slurm.sbatch_lines=['#SBATCH --reservation=x']"])
    with pytest.raises(ConfigError, match=r"cluster\.slurm\.mem"):
        load_config(None, ["cluster.slurm.mem=lots"])
    cfg = load_config(None, ["cluster.slurm.qos=high", "cluster.slurm.env={NCCL_DEBUG: INFO}"])
    assert (cfg.cluster.slurm.qos, cfg.cluster.slurm.env) == ("high", {"NCCL_DEBUG": "INFO"})


@pytest.mark.cluster
def test_the_local_cluster_accepts_the_rendered_script_and_refuses_what_its_node_lacks(slurm_cluster, tmp_path):
    def test_only(slurm: SlurmSettings) -> subprocess.CompletedProcess:
        script = tmp_path / "train.sbatch"
        script.write_text(render(tmp_path, slurm))
        return subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True)

    accepted = test_only(SITE)
    assert accepted.returncode == 0 and "to start at" in accepted.stderr, accepted.stderr
    # each setting reaches sbatch: the one node has 4000 MB, no features and no GRES
    for refused, says in ((SlurmSettings(mem="100G"), "node configuration is not available"),
                          (SlurmSettings(constraint="h100"), "feature"),
                          (SlurmSettings(gres="gpu:h100:8"), "generic resource"),
                          (SlurmSettings(sbatch_lines=("--nodelist=no-such-node",)), "node name")):
        done = test_only(refused)
        assert done.returncode != 0 and says in done.stderr.lower(), (refused, done.stderr)


def test_cpus_per_task_is_a_setting_of_training_and_data_jobs(slurm_cluster, tmp_path):
    """`cluster.slurm.cpus_per_task`, a key of its own (no raw sbatch line): a training node's CPUs (with
    GPUs too) and each data array task's; the local cluster takes what its node has and refuses more."""
    from kiln.tasks.data.executors import ExecutorSettings, build_executor

    cfg = load_config("configs/tiny.yaml", ["cluster.slurm.cpus_per_task=2"])
    assert cfg.cluster.slurm.cpus_per_task == 2
    training = render(tmp_path, SlurmSettings(cpus_per_task=6), gpus_per_node=8)
    assert "#SBATCH --cpus-per-task=6" in training and "srun --kill-on-bad-exit=1 --cpus-per-task=6" in training
    assert "#SBATCH --cpus-per-task=1" in render(tmp_path, SlurmSettings())  # CPU-only: one per process, as before

    data = build_executor([], tmp_path / "logs", tasks=4, jobs=2, job_name="kiln_x",
                          settings=ExecutorSettings("slurm", slurm=SlurmSettings(cpus_per_task=2)))
    assert "#SBATCH --cpus-per-task=2" in data.get_launch_file_contents(data.get_sbatch_args(2), "true").splitlines()
    for cpus, accepted in ((slurm_cluster.cpus, True), (slurm_cluster.cpus + 1, False)):
        script = tmp_path / "data.sbatch"
        data = build_executor([], tmp_path / "logs", tasks=4, jobs=2, job_name="kiln_x",
                              settings=ExecutorSettings("slurm", slurm=SlurmSettings(cpus_per_task=cpus, mem="1G")))
        script.write_text(data.get_launch_file_contents(data.get_sbatch_args(2), "true"))
        done = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True)
        assert (done.returncode == 0) is accepted, (cpus, done.stderr)
