"""Where sweep trials run, without a cluster: shares dealt evenly; trials as torchrun jobs giving the fit
what the stage's own processes give; and the Kubernetes indexed Job of trial shares a valid object of the
real Kubernetes API (strict validation against the official OpenAPI schemas of 1.29, where
backoffLimitPerIndex is on by default, and 1.37). The Slurm path runs on a real Slurm cluster:
tests/tasks/scaling/test_sweep_cluster.py."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from kiln.tasks.errors import ConfigError
from kiln.tasks.launch.cluster import ClusterSpec
from kiln.tasks.launch.kubernetes import KubernetesIndexedLauncher
from kiln.tasks.scaling.sweep import TRIALS_DIR, Trial, run_sweep
from kiln.tasks.scaling.trial_runs import JOBS_DIR, JobTrials, deal
from kiln.tasks.store import Store
from tests.tasks.scaling.test_sweep import shards, subruns, tiny  # noqa: F401 (shards is a fixture)


def trial(name: str, steps: int) -> Trial:
    return Trial(name, "isoflop", 4, 0.01, 8, steps, "u", {"web": 1.0})


def test_trials_are_dealt_longest_first_into_at_most_max_parallel_shares(tmp_path):
    pending = [(trial(f"t{i}", 100 - i), tmp_path / f"t{i}") for i in range(5)]
    assert [[t.name for t, _ in share] for share in deal(pending, 2)] == [["t0", "t2", "t4"], ["t1", "t3"]]
    assert [[t.name for t, _ in share] for share in deal(pending[:1], 4)] == [["t0"]]  # never an empty job


@pytest.mark.parametrize("version", ("1.29", "1.37"))
def test_the_kubernetes_job_of_trial_shares_is_a_valid_indexed_job(version, tmp_path):
    cluster = ClusterSpec(gpus_per_node=8, image="ghcr.io/kiln/train:1", namespace="ml", max_restarts=2,
                          exclude_hosts=("gpu-node-9",))
    jobs = JobTrials("kubernetes", cluster, 3, tmp_path / "jobs")
    launcher = jobs._launcher(tmp_path / "jobs" / "phase1-0", "phase1-0", shares=5)
    assert isinstance(launcher, KubernetesIndexedLauncher)
    job = yaml.safe_load(launcher.render(jobs._command(tmp_path / "jobs" / "phase1-0")))
    assert kubernetes_validate.validate(job, version, strict=True) == version
    spec = job["spec"]
    # five shares, three pods at once, each index retried on its own up to cluster.max_restarts times
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimitPerIndex"]) == (
        "Indexed", 5, 3, 2)
    container = spec["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}  # one process, one GPU: not the node's 8
    assert container["args"][0].startswith("exec python -m kiln.tasks.scaling.trial_runs ")
    assert container["args"][0].endswith(" --share-env JOB_COMPLETION_INDEX")
    affinity = spec["template"]["spec"]["affinity"]["nodeAffinity"]
    assert affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"][0][
        "values"] == ["gpu-node-9"]


def test_a_kubernetes_trials_job_needs_an_image(tmp_path):
    jobs = JobTrials("kubernetes", ClusterSpec(), 2, tmp_path)
    with pytest.raises(ConfigError, match="cluster.image is not set"):
        jobs._launcher(tmp_path / "j", "phase1-0", shares=2).render(["-m", "x"])


@pytest.mark.distributed
def test_a_trial_as_a_torchrun_job_is_committed_with_how_it_was_launched(shards, tmp_path):  # noqa: F811
    """One trial, one torchrun job (the Slurm test compares a whole sweep's numbers with the in-process one's)."""
    results = run_sweep(tiny(1e-3), *shards, subruns(tmp_path), where=JobTrials("torchrun", ClusterSpec(), 2,
                                                                             tmp_path / JOBS_DIR))
    assert [(r.status, r.steps) for r in results] == [("ok", 12)]
    manifest = Store(tmp_path).manifest(TRIALS_DIR, results[0].name)
    assert manifest["launch"]["launcher"] == "torchrun" and len(manifest["launch"]["attempts"]) == 1
    assert (tmp_path / JOBS_DIR / "phase1-0" / "kiln-sweep-phase1-0.log").is_file()  # torchrun's output
