"""Training through `cluster.launcher: slurm` on a real two-node Slurm cluster: a 2-process FSDP job
trains like local torchrun, and a rank SIGKILLed inside the job leads to a resubmission off its
node that resumes from the checkpoint with the same losses, the failure recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.tasks.launch.cluster import ClusterSpec
from kiln.tasks.launch.local_slurm import free_port
from kiln.tasks.launch.rank_hosts import REGISTRY_DIR, read_registry
from kiln.tasks.train.callbacks import CallbackSpec
from kiln.tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig
from kiln.tasks.train.launched_training import LAUNCH_FILE, train_with_launcher
from kiln.tasks.train.testing_faults import FAULT_MARKER, FaultInjection
from tests.tasks.launch.test_torchrun_stage import write_tiny_corpus

MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=32)
RUN = TrainRunConfig(steps=8, batch_size=4, seq_len=32, eval_batches=1, checkpoint_every=4, health={"enabled": False})
FSDP = ParallelDims(dp=2)

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def torchrun_losses(corpus, tmp_path_factory) -> list[tuple[int, float]]:
    """The same layout under local torchrun: the curve every Slurm run must reproduce."""
    out = tmp_path_factory.mktemp("torchrun")
    result = train_with_launcher(MODEL, OptimConfig(), RUN, FSDP, ClusterSpec(), corpus, corpus.parent, out,
                                 launcher="torchrun")
    return result.loss_curve


def train_on_slurm(corpus: Path, out: Path, cluster: ClusterSpec, **kwargs):
    out.mkdir()
    return train_with_launcher(MODEL, OptimConfig(), RUN, FSDP, cluster.model_copy(update={"rdzv_port": free_port()}),
                               corpus, corpus.parent, out, launcher="slurm", timeout_s=300, **kwargs)


def test_an_fsdp_job_over_two_nodes_trains_like_local_torchrun(slurm_two_nodes, corpus, torchrun_losses, tmp_path):
    """dp=2 as one process on each of two nodes: the rendezvous crosses nodes, the losses are torchrun's."""
    out = tmp_path / "slurm"
    result = train_on_slurm(corpus, out, ClusterSpec(nodes=2, max_restarts=0))
    assert result.loss_curve == torchrun_losses  # bit for bit: the same layout, the same reductions
    assert result.world_size == 2 and result.resumed_from_step is None and result.health_events == []
    hosts = {record["host"] for record in read_registry(out / REGISTRY_DIR).values()}
    assert hosts == {"kiln-n1", "kiln-n2"}  # each rank registered its Slurm node
    [log] = out.glob("kiln-train-*.out")  # the job's log stays with the run
    assert (out / "model" / "model.pt").is_file()


def test_a_killed_rank_is_resubmitted_off_its_node_and_resumes(slurm_two_nodes, corpus, torchrun_losses, tmp_path):
    """Both ranks on one node; rank 1 is SIGKILLed after step 6. The job fails, its node is excluded
    from the resubmission (the other node can hold the job), which resumes from the step-4 checkpoint
    and ends with the uninterrupted curve."""
    out = tmp_path / "slurm"
    events = []
    result = train_on_slurm(corpus, out, ClusterSpec(nodes=1, max_restarts=1), on_event=events.append,
                            callbacks=[CallbackSpec.of(FaultInjection, kill_rank_at_step=[1, 6])])
    assert (out / FAULT_MARKER).read_text() == "rank 1 killed at step 6\n"
    [event] = result.health_events
    assert events == [event] and event["kind"] == "process_failure" and event["failed_ranks"] == [1]
    [failed_node] = event["hosts"]
    [other_node] = {"kiln-n1", "kiln-n2"} - {failed_node}
    assert event["excluded_on_relaunch"] == [failed_node] and "exclusion_dropped" not in event
    assert {record["host"] for record in read_registry(out / REGISTRY_DIR).values()} == {other_node}
    assert event["step"] == 4 and result.resumed_from_step == 4
    assert result.loss_curve == torchrun_losses
    assert 0 < event["time_to_resume_s"] < 120
    killed_to_resumed = result.first_step_unix - (out / FAULT_MARKER).stat().st_mtime
    print(f"\nkilled rank -> first resumed step: {killed_to_resumed:.1f} s (event: {event['time_to_resume_s']:.1f} s, "
          f"failure noticed after {event['detected_at_unix'] - (out / FAULT_MARKER).stat().st_mtime:.1f} s)")
    assert len(list(out.glob("kiln-train-*.out"))) == 2  # both jobs' logs
    launch = json.loads((out / LAUNCH_FILE).read_text())  # where it ran, attempt by attempt
    first, second = launch["attempts"]
    assert (first["job_id"], first["failed_hosts"], first["failed_ranks"]) == (event["job_id"], [failed_node], [1])
    assert second["nodes"] == [other_node] and second["excluded"] == [failed_node]
    assert second["time_to_resume_s"] == event["time_to_resume_s"] and launch["job_ids"] == [first["job_id"],
                                                                                          second["job_id"]]
