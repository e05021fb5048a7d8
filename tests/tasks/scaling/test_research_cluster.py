"""Research sub-runs on the real single-node Slurm cluster: one variant against the baseline (3 small
scales x 2 seeds), every run trained inside a Slurm job the study submitted through the sweep's
launchers, with the in-process study's losses number for number; a rerun submits no job."""

from __future__ import annotations

import json

import pytest

from kiln.tasks.launch.cluster import ClusterSpec
from kiln.tasks.launch.local_slurm import free_port
from kiln.tasks.scaling.research import RUNS_KIND, ResearchConfig, chosen_runs, decide_study, resolve_study, run_study
from kiln.tasks.scaling.trial_runs import JOBS_DIR, JobTrials, PoolTrials
from kiln.tasks.store import MANIFEST_FILE
from tests.tasks.scaling.test_research import (
    PRODUCTION_FLOPS,
    SMALL_SCALES,
    Counting,
    committed,
    markov_shards,
    subruns,
    sweep,
)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]  # Slurm jobs on a busy machine


def losses(runs) -> dict:
    return {(r.variant, r.scale, r.seed, r.multiplier): res.val_loss for r, res in runs}


def test_research_runs_train_as_slurm_jobs_with_the_in_process_losses(slurm_cluster, tmp_path):
    root = tmp_path / "tokenize"
    data = markov_shards(root)
    study = resolve_study(ResearchConfig(variants={"layernorm": {"model.norm": "layernorm"}}, scales=SMALL_SCALES,
                                         seeds=2), sweep(), None, PRODUCTION_FLOPS)
    local = run_study(study, data, root, subruns(tmp_path / "local"), "tok", where=PoolTrials(1))

    out = tmp_path / "slurm"
    where = JobTrials("slurm", ClusterSpec(rdzv_port=free_port(), max_restarts=1), 1, out / JOBS_DIR)
    runs = run_study(study, data, root, subruns(out), "tok", where=where)
    assert len(runs) == 12 and committed(out) == 12  # 2 variants x 3 scales x 2 seeds
    assert losses(runs) == losses(local)
    assert decide_study(study, chosen_runs(runs), 1.0) == decide_study(study, chosen_runs(local), 1.0)

    launches = [json.loads(m.read_text())["launch"] for m in (out / RUNS_KIND).glob(f"*/{MANIFEST_FILE}")]
    assert {launch["launcher"] for launch in launches} == {"slurm"}
    # one job per (variant, seed): its three scales trained one after another in one process
    jobs = {a["job_id"] for launch in launches for a in launch["attempts"]}
    assert len(jobs) == 4 and all(len(launch["attempts"]) == 1 for launch in launches)
    assert sorted(p.name for p in (out / JOBS_DIR).iterdir()) == [
        "baseline-seed0-0", "baseline-seed1-0", "layernorm-seed0-0", "layernorm-seed1-0"]

    again = Counting(where)  # every run is committed: no job is submitted
    run_study(study, data, root, subruns(out), "tok", where=again)
    assert again.pending == 0 and sorted(p.name for p in (out / JOBS_DIR).iterdir()) == [
        "baseline-seed0-0", "baseline-seed1-0", "layernorm-seed0-0", "layernorm-seed1-0"]
