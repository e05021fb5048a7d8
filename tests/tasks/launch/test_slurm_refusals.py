"""Training through Slurm when a retry cannot help, on the real single-node cluster: a submission sbatch
refuses (a partition the cluster lacks, no SLURM_CONF) fails at once with sbatch's message, and a job a
person scancels stops the run; neither is resubmitted nor counts its node as failed."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from pathlib import Path

import pytest

from kiln.tasks.errors import is_retryable
from kiln.tasks.launch.cluster import ClusterSpec
from kiln.tasks.launch.launchers import LaunchError
from kiln.tasks.launch.local_slurm import free_port
from kiln.tasks.launch.slurm import SlurmJobCancelled
from kiln.tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig
from kiln.tasks.train.launched_training import FAILED_HOSTS_FILE, train_with_launcher
from tests.tasks.launch.test_torchrun_stage import write_tiny_corpus

pytestmark = [pytest.mark.cluster, pytest.mark.distributed]

MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=32)
RUN = TrainRunConfig(steps=4, batch_size=4, seq_len=32, eval_batches=1, health={"enabled": False})


def train(tmp_path: Path, cluster: ClusterSpec, **kwargs):
    corpus = write_tiny_corpus(tmp_path / "data")
    out = tmp_path / "train"
    out.mkdir()
    return train_with_launcher(MODEL, OptimConfig(), RUN, ParallelDims(), cluster.model_copy(
        update={"rdzv_port": free_port(), "max_restarts": 2}), corpus, corpus.parent, out, launcher="slurm",
        timeout_s=120, **kwargs)


@pytest.mark.parametrize("refusal", ["partition", "no SLURM_CONF"])
def test_a_refused_submission_fails_at_once_with_sbatchs_message(slurm_cluster, tmp_path, caplog, monkeypatch,
                                                                 refusal):
    cluster = ClusterSpec(partition="gpu") if refusal == "partition" else ClusterSpec()
    if refusal == "no SLURM_CONF":
        monkeypatch.setenv("SLURM_CONF", str(tmp_path / "nowhere" / "slurm.conf"))
    with caplog.at_level(logging.WARNING), pytest.raises(LaunchError) as raised:
        train(tmp_path, cluster)
    message = str(raised.value)
    assert not is_retryable(raised.value)
    if refusal == "partition":
        assert message.startswith("sbatch rejected") and "invalid partition" in message.lower()
    else:  # said before any client spends 60 s retrying the missing file
        assert message.startswith(f"SLURM_CONF={tmp_path}/nowhere/slurm.conf is not a file")
    assert not any("relaunching" in r.getMessage() for r in caplog.records)  # one submission, no retry
    assert not (tmp_path / "train" / FAILED_HOSTS_FILE).exists()


def test_a_scancelled_training_job_stops_the_run_without_blaming_its_node(slurm_cluster, tmp_path, caplog):
    name = "kiln-train-scancel"
    cancelled: list[str] = []

    def scancel_when_running() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not cancelled:
            queued = subprocess.run(["squeue", "--noheader", "--name", name, "--format", "%i %T"],
                                    capture_output=True, text=True).stdout.split()
            if queued[1:2] == ["RUNNING"]:
                subprocess.run(["scancel", queued[0]], check=True)
                cancelled.append(queued[0])
            time.sleep(0.2)

    canceller = threading.Thread(target=scancel_when_running)
    canceller.start()
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(SlurmJobCancelled) as raised:
            train(tmp_path, ClusterSpec(), job_name=name)
    finally:
        canceller.join()
    assert cancelled == [raised.value.job_id] and not is_retryable(raised.value)
    assert "was cancelled (scancel)" in str(raised.value) and raised.value.hosts == []
    assert not any("relaunching" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "train" / FAILED_HOSTS_FILE).exists()
    assert len(list((tmp_path / "train").glob(f"{name}-*.out"))) <= 1  # one job, never resubmitted
