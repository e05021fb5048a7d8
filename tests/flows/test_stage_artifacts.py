"""A stage that ran publishes, on the real Prefect API, where its runs ran beside its table."""

import json

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from kiln.flows.stages import _publish
from kiln.tasks.launch.cluster import launch_record
from kiln.tasks.runner import StageOutcome
from kiln.tasks.store import MANIFEST_FILE


def _latest(key: str):
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    return max(found, key=lambda artifact: artifact.created)


def test_a_stage_that_ran_publishes_where_its_runs_ran(prefect_api, tmp_path):
    attempts = [{"attempt": 1, "job_id": "7", "nodes": ["kiln-n1", "kiln-n2"], "failed": True,
                 "failed_hosts": ["kiln-n1"]},
                {"attempt": 2, "job_id": "8", "nodes": ["kiln-n2", "kiln-n3"], "time_to_resume_s": 6.2}]
    launch = {"host": "login1", "launcher": "slurm", "executor": "local",
              "runs": {"train": launch_record("slurm", "kiln-train-0123456789ab", attempts, 4.9)}}
    stage_dir = tmp_path / "store" / "train" / "0123456789ab"
    stage_dir.mkdir(parents=True)
    (stage_dir / MANIFEST_FILE).write_text(json.dumps({"launch": launch}))

    @flow
    def publish() -> None:
        _publish(StageOutcome("train", "0123456789ab", "ran", 1.0, {"val_loss": 5.0}, str(stage_dir), "run-id"))

    publish()
    where = _latest("kiln-train-where").data
    assert where == ("- train: slurm job 7,8 (kiln-train-0123456789ab) on kiln-n1,kiln-n2,kiln-n3; "
                     "attempt 1 failed on kiln-n1, resumed in 6.2 s")
    assert {"metric": "val_loss", "value": 5.0} in json.loads(_latest("kiln-train").data)
