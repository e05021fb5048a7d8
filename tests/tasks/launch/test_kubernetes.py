"""The Kubernetes launcher without a cluster.

Two stand-ins, and what each proves:
- the rendered Service and Job, for several cluster shapes, are valid objects of the real
  Kubernetes API: strict validation against the OpenAPI schemas kubernetes-validate ships
  (Kubernetes 1.25, the oldest it ships, and 1.37, the newest);
- apply / wait / logs / relaunch / cancel run against a recorded kubectl interface:
  tests/fixtures/kubectl-bin/kubectl replays answers shaped like a v1.33 API server's
  (tests/fixtures/kubectl/, themselves checked against the schema) and logs each call, so the
  tests assert the exact command sequence. It is a recording, not a cluster: what a real API
  server, scheduler and kubelet would do with the Job is not exercised here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kiln.tasks.errors import ConfigError
from kiln.tasks.launch.cluster import ClusterSpec
from kiln.tasks.launch.kubernetes import KubernetesJobFailed, KubernetesLauncher, first_failed_nodes
from kiln.tasks.launch.launchers import LaunchError, read_failed_hosts, record_failed_hosts
from kiln.tasks.launch.rank_hosts import failed_ranks
from tests.fixtures.kubectl.make_recordings import CLUSTER, COMMAND, LAUNCH, UIDS, applied_job

REPO = Path(__file__).resolve().parents[3]
FAKE_BIN = REPO / "tests" / "fixtures" / "kubectl-bin"  # holds only `kubectl`: the launcher's search_path
RECORDINGS = REPO / "tests" / "fixtures" / "kubectl"
SCHEMA_VERSIONS = ("1.25", "1.37")
RECORDED_VERSION = "1.33"
NS = ["--namespace", "ml"]


def manifests(launcher: KubernetesLauncher, command: list[str] = COMMAND) -> list[dict]:
    return list(yaml.safe_load_all(launcher.render(command)))


SHAPES = {
    "1 node, CPU only": dict(cluster=ClusterSpec(nodes=1, image="python:3.11-slim")),
    "1 node, 8 GPUs": dict(cluster=ClusterSpec(nodes=1, gpus_per_node=8, image="nvcr.io/nvidia/pytorch:24.12-py3",
                                               namespace="training")),
    "4 nodes, 8 GPUs, excluded and failed hosts, a store volume": dict(
        cluster=ClusterSpec(nodes=4, gpus_per_node=8, image="ghcr.io/kiln/train:1", namespace="ml",
                            exclude_hosts=("gpu-node-9",), rdzv_port=29400),
        failed=["gpu-node-3"], env={"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "1"},
        volume_claim="kiln-store", volume_path=Path("/kiln")),
}


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_rendered_manifests_are_valid_kubernetes_objects(shape: str, version: str, tmp_path: Path) -> None:
    spec = dict(SHAPES[shape])
    failed = tmp_path / "failed_hosts.json"
    record_failed_hosts(failed, spec.pop("failed", []))
    launcher = KubernetesLauncher(spec.pop("cluster"), tmp_path, job_name="run-7b", failed_hosts_file=failed,
                                  workdir=Path("/workspace"), **spec)
    docs = manifests(launcher)
    assert [doc["kind"] for doc in docs] == ["Service", "Job"]
    for doc in docs:
        assert kubernetes_validate.validate(doc, version, strict=True) == version
    job = docs[1]
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == launcher.cluster.nodes
    excluded = pod["affinity"].get("nodeAffinity")
    if launcher.exclude_hosts():
        term = excluded["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
        assert term["matchExpressions"][0]["values"] == ["gpu-node-3", "gpu-node-9"]
    else:
        assert excluded is None


def test_the_validator_is_strict() -> None:
    """A misplaced field (completions in the pod spec) and a misspelt one are refused: the checks above
    would catch a template mistake of that kind."""
    job = manifests(KubernetesLauncher(CLUSTER, Path("unused"), job_name="run-7b"))[1]
    job["spec"]["template"]["spec"]["completions"] = 2
    with pytest.raises(kubernetes_validate.ValidationError, match="'completions' was unexpected"):
        kubernetes_validate.validate(job, "1.37", strict=True)
    job = manifests(KubernetesLauncher(CLUSTER, Path("unused"), job_name="run-7b"))[1]
    job["spec"]["completionmode"] = job["spec"].pop("completionMode")
    with pytest.raises(kubernetes_validate.ValidationError, match="'completionmode' was unexpected"):
        kubernetes_validate.validate(job, "1.37", strict=True)


def test_manifest_shape(tmp_path: Path) -> None:
    launcher = KubernetesLauncher(CLUSTER, tmp_path, **LAUNCH)
    service, job = manifests(launcher)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    # the Service and the pods' anti-affinity select this attempt's pods only
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert labels == service["spec"]["selector"] == {"kiln/job": "run-13b", "kiln/attempt": "1"}
    pod = job["spec"]["template"]["spec"]
    assert pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0][
        "labelSelector"]["matchLabels"] == labels
    assert pod["volumes"][1] == {"name": "store", "persistentVolumeClaim": {"claimName": "kiln-store"}}
    assert pod["containers"][0]["volumeMounts"][1] == {"name": "store", "mountPath": "/kiln"}


def test_names_kubernetes_would_refuse_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot name a Kubernetes Service"):
        KubernetesLauncher(CLUSTER, tmp_path, job_name="Run_13B").render(COMMAND)
    with pytest.raises(ConfigError, match="at most 63 characters"):
        KubernetesLauncher(ClusterSpec(nodes=16, image="x"), tmp_path, job_name="r" * 61).render(COMMAND)
    with pytest.raises(ConfigError, match="both volume_claim and volume_path"):
        KubernetesLauncher(CLUSTER, tmp_path, volume_claim="kiln-store")
    # a recorded "host" that is no node name (a pod's FQDN longer than a label value) is left out of the affinity
    failed = tmp_path / "failed_hosts.json"
    record_failed_hosts(failed, ["gpu-node-4", "run-13b-1." + "x" * 60 + ".svc.cluster.local"])
    job = manifests(KubernetesLauncher(CLUSTER, tmp_path, job_name="run-13b", failed_hosts_file=failed))[1]
    term = job["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["gpu-node-4"]


def recorded_objects() -> list[tuple[str, dict]]:
    objects = []
    for path in sorted(RECORDINGS.glob("*.json")):
        answer = json.loads(path.read_text())
        if "kind" in answer:  # scenario files have none
            objects += [(path.name, item) for item in (answer["items"] if answer["kind"] == "List" else [answer])]
    return objects


def test_recordings_are_api_objects_for_the_manifest_kiln_applies() -> None:
    objects = recorded_objects()
    assert sorted({kind for kind in (obj["kind"] for _, obj in objects)}) == ["Job", "Pod"]
    for name, obj in objects:
        assert kubernetes_validate.validate(obj, RECORDED_VERSION, strict=True), name
    for attempt, failed in ((1, ()), (2, ("gpu-node-4",))):
        job = json.loads((RECORDINGS / f"job-attempt{attempt}-running.json").read_text())
        applied = json.loads(job["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"])
        assert applied == applied_job(attempt, failed), (
            "the recordings answer an older template: rerun python tests/fixtures/kubectl/make_recordings.py")


def use_recording(monkeypatch: pytest.MonkeyPatch, scenario: Path, state: Path) -> None:
    monkeypatch.setenv("KUBECTL_FAKE_SCENARIO", str(scenario))
    monkeypatch.setenv("KUBECTL_FAKE_STATE", str(state))


def calls(state: Path) -> list[list[str]]:
    return [json.loads(line) for line in (state / "calls.jsonl").read_text().splitlines()]


def test_failed_job_is_relaunched_off_the_node_that_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against recorded kubectl answers: attempt 1 fails (rank 11 SIGKILLed on gpu-node-4), attempt 2
    runs with gpu-node-4 excluded and completes."""
    state = tmp_path / "kubectl"
    use_recording(monkeypatch, RECORDINGS / "relaunch.json", state)
    failed_hosts = tmp_path / "failed_hosts.json"
    out = tmp_path / "out"
    launcher = KubernetesLauncher(CLUSTER, out, failed_hosts_file=failed_hosts, search_path=str(FAKE_BIN),
                                  poll_s=0.01, **LAUNCH)
    with pytest.raises(KubernetesJobFailed, match="BackoffLimitExceeded") as failure:
        launcher.launch(COMMAND)
    assert failure.value.hosts == ["gpu-node-4"] == read_failed_hosts(failed_hosts)
    assert (failure.value.job_id, launcher.excluded) == ("run-13b", [])
    log = failure.value.log.read_text()
    assert log.startswith("==> pod run-13b-0-t9wqz (index 0, node gpu-node-1): Failed, exit code 1 (Error) <==\n")
    assert "==> pod run-13b-1-m4hkd (index 1, node gpu-node-4): Failed, exit code 1 (Error) <==\n" in log
    assert failed_ranks(log) == [11]  # both pods' torchrun summaries are intact for the rank parser
    result = launcher.launch(COMMAND)  # what a relaunch loop does with the LaunchError
    assert (result.submitted, result.returncode, result.job_id) == (True, 0, "run-13b")
    assert launcher.excluded == ["gpu-node-4"]
    assert "run-13b-1-d8fjs (index 1, node gpu-node-2): Succeeded, exit code 0 (Completed)" in result.log.read_text()

    manifest = str(out / "train-job.yaml")
    delete_leftover = ["delete", "job", "run-13b", *NS, "--ignore-not-found", "--cascade=background", "--wait=true"]
    poll = ["get", "job", "run-13b", *NS, "--output", "json"]

    def follow(attempt: int, pods: list[str]) -> list[list[str]]:
        selector = f"batch.kubernetes.io/controller-uid={UIDS[attempt]}"  # the Job's own selector
        return [poll, poll, ["get", "pods", *NS, "--selector", selector, "--output", "json"],
                *[["logs", pod, *NS, "--container", "trainer"] for pod in pods]]

    assert calls(state) == [
        delete_leftover, ["apply", "-f", manifest], *follow(1, ["run-13b-0-t9wqz", "run-13b-1-m4hkd"]),
        delete_leftover, ["apply", "-f", manifest], *follow(2, ["run-13b-0-x2b7n", "run-13b-1-d8fjs"]),
    ]
    first, second = (list(yaml.safe_load_all((state / f"applied-{n}.yaml").read_text()))[1] for n in (1, 2))
    assert "nodeAffinity" not in first["spec"]["template"]["spec"]["affinity"]
    assert second["spec"]["template"]["spec"]["affinity"]["nodeAffinity"] == {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["gpu-node-4"]}]}]}}
    assert (first["metadata"]["labels"]["kiln/attempt"], second["metadata"]["labels"]["kiln/attempt"]) == ("1", "2")


CANCEL_SCRIPT = """
import signal, sys
from pathlib import Path
from kiln.tasks.launch.kubernetes import KubernetesLauncher
from kiln.tasks.launch.launchers import LaunchCancelled
from tests.fixtures.kubectl.make_recordings import CLUSTER, COMMAND, LAUNCH

signal.signal(signal.SIGINT, signal.default_int_handler)  # even where the test runner ignores SIGINT
if sys.argv[3] == "own-handler":
    def own(signum, frame):
        print("own handler ran", flush=True)
    signal.signal(signal.SIGTERM, own)
launcher = KubernetesLauncher(CLUSTER, Path(sys.argv[1]), search_path=sys.argv[2], poll_s=0.05, **LAUNCH)
try:
    launcher.launch(COMMAND)
except LaunchCancelled as error:
    assert signal.getsignal(signal.SIGTERM) is own, "the previous handler is back"
    print(f"cancelled: {error}", flush=True)
    sys.exit(3)
"""


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C", "SIGTERM, own handler"])
def test_an_interrupted_wait_deletes_the_job(how: str, tmp_path: Path) -> None:
    state = tmp_path / "kubectl"
    env = {**os.environ, "KUBECTL_FAKE_SCENARIO": str(RECORDINGS / "cancel.json"), "KUBECTL_FAKE_STATE": str(state),
           "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", CANCEL_SCRIPT, str(tmp_path / "out"), str(FAKE_BIN),
                             "own-handler" if "own" in how else "default"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (state / "calls.jsonl").exists() or not any(c[:2] == ["get", "job"] for c in calls(state)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT if how == "Ctrl-C" else signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert calls(state)[-1] == ["delete", "job", "run-13b", *NS, "--ignore-not-found", "--wait=false"]
    assert calls(state)[:2] == [
        ["delete", "job", "run-13b", *NS, "--ignore-not-found", "--cascade=background", "--wait=true"],
        ["apply", "-f", str(tmp_path / "out" / "train-job.yaml")]]
    if how == "SIGTERM":
        assert proc.returncode == -signal.SIGTERM, stderr  # the default action, after the deletion
    elif how == "Ctrl-C":
        assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in stderr, stderr
    else:
        assert proc.returncode == 3, stderr
        assert stdout.splitlines() == ["own handler ran",
                                       "cancelled: SIGTERM while waiting for the Kubernetes Job (it was deleted): it was cancelled"]


def test_a_job_past_its_timeout_is_deleted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "kubectl"
    use_recording(monkeypatch, RECORDINGS / "cancel.json", state)
    launcher = KubernetesLauncher(CLUSTER, tmp_path / "out", search_path=str(FAKE_BIN), poll_s=0.01, timeout_s=0.2,
                                  **LAUNCH)
    with pytest.raises(LaunchError, match="timeout and was deleted"):
        launcher.launch(COMMAND)
    assert calls(state)[-1] == ["delete", "job", "run-13b", *NS, "--ignore-not-found", "--wait=false"]


def test_an_unreachable_api_server_ends_the_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = tmp_path / "unreachable.json"
    scenario.write_text(json.dumps({"answers": {
        "delete job": [{}], "apply": [{"stdout": "service/run-13b created\njob.batch/run-13b created\n"}],
        "get job": [{"rc": 1, "stderr": "Unable to connect to the server: dial tcp 10.0.0.1:6443: i/o timeout\n"}]}}))
    use_recording(monkeypatch, scenario, tmp_path / "kubectl")
    launcher = KubernetesLauncher(CLUSTER, tmp_path / "out", search_path=str(FAKE_BIN), poll_s=0.01, **LAUNCH)
    with pytest.raises(LaunchError, match="failed 5 times in a row .*i/o timeout"):
        launcher.launch(COMMAND)


def test_kubectl_refusing_the_manifest_is_a_launch_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = tmp_path / "refused.json"
    scenario.write_text(json.dumps({"answers": {"delete job": [{}], "apply": [{"rc": 1, "stderr": (
        'Error from server (Forbidden): error when creating "train-job.yaml": jobs.batch is forbidden: User '
        '"kiln" cannot create resource "jobs" in API group "batch" in the namespace "ml"\n')}]}}))
    use_recording(monkeypatch, scenario, tmp_path / "kubectl")
    launcher = KubernetesLauncher(CLUSTER, tmp_path / "out", search_path=str(FAKE_BIN), **LAUNCH)
    with pytest.raises(LaunchError, match="cannot create resource"):
        launcher.launch(COMMAND)


def test_first_failed_nodes() -> None:
    def pod(node: str, phase: str, finished: str | None = None) -> dict:
        statuses = [{"state": {"terminated": {"finishedAt": finished}}}] if finished else []
        return {"spec": {"nodeName": node}, "status": {"phase": phase, "containerStatuses": statuses}}

    assert first_failed_nodes([pod("a", "Failed", "2026-12-03T12:41:09Z"), pod("b", "Failed", "2026-12-03T12:41:07Z"),
                               pod("c", "Succeeded", "2026-12-03T12:40:00Z")]) == ["b"]
    # same second: both; a pod lost with its node (no end time): always
    assert first_failed_nodes([pod("a", "Failed", "2026-12-03T12:41:07Z"), pod("b", "Failed", "2026-12-03T12:41:07Z"),
                               pod("d", "Failed")]) == ["a", "b", "d"]
    assert first_failed_nodes([{"spec": {}, "status": {"phase": "Failed"}}]) == []  # never scheduled
