"""The Kubernetes launcher: an indexed Job of torchrun pods (one per node), applied with kubectl and
followed to its end, so that a failed run can be relaunched off the nodes that failed it.

`launch` runs the Job to completion, like the local launchers:

1. `kubectl delete job` of a leftover Job of this name: a Job's pod template cannot be changed, and a
   finished Job's status would be read as this launch's (background deletion: the pods of a
   previous attempt may still be terminating, which is why the Service and the pods' anti-affinity
   select on `kiln/attempt` as well as `kiln/job`);
2. `kubectl apply -f` the rendered Service and Job;
3. poll `kubectl get job -o json` until its `Complete` or `Failed` condition is true;
4. `kubectl get pods -o json` (the Job's own selector) and `kubectl logs` of each pod into
   `{out_dir}/{job_name}.log`;
5. on failure, the nodes (`spec.nodeName`) of the pods that failed first are recorded as failed
   hosts, so the next render's node affinity keeps pods off them, and `KubernetesJobFailed` (a
   `LaunchError`, so relaunch loops resubmit) carries them.

Ctrl-C or SIGTERM from the apply to the end of the wait deletes the Job, then lets the signal do
what it did before (`stop`, from another thread, deletes it too). Without kubectl the manifest is
written and the message says how to apply it.

`KubernetesIndexedLauncher` runs the same way an indexed Job of independent one-process pods (the
sweep's trial jobs: `infra/k8s/trials-job.yaml.j2`), each index retried on its own by Kubernetes.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import subprocess
import time
from pathlib import Path

from kiln.tasks.errors import ConfigError
from kiln.tasks.launch.cluster import DEFAULT_RDZV_PORT
from kiln.tasks.launch.launchers import (
    INFRA_DIR,
    Launcher,
    LaunchError,
    LaunchResult,
    Terminated,
    record_failed_hosts,
    render_template,
    sigterm_raises,
)

logger = logging.getLogger(__name__)

POLL_S = 10.0  # between `kubectl get job` calls; a training Job runs for hours
KUBECTL_TIMEOUT_S = 300.0  # one kubectl call (kubectl's own --request-timeout is unlimited by default)
MAX_POLL_ERRORS = 5  # consecutive failed polls (API server unreachable) before the launch gives up
LOG_TAIL_CHARS = 2000
# kubernetes.io/hostname is a label, so an excluded node must be a valid label value
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # RFC 1035: the Service is named after the Job


class KubernetesJobFailed(LaunchError):
    """The Job failed; `hosts` are the nodes of the pods that failed first (already recorded)."""

    def __init__(self, message: str, log: Path | None, hosts: list[str], job_id: str) -> None:
        super().__init__(message, log=log)
        self.hosts = hosts
        self.job_id = job_id


class KubernetesLauncher(Launcher):
    """An indexed Job (one pod per node, kept off failed nodes) plus the headless Service its pods
    use to find pod 0, from `infra/k8s/train-job.yaml.j2`.

    `volume_claim` (a PersistentVolumeClaim) is mounted at `volume_path` in every pod: the run's
    folder (checkpoints, the rank registry) and its data must be where the orchestrator sees them.
    """

    name = "kubernetes"
    template = "k8s/train-job.yaml.j2"
    filename = "train-job.yaml"

    def __init__(self, *args, template_dir: Path = INFRA_DIR, poll_s: float = POLL_S,
                 volume_claim: str | None = None, volume_path: Path | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if (volume_claim is None) != (volume_path is None):
            raise ConfigError("the kubernetes launcher needs both volume_claim and volume_path, or neither")
        self.template_dir = template_dir
        self.poll_s = poll_s
        self.volume_claim = volume_claim
        self.volume_path = volume_path
        self.attempt = 0  # launches so far; the next render is attempt + 1
        self.failed_nodes: set[str] = set()  # kept here too, for a launcher without a failed-hosts file

    def exclude_hosts(self) -> list[str]:
        return sorted(set(super().exclude_hosts()) | self.failed_nodes)

    def render(self, command: list[str]) -> str:
        """The Service and Job of the next launch."""
        c = self.cluster
        if not c.image:
            raise ConfigError("cluster.image is not set: the kubernetes launcher needs the training container image")
        # indexed pods' hostnames are {job}-{index}, and a hostname is at most 63 characters
        if not _DNS_LABEL.match(self.job_name) or len(self.job_name) + 1 + len(str(c.nodes - 1)) > 63:
            raise ConfigError(f"job name {self.job_name!r} cannot name a Kubernetes Service and its pods: use "
                              "lowercase letters, digits and '-', starting with a letter, short enough that "
                              f"'{self.job_name}-{c.nodes - 1}' has at most 63 characters")
        rdzv_host = f"{self.job_name}-0.{self.job_name}"  # indexed pods are named {job}-{index}
        rdzv_port = c.rdzv_port or DEFAULT_RDZV_PORT  # each pod has its own ports
        torchrun = ["torchrun", "--nnodes", str(c.nodes), "--nproc_per_node", str(self.nproc_per_node),
                    "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{rdzv_host}:{rdzv_port}",
                    "--rdzv_id", self.job_name, *command]
        return render_template(self.template_dir, self.template,
            job_name=self.job_name, namespace=c.namespace, nodes=c.nodes, gpus_per_node=c.gpus_per_node,
            image=c.image, exclude=self._exclusions(), workdir=str(self.workdir), env=self.env, rdzv_port=rdzv_port,
            shell_command="exec " + shlex.join(torchrun), attempt=str(self.attempt + 1),
            volume_claim=self.volume_claim, volume_path=str(self.volume_path) if self.volume_path else None,
        )

    def _exclusions(self) -> list[str]:
        """The excluded hosts that can be node names (the kubernetes.io/hostname label's values)."""
        exclude = []
        for host in self.exclude_hosts():
            if len(host) <= 63 and _LABEL_VALUE.match(host):
                exclude.append(host)
            else:  # say, a pod's FQDN longer than a label: it names no node, and the API would refuse it
                logger.warning("not excluding %r: it is no kubernetes.io/hostname value", host)
        return exclude

    def launch(self, command: list[str]) -> LaunchResult:
        """Run the Job to its end (see the module docstring); raises KubernetesJobFailed when it fails."""
        path = self._write(self.filename, self.render(command))
        kubectl = self._client("kubectl")
        if kubectl is None:
            return LaunchResult(self.name, submitted=False, rendered=path,
                                message=f"kubectl is not on PATH: wrote {path}; apply it with `kubectl apply -f {path}`")
        self.attempt += 1
        self.excluded = self._exclusions()  # what this launch keeps pods off, for the relaunch's record
        self._kubectl(kubectl, "delete", "job", self.job_name, *self._ns, "--ignore-not-found", "--cascade=background",
                      "--wait=true")
        with sigterm_raises("the Kubernetes Job (it was deleted)"):
            try:
                self._kubectl(kubectl, "apply", "-f", str(path))
                job, condition = self._wait(kubectl)
            except (KeyboardInterrupt, Terminated):
                self._kubectl(kubectl, "delete", "job", self.job_name, *self._ns, "--ignore-not-found",
                              "--wait=false", check=False)
                logger.warning("interrupted: deleted Job %s/%s", self.cluster.namespace, self.job_name)
                raise
        log, pods = self._collect_logs(kubectl, job)
        where = f"Job {self.cluster.namespace}/{self.job_name} (attempt {self.attempt})"
        if condition["type"] == "Complete":
            return LaunchResult(self.name, submitted=True, returncode=0, job_id=self.job_name, rendered=path, log=log,
                                message=f"{where} completed; log: {log}")
        hosts = first_failed_nodes(pods)
        self.failed_nodes.update(hosts)
        if self.failed_hosts_file is not None:
            record_failed_hosts(self.failed_hosts_file, hosts)
        reason = f"{condition.get('reason', '')}: {condition.get('message', '')}".strip(": ")
        raise KubernetesJobFailed(
            f"{where} failed ({reason}); first failed on {', '.join(hosts) or 'no node Kiln could name'}; "
            f"log: {log}\n{log.read_text(encoding='utf-8', errors='replace')[-LOG_TAIL_CHARS:]}",
            log=log, hosts=hosts, job_id=self.job_name,
        )

    def stop(self) -> None:
        """Delete the Job (from another thread): the wait then sees it fail or vanish and raises."""
        super().stop()
        kubectl = self._client("kubectl")
        if kubectl is not None:
            self._kubectl(kubectl, "delete", "job", self.job_name, *self._ns, "--ignore-not-found", "--wait=false",
                          check=False)

    @property
    def _ns(self) -> tuple[str, str]:
        return ("--namespace", self.cluster.namespace)

    def _kubectl(self, kubectl: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        try:
            done = subprocess.run([kubectl, *args], capture_output=True, text=True, check=False,
                                  timeout=KUBECTL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            done = subprocess.CompletedProcess([kubectl, *args], 124, "", f"no answer in {KUBECTL_TIMEOUT_S:g} s")
        if check and done.returncode != 0:
            raise LaunchError(f"`kubectl {shlex.join(args)}` failed (exit {done.returncode}): {done.stderr.strip()}")
        return done

    def _wait(self, kubectl: str) -> tuple[dict, dict]:
        """Poll the Job until it is Complete or Failed; (the Job, that condition). On timeout the Job is deleted."""
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        errors = 0
        while True:
            done = self._kubectl(kubectl, "get", "job", self.job_name, *self._ns, "--output", "json", check=False)
            if done.returncode == 0:
                errors = 0
                job = json.loads(done.stdout)
                condition = finished_condition(job)
                if condition is not None:
                    return job, condition
            else:
                errors += 1
                if errors >= MAX_POLL_ERRORS:
                    raise LaunchError(f"`kubectl get job {self.job_name}` failed {errors} times in a row "
                                      f"(exit {done.returncode}): {done.stderr.strip()}")
            if deadline is not None and time.monotonic() > deadline:
                self._kubectl(kubectl, "delete", "job", self.job_name, *self._ns, "--ignore-not-found",
                              "--wait=false", check=False)
                raise LaunchError(f"Job {self.cluster.namespace}/{self.job_name} ran past its {self.timeout_s:g} s "
                                  "timeout and was deleted")
            time.sleep(self.poll_s)

    def _collect_logs(self, kubectl: str, job: dict) -> tuple[Path, list[dict]]:
        """Each pod's log, in index order, under a header naming its node and end; returns (log, pods)."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(job["spec"]["selector"]["matchLabels"].items()))
        listed = self._kubectl(kubectl, "get", "pods", *self._ns, "--selector", selector, "--output", "json",
                               check=False)
        # the Job's outcome stands without its logs: a finished run must not be relaunched for want of them
        pods = json.loads(listed.stdout)["items"] if listed.returncode == 0 else []
        pods.sort(key=lambda pod: (_completion_index(pod), pod["metadata"]["name"]))
        log = self.out_dir / f"{self.job_name}.log"
        with log.open("w", encoding="utf-8") as sink:
            if listed.returncode != 0:
                sink.write(f"(the Job's pods could not be listed: {listed.stderr.strip()})\n")
            for pod in pods:
                name = pod["metadata"]["name"]
                sink.write(f"==> pod {name} (index {_completion_index(pod)}, node "
                           f"{pod['spec'].get('nodeName', '-')}): {_pod_end(pod)} <==\n")
                done = self._kubectl(kubectl, "logs", name, *self._ns, "--container", "trainer", check=False)
                # a pod that never started has no log
                text = done.stdout if done.returncode == 0 else f"(no log: {done.stderr.strip()})\n"
                sink.write(text if text.endswith("\n") or not text else text + "\n")
        return log, pods


def finished_condition(job: dict) -> dict | None:
    """The Job's true `Complete` or `Failed` condition; None while it runs.

    Since Kubernetes 1.31 `SuccessCriteriaMet` / `FailureTarget` come first, while pods still
    terminate: the Job is finished only at `Complete` / `Failed`."""
    for condition in job.get("status", {}).get("conditions") or []:
        if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
            return condition
    return None


def first_failed_nodes(pods: list[dict]) -> list[str]:
    """The nodes of the pods that failed first.

    With `backoffLimit: 0` the first failed pod fails the Job, and the Job controller then stops
    the others, which fail later (exit 143): only the earliest container end counts (a tie within
    the timestamps' one-second resolution keeps both). A failed pod without an end time (its node
    was lost) always counts."""
    failed: list[tuple[str | None, str]] = []
    for pod in pods:
        node = pod["spec"].get("nodeName")
        status = pod.get("status", {})
        if not node or status.get("phase") != "Failed":
            continue
        ends = [s["state"]["terminated"]["finishedAt"] for s in status.get("containerStatuses") or []
                if s.get("state", {}).get("terminated", {}).get("finishedAt")]
        failed.append((min(ends) if ends else None, node))  # RFC 3339 UTC times order as strings
    ends = [end for end, _ in failed if end is not None]
    first = min(ends) if ends else None
    return sorted({node for end, node in failed if end is None or end == first})


def _completion_index(pod: dict) -> int:
    return int(pod["metadata"].get("annotations", {}).get("batch.kubernetes.io/job-completion-index", -1))


def _pod_end(pod: dict) -> str:
    status = pod.get("status", {})
    for container in status.get("containerStatuses") or []:
        if "terminated" in container.get("state", {}):
            terminated = container["state"]["terminated"]
            return f"{status.get('phase')}, exit code {terminated.get('exitCode')} ({terminated.get('reason', '')})"
    return f"{status.get('phase')}{', ' + status['reason'] if status.get('reason') else ''}"


class KubernetesIndexedLauncher(KubernetesLauncher):
    """An indexed Job of `completions` independent one-process pods, `parallelism` at a time, each index
    retried on its own up to `backoff_limit_per_index` times (`infra/k8s/trials-job.yaml.j2`). The
    command finds its index in `JOB_COMPLETION_INDEX`. Launched, waited on, logged and relaunched off
    failed nodes as `KubernetesLauncher` does."""

    template = "k8s/trials-job.yaml.j2"
    filename = "trials-job.yaml"

    def __init__(self, *args, completions: int, parallelism: int, backoff_limit_per_index: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not 0 < parallelism <= completions:
            raise ValueError(f"parallelism {parallelism} must be between 1 and completions {completions}")
        self.completions, self.parallelism, self.backoff_limit_per_index = completions, parallelism, backoff_limit_per_index

    def render(self, command: list[str]) -> str:
        c = self.cluster
        if not c.image:
            raise ConfigError("cluster.image is not set: the kubernetes launcher needs the training container image")
        if not _DNS_LABEL.match(self.job_name) or len(self.job_name) > 63:
            raise ConfigError(f"job name {self.job_name!r} cannot name a Kubernetes Job: use lowercase letters, digits "
                              "and '-', starting with a letter, at most 63 characters")
        return render_template(self.template_dir, self.template,
            job_name=self.job_name, namespace=c.namespace, gpus_per_node=c.gpus_per_node, image=c.image,
            exclude=self._exclusions(), workdir=str(self.workdir), env=self.env, attempt=str(self.attempt + 1),
            shell_command="exec " + shlex.join(["python", *command]), completions=self.completions,
            parallelism=self.parallelism, backoff_limit_per_index=self.backoff_limit_per_index,
            volume_claim=self.volume_claim, volume_path=str(self.volume_path) if self.volume_path else None,
        )
