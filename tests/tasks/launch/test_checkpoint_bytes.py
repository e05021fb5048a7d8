"""One config writes the same checkpoint bytes whichever way it trains: in this process, under torchrun,
as a Slurm job. The DCP data files and the train state are compared byte for byte; `.metadata` is not,
as DCP writes a fresh save id (a uuid) and the folder's path into it on every save."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from kiln.tasks.launch.cluster import ClusterSpec
from kiln.tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig
from kiln.tasks.train.data_loader import Mixture
from kiln.tasks.train.launched_training import train_with_launcher
from kiln.tasks.train.loop import train_model
from tests.tasks.launch.test_torchrun_stage import write_tiny_corpus

MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=32)
# one thread everywhere: a launched worker runs with OMP_NUM_THREADS=1, and threads change float sums
RUN = TrainRunConfig(steps=4, batch_size=4, seq_len=32, eval_batches=1, checkpoint_every=2, num_threads=1,
                     seed=7, health={"enabled": False})

pytestmark = pytest.mark.distributed


def checkpoint_bytes(out: Path) -> dict[str, bytes]:
    files = sorted((out / "checkpoints").glob("step_*/*"))
    kept = {f"{f.parent.name}/{f.name}": f.read_bytes() for f in files if f.suffix == ".distcp" or f.suffix == ".json"}
    assert len(kept) == 4, kept.keys()  # steps 2 and 4: one shard and the train state each
    return kept


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def torchrun_checkpoint(corpus, tmp_path_factory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("torchrun")
    launches = []
    train_with_launcher(MODEL, OptimConfig(), RUN, ParallelDims(), ClusterSpec(), corpus, corpus.parent, out,
                        launcher="torchrun", on_launch=launches.append)
    [launch] = launches  # where it ran: this machine, no scheduler's job id; the worker's CPU seconds recorded
    assert (launch["launcher"], launch["job_ids"], len(launch["attempts"])) == ("torchrun", [], 1)
    assert launch["nodes"] == [socket.gethostname()] and launch["worker_cpu_s"] > 0
    return checkpoint_bytes(out)


def test_this_process_and_torchrun_write_identical_checkpoints(corpus, torchrun_checkpoint, tmp_path):
    torch.manual_seed(12345)  # whatever this process drew before: the run seeds its own generator
    torch.rand(5)
    before = torch.get_rng_state()
    train_model(MODEL, OptimConfig(), RUN, Mixture.from_manifest(corpus, corpus.parent), tmp_path)
    assert torch.equal(torch.get_rng_state(), before)  # and gives the caller's back
    assert checkpoint_bytes(tmp_path) == torchrun_checkpoint
    other_seed = tmp_path / "seed8"
    train_model(MODEL, OptimConfig(), RUN.model_copy(update={"seed": 8}), Mixture.from_manifest(corpus, corpus.parent),
                other_seed)
    assert checkpoint_bytes(other_seed)["step_0000002/__0_0.distcp"] != torchrun_checkpoint["step_0000002/__0_0.distcp"]


@pytest.mark.cluster
def test_a_slurm_job_writes_the_torchrun_checkpoint(slurm_cluster, corpus, torchrun_checkpoint, tmp_path):
    # no cluster.rdzv_port: the job picks one free on its node
    launches = []
    train_with_launcher(MODEL, OptimConfig(), RUN, ParallelDims(), ClusterSpec(), corpus, corpus.parent, tmp_path,
                        launcher="slurm", timeout_s=180, job_name="kiln-train-0123abcd", on_launch=launches.append)
    assert checkpoint_bytes(tmp_path) == torchrun_checkpoint
    [launch] = launches
    [job_id] = launch["job_ids"]
    assert (launch["launcher"], launch["job_name"], launch["nodes"]) == ("slurm", "kiln-train-0123abcd",
                                                                         slurm_cluster.node_names)
    assert launch["attempts"] == [{"attempt": 1, "job_id": job_id, "nodes": slurm_cluster.node_names, "excluded": []}]
    assert launch["worker_cpu_s"] > 0  # the job's worker, no child of this process, counted its own CPU
    assert (tmp_path / f"kiln-train-0123abcd-{job_id}.out").is_file()
