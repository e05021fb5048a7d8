"""Two `kiln run` of one config started at once on one fresh working directory, as real processes:
for every key one computes and the other waits and reuses; both succeed; the store stays whole.
A third process with a Prefect home of its own (a worker's) then sees every stage as Cached."""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
from mlflow.tracking import MlflowClient

from kiln.tasks.config import load_config
from kiln.tasks.graph import stage_keys
from kiln.tasks.store import Store

# each `kiln run` starts its own Prefect API server; three runs to tokenize, each allowed 600 s
pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(900)]
UNTIL = "tokenize"
STAGES = ("collect", "clean", "dedup", "decontaminate", "tokenize")


def test_two_runs_of_one_config_at_once_compute_each_stage_once(in_repo, tmp_path):
    work = tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    command = [sys.executable, "-m", "kiln.flows.cli", "run", "configs/tiny.yaml", f"work_dir={work}", "--until", UNTIL]
    runs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(2)]
    outputs = [run.communicate(timeout=600)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], "\n\n".join(o[-3000:] for o in outputs)

    cfg = load_config("configs/tiny.yaml", [f"work_dir={work}"])
    store, keys = Store(cfg.store_root), stage_keys(cfg)
    assert all(store.problems(s, keys[s], checksums=True) == [] for s in STAGES)
    assert not store.partial_folders()

    client = MlflowClient(cfg.tracking_uri)
    children = client.search_runs([client.get_experiment_by_name("kiln").experiment_id],
                                  filter_string="tags.`kiln.stage` != 'pipeline'")
    stage_runs = [r for r in children if "kiln.subrun" not in r.data.tags]
    statuses = Counter((r.data.tags["kiln.stage"], r.data.tags["kiln.status"]) for r in stage_runs)
    assert statuses == Counter({(s, status): 1 for s in STAGES for status in ("ran", "cached")})
    # a stage's sub-runs (clean's quality model) run once too: the run that found the stage complete
    # reused it whole, its sub-runs included
    sub_runs = Counter((r.data.tags["kiln.subrun_key"], r.data.tags["kiln.status"]) for r in children
                       if "kiln.subrun" in r.data.tags)
    assert sub_runs and set(sub_runs.values()) == {1} and {status for _, status in sub_runs} == {"ran"}

    worker_env = {**env, "PREFECT_HOME": str(tmp_path / "worker-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    subprocess.run(command, env=worker_env, check=True, capture_output=True, timeout=600)
    states = subprocess.run([sys.executable, "-c", READ_TASK_STATES], env=worker_env, check=True,
                            capture_output=True, text=True, timeout=300).stdout
    assert json.loads(states.splitlines()[-1]) == {s: "Cached" for s in STAGES}


READ_TASK_STATES = """
import asyncio, json
from prefect.client.orchestration import get_client

async def states():
    async with get_client() as client:
        return {run.name.rsplit("-", 1)[0]: run.state.name  # task runs are named <stage>-<key>
                for run in await client.read_task_runs()}

print(json.dumps(asyncio.run(states())))
"""
