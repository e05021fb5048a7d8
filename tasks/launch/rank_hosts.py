"""Which hosts ran the ranks that failed a torchrun job, so that a relaunch can exclude them.

Two sources, both on the run's shared filesystem or in its launcher log:

- The rank registry: each worker calls `register_rank` at start and writes
  `rank_{rank:05d}.json` ({rank, local_rank, host, pid, started_unix}). `host` defaults to
  `socket.gethostname()`; pass the scheduler's own name for the node where it differs (`node_name`:
  Kubernetes' node name from the downward API, since a pod's hostname is the pod's name; Slurm's
  `SLURMD_NODENAME`, which is what `--exclude` takes).
- torchrun's failure summary (torch 2.13 elastic agent, `ChildFailedError.format_msg`): a
  "Failures:" section and a "Root Cause (first observed failure):" section of blocks like
  `[0]:` / `host      : ...` / `rank      : 1 (local_rank: 1)` / `exitcode  : -9 (pid: 4242)`.
  The agent prints only its own workers' failures, so a multi-node log holds one summary per
  node that saw failures, and `host` is that agent's `socket.getfqdn()` (often just `localhost`).

The ranks to blame are the root causes: the other entries of a summary are mostly the workers
that its agent stopped itself (SIGTERM) after the first failure. When several summaries (nodes)
report a root cause, only the earliest-observed ones count: a node whose workers died because a
peer died reports its failures later (a tie within the summary's one-second resolution keeps both).

Precedence for each such rank's host:
1. its registry record when the record's pid is the failed pid the summary names: written by
   that very worker, in the scheduler's naming;
2. otherwise the summary's host, unless it is missing or `localhost*` (it names no machine);
3. otherwise the rank's registry record even with another pid (say, the worker died before
   registering, so the record may be an earlier launch's: clear the registry with
   `reset_registry` before each launch to make that impossible).
A rank none of these name is left out; when nothing can be attributed the result is [] and the
caller falls back to its own host.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

logger = logging.getLogger(__name__)

REGISTRY_DIR = "rank_hosts"  # a run folder's registry, on the filesystem its nodes share
NODE_NAME_ENV = "KILN_NODE_NAME"  # the scheduler's name for this node, where the hostname is not it
SLURM_NODE_NAME_ENV = "SLURMD_NODENAME"  # set by slurmd in every task of a job step
RECORD_GLOB = "rank_*.json"
TIME_FORMAT = "%Y-%m-%d_%H:%M:%S"  # ProcessFailure.timestamp_isoformat: the agent's local time

_SECTIONS = {"Failures:": "other", "Root Cause (first observed failure):": "root"}
_BLOCK = re.compile(r"^\[(\d+)\]:\s*$")
_FIELD = re.compile(r"^  (time|host|rank|exitcode|error_file|traceback)\s*: ?(.*?)\s*$")
_RANK = re.compile(r"^(\d+) \(local_rank: (\d+)\)$")
_EXITCODE = re.compile(r"^(-?\d+) \(pid: (\d+)\)")


@dataclass(frozen=True)
class RankFailure:
    """One failure block of a torchrun summary."""

    rank: int
    local_rank: int
    host: str | None  # the agent's socket.getfqdn(), as printed
    exitcode: int | None  # negative: killed by that signal
    pid: int | None
    time: datetime | None  # when the agent saw it (its local clock, whole seconds)
    root_cause: bool  # the first failure its agent observed


def node_name() -> str | None:
    """The scheduler's name for the node this process runs on (Kiln's variable, then Slurm's); None
    outside a scheduler, where the hostname serves."""
    return os.environ.get(NODE_NAME_ENV) or os.environ.get(SLURM_NODE_NAME_ENV) or None


def register_rank(registry_dir: Path, rank: int, local_rank: int, host: str | None = None) -> Path:
    """Record that this process (pid) is `rank` on `host` (default: this machine's hostname)."""
    registry_dir.mkdir(parents=True, exist_ok=True)
    path = registry_dir / f"rank_{rank:05d}.json"
    record = {"rank": rank, "local_rank": local_rank, "host": host or socket.gethostname(), "pid": os.getpid(),
              "started_unix": time.time()}
    # atomic: a reader on another node never sees half a record
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def reset_registry(registry_dir: Path) -> None:
    """Remove every record, so that the next launch's records cannot be confused with this one's."""
    for path in registry_dir.glob(RECORD_GLOB):
        path.unlink()


def read_registry(registry_dir: Path) -> dict[int, dict]:
    """rank -> its record; an absent directory means no records.

    An unreadable record is skipped with a warning: it only helps name a host, and the relaunch
    it serves must not fail over it.
    """
    records = {}
    for path in sorted(registry_dir.glob(RECORD_GLOB)):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            records[int(record["rank"])] = {**record, "host": str(record["host"]), "pid": int(record["pid"])}
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("ignoring the unreadable rank record %s: %r", path, error)
    return records


def parse_failures(torchrun_output: str) -> list[RankFailure]:
    """Every failure block of every torchrun summary in the text, in order.

    Blocks before a summary's "Failures:" or "Root Cause" line are ignored (so a log cut short at
    the front still yields the root cause), as are blocks without a well-formed rank line.
    """
    failures = []
    section: str | None = None  # "other" or "root" inside a summary, None elsewhere
    block: dict[str, str] | None = None

    def close() -> None:
        if block is not None and _RANK.match(block.get("rank", "")):
            failures.append(_failure(block, root_cause=section == "root"))

    for line in torchrun_output.splitlines():
        line = line.rstrip()
        # section lines are flush left; traceback lines, which could look like them, are indented
        if line in _SECTIONS or _is_rule(line):
            close()
            block = None
            section = _SECTIONS.get(line)
        elif section is not None and _BLOCK.match(line):
            close()
            block = {}
        elif block is not None and "traceback" not in block and (field := _FIELD.match(line)):
            # fields come before the traceback; lines after it belong to the traceback
            block.setdefault(field.group(1), field.group(2))
    close()
    return failures


def failed_ranks(torchrun_output: str) -> list[int]:
    """The ranks that failed first (see the module docstring), ascending; [] when there is no summary."""
    return sorted({f.rank for f in _first_root_causes(parse_failures(torchrun_output))})


def failed_ranks_and_hosts(torchrun_output: str) -> dict[int, str]:
    """`failed_ranks` -> the host its summary names, as printed (may be `localhost`); ranks without one are left out."""
    return {f.rank: f.host for f in sorted(_first_root_causes(parse_failures(torchrun_output)), key=lambda f: f.rank)
            if f.host}


def hosts_of_failed_ranks(registry_dir: Path, torchrun_output: str) -> list[str]:
    """The hosts of `failed_ranks`, by the module docstring's precedence; sorted, no duplicates."""
    registry = read_registry(registry_dir)
    hosts = set()
    for failure in _first_root_causes(parse_failures(torchrun_output)):
        record = registry.get(failure.rank)
        if record is not None and failure.pid is not None and record["pid"] == failure.pid:
            hosts.add(record["host"])
        elif _names_a_machine(failure.host):
            hosts.add(failure.host)
        elif record is not None:
            hosts.add(record["host"])
    return sorted(hosts)


def first_failure_unix(torchrun_output: str) -> float | None:
    """When the first failure was observed (the summary's time, whole seconds of the agent's local
    clock, read as this machine's local time); None when no summary gives one."""
    timed = [f.time for f in _first_root_causes(parse_failures(torchrun_output)) if f.time is not None]
    return min(timed).timestamp() if timed else None


def _first_root_causes(failures: list[RankFailure]) -> list[RankFailure]:
    roots = [f for f in failures if f.root_cause]
    timed = [f.time for f in roots if f.time is not None]
    if not timed:
        return roots
    return [f for f in roots if f.time is None or f.time == min(timed)]


def _failure(block: dict[str, str], root_cause: bool) -> RankFailure:
    rank = _RANK.match(block["rank"])
    assert rank is not None, "only blocks with a rank line are parsed"
    exitcode = _EXITCODE.match(block.get("exitcode", ""))
    try:
        seen = datetime.strptime(block.get("time", ""), TIME_FORMAT)
    except ValueError:
        seen = None
    return RankFailure(
        rank=int(rank.group(1)),
        local_rank=int(rank.group(2)),
        host=block.get("host") or None,
        exitcode=int(exitcode.group(1)) if exitcode else None,
        pid=int(exitcode.group(2)) if exitcode else None,
        time=seen,
        root_cause=root_cause,
    )


def _is_rule(line: str) -> bool:
    """The summary's ===== border or ----- section line."""
    return len(line) >= 10 and set(line) in ({"="}, {"-"})


def _names_a_machine(host: str | None) -> bool:
    return bool(host) and host != "<N/A>" and not host.startswith("localhost")
