"""Naming the hosts of a torchrun job's failed ranks: real summaries parsed, then a real failing job."""

from __future__ import annotations

import json
import os
import socket
from datetime import datetime
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from kiln.tasks.launch.cluster import ClusterSpec
from kiln.tasks.launch.launchers import LaunchError, TorchrunLauncher
from kiln.tasks.launch.rank_hosts import (
    RankFailure,
    failed_ranks,
    failed_ranks_and_hosts,
    hosts_of_failed_ranks,
    parse_failures,
    read_registry,
    register_rank,
    reset_registry,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
# captured from `torchrun --nproc_per_node 2 --standalone` (torch 2.13, gloo) where rank 1 SIGKILLs
# itself after a barrier: the agent then SIGTERMs rank 0. Its host line reads `localhost`, which is
# what socket.getfqdn() gave on that machine.
SIGKILL = (FIXTURES / "torchrun_failure_sigkill.log").read_text()
# 3 processes, rank 1 raises inside a @record-decorated main: an error file and a traceback
EXCEPTION = (FIXTURES / "torchrun_failure_exception.log").read_text()


def _write_record(registry: Path, rank: int, host: str, pid: int) -> None:
    registry.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "local_rank": rank, "host": host, "pid": pid, "started_unix": 0.0}
    (registry / f"rank_{rank:05d}.json").write_text(json.dumps(record))


def test_parses_the_real_sigkill_summary() -> None:
    assert parse_failures(SIGKILL) == [
        RankFailure(rank=0, local_rank=0, host="localhost", exitcode=-15, pid=16174,
                    time=datetime(2026, 12, 2, 15, 59, 23), root_cause=False),
        RankFailure(rank=1, local_rank=1, host="localhost", exitcode=-9, pid=16176,
                    time=datetime(2026, 12, 2, 15, 59, 22), root_cause=True),
    ]
    # rank 0 was stopped by its agent: only the root cause is to blame
    assert failed_ranks(SIGKILL) == [1]
    assert failed_ranks_and_hosts(SIGKILL) == {1: "localhost"}


def test_parses_a_root_cause_with_an_error_file_and_traceback() -> None:
    failures = parse_failures(EXCEPTION)
    assert [(f.rank, f.exitcode, f.pid, f.root_cause) for f in failures] == [
        (0, -15, 19207, False), (2, -15, 19209, False), (1, 1, 19208, True)]
    assert failed_ranks(EXCEPTION) == [1]


def test_the_tail_of_a_log_still_names_the_root_cause() -> None:
    # LaunchError's message keeps the last 2000 characters; cut into the Failures section, the
    # root cause survives and the partial blocks before any section line are ignored
    tail = SIGKILL[SIGKILL.index("  rank      : 0") :]
    assert [f.rank for f in parse_failures(tail)] == [1] and failed_ranks(tail) == [1]


def test_no_summary_means_no_failed_ranks(tmp_path: Path) -> None:
    text = "Traceback (most recent call last):\nRuntimeError: the agent itself died\n"
    assert parse_failures(text) == [] and failed_ranks(text) == [] and failed_ranks_and_hosts(text) == {}
    _write_record(tmp_path, 1, "node-b", 16176)
    assert hosts_of_failed_ranks(tmp_path, text) == []
    assert hosts_of_failed_ranks(tmp_path / "absent", SIGKILL) == []  # localhost names no machine


def test_registry_host_precedence(tmp_path: Path) -> None:
    # the record of the very process that failed (same pid) wins over the summary's host
    _write_record(tmp_path / "same_pid", 1, "node-b", 16176)
    named = SIGKILL.replace("host      : localhost", "host      : node-b.cluster.example")
    assert hosts_of_failed_ranks(tmp_path / "same_pid", named) == ["node-b"]
    # a record with another pid may be an earlier launch's: a usable summary host wins
    _write_record(tmp_path / "stale", 1, "node-c", 99999)
    assert hosts_of_failed_ranks(tmp_path / "stale", named) == ["node-b.cluster.example"]
    # the summary says only `localhost`: the registry's host is used, whatever its pid
    assert hosts_of_failed_ranks(tmp_path / "stale", SIGKILL) == ["node-c"]
    # and only the failed rank's record counts
    _write_record(tmp_path / "other_rank", 0, "node-a", 16174)
    assert hosts_of_failed_ranks(tmp_path / "other_rank", SIGKILL) == []


def test_registry_records_are_atomic_json_and_reset(tmp_path: Path) -> None:
    path = register_rank(tmp_path, rank=3, local_rank=1, host="node-d")
    assert path == tmp_path / "rank_00003.json"
    record = json.loads(path.read_text())
    assert {k: record[k] for k in ("rank", "local_rank", "host", "pid")} == {
        "rank": 3, "local_rank": 1, "host": "node-d", "pid": os.getpid()}
    register_rank(tmp_path, rank=4, local_rank=0)
    (tmp_path / "rank_00009.json").write_text("{not json")  # skipped with a warning, not fatal
    registry = read_registry(tmp_path)
    assert sorted(registry) == [3, 4] and registry[4]["host"] == socket.gethostname()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    reset_registry(tmp_path)
    assert read_registry(tmp_path) == {}


def _summary(monkeypatch, host: str, failures: dict[int, tuple[int, int, str]]) -> str:
    """A summary formatted by torch's own ChildFailedError, as printed by the agent on `host`;
    failures: rank -> (exitcode, pid, time)."""
    monkeypatch.setattr(socket, "getfqdn", lambda: host)
    formatted = {}
    for rank, (exitcode, pid, at) in failures.items():
        failure = ProcessFailure(local_rank=rank % 4, pid=pid, exitcode=exitcode, error_file="<none>")
        failure.timestamp = int(datetime.fromisoformat(at).timestamp())
        formatted[rank] = failure
    return str(ChildFailedError("train.py", formatted))


def test_multi_node_log_blames_the_earliest_root_cause(monkeypatch, tmp_path: Path) -> None:
    # node-a: rank 3 killed at :01, its agent then stops ranks 0-2; node-b: its ranks fail at :03
    # because their peer is gone (exit code 1), rank 5 first
    stopped = {rank: (-15, 100 + rank, "2026-01-01T12:00:02") for rank in range(3)}
    node_a = _summary(monkeypatch, "node-a", {**stopped, 3: (-9, 103, "2026-01-01T12:00:01")})
    node_b = _summary(monkeypatch, "node-b", {5: (1, 200, "2026-01-01T12:00:03"), 4: (1, 201, "2026-01-01T12:00:04")})
    log = f"{node_b}\nsome other output\n{node_a}\n"
    assert sorted((f.rank, f.root_cause) for f in parse_failures(log) if f.root_cause) == [(3, True), (5, True)]
    assert failed_ranks(log) == [3] and failed_ranks_and_hosts(log) == {3: "node-a"}
    assert hosts_of_failed_ranks(tmp_path, log) == ["node-a"]
    # root causes seen in the same second cannot be told apart: both hosts are named
    same_time = _summary(monkeypatch, "node-b", {5: (1, 200, "2026-01-01T12:00:01")})
    assert hosts_of_failed_ranks(tmp_path, same_time + node_a) == ["node-a", "node-b"]


WORKER = """
import os, signal, sys, time
from pathlib import Path
import torch.distributed as dist
from kiln.tasks.launch.rank_hosts import register_rank

dist.init_process_group("gloo")
register_rank(Path(sys.argv[1]), dist.get_rank(), int(os.environ["LOCAL_RANK"]))
dist.barrier()  # both are registered before rank 1 dies
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)  # rank 0 waits for its agent to stop it
"""


@pytest.mark.distributed
def test_real_torchrun_failure_names_this_host(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    registry = tmp_path / "ranks"
    repo = str(Path(__file__).resolve().parents[3])
    launcher = TorchrunLauncher(ClusterSpec(), tmp_path / "out", job_name="dies", nproc_per_node=2, timeout_s=60,
                                env={"OMP_NUM_THREADS": "1", "PYTHONPATH": repo}, workdir=tmp_path)
    with pytest.raises(LaunchError) as error:
        launcher.launch([str(script), str(registry)])
    assert error.value.log == tmp_path / "out" / "dies.log"
    output = error.value.log.read_text()
    assert failed_ranks(output) == [1]
    assert sorted(read_registry(registry)) == [0, 1]
    assert hosts_of_failed_ranks(registry, output) == [socket.gethostname()]
    (failure,) = [f for f in parse_failures(output) if f.root_cause]
    assert failure.exitcode == -9 and failure.pid == read_registry(registry)[1]["pid"]
