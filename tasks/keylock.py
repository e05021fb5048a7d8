"""A lock per store key that holds across processes and across machines sharing a filesystem.

The lock is a file created with `O_CREAT | O_EXCL` (atomic on local filesystems and NFSv3+),
holding its owner's host, pid and a random token. While held, a thread refreshes the file's
mtime every `heartbeat_s`. A lock is stale when its owner is a dead process on this host, or
when its heartbeat is older than `stale_after_s` (an owner on another machine that died or lost
the filesystem). Breaking a stale lock takes a second, short-lived `.break` file, so that two
waiters cannot both break it and one of them delete the other's fresh lock.

`fcntl.flock` would be simpler, but it does not reach across machines on every shared
filesystem (Lustre and some NFS setups ignore it), and a stale `flock` cannot be seen.

An owner that runs inside a Slurm job records the job and its node (`slurm_job_id`, `node`), and
the jobs it submits while it holds the lock (`add_jobs`), so that a waiter or `kiln status` says
which job holds the key and whether the scheduler still runs it; given `job_alive` (the scheduler's
word, from a layer that may ask it), an owner whose Slurm job has ended is stale at once.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
STALE_AFTER_S = 60.0
POLL_S = 0.2
JOB_CHECK_S = 5.0  # how often a waiter asks the scheduler whether the owner's Slurm job still runs


class LockTimeout(TimeoutError):
    """The lock stayed held by a live owner for longer than the caller would wait."""


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class KeyLock:
    """`with KeyLock(path): ...` holds `path` exclusively; waits (polling) while another owner holds it."""

    def __init__(self, path: Path, *, timeout_s: float | None = None, heartbeat_s: float = HEARTBEAT_S,
                 stale_after_s: float = STALE_AFTER_S, on_wait=None,
                 job_alive: Callable[[str], bool | None] | None = None) -> None:
        self.path = Path(path)
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.on_wait = on_wait  # called once with the owner's record when this caller has to wait
        self.job_alive = job_alive  # whether a Slurm job still runs (None: the scheduler cannot say)
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._writing = threading.Lock()
        self._job_checked: dict[str, tuple[float, bool]] = {}  # job id -> (when asked, whether it had ended)
        self.broken: dict | None = None  # the stale owner's record this lock broke to be taken (its jobs may run on)

    def _record(self) -> dict:
        record = {"host": socket.gethostname(), "pid": os.getpid(), "token": self.token, "since": time.time()}
        if os.environ.get("SLURM_JOB_ID"):  # this process is (part of) a Slurm job: the job holds the key
            record |= {"slurm_job_id": os.environ["SLURM_JOB_ID"],
                       "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname()}
        return record

    def add_jobs(self, job_ids: list[str]) -> None:
        """Record jobs this owner submitted (Slurm job ids) in the lock, while it holds it."""
        with self._writing:
            owner = self.owner()
            if not owner or owner.get("token") != self.token:
                return
            owner["jobs"] = [*owner.get("jobs", []), *(str(j) for j in job_ids)]
            temporary = self.path.with_name(f"{self.path.name}.{self.token}")
            temporary.write_text(json.dumps(owner))
            os.replace(temporary, self.path)  # one rename: a reader sees the old record or the new, whole

    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as handle:
            json.dump(self._record(), handle)
            handle.flush()
            os.fsync(handle.fileno())
        return True

    def owner(self) -> dict | None:
        """The current owner's record (None if free); a half-written record reads as {}."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return {}

    def held(self) -> bool:
        """Whether a live owner holds the lock now (a stale lock does not count)."""
        owner = self.owner()
        return owner is not None and not self._is_stale(owner)

    def _is_stale(self, owner: dict) -> bool:
        if owner.get("slurm_job_id") and self._job_ended(owner["slurm_job_id"]):
            return True  # the Slurm job that held it has ended, on whichever node it ran
        if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
            if not pid_alive(owner["pid"]):
                return True
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return False
        return age > self.stale_after_s

    def _job_ended(self, job_id: str) -> bool:
        """Whether the scheduler says Slurm job `job_id` has ended (asked at most every JOB_CHECK_S)."""
        if self.job_alive is None:
            return False
        checked = self._job_checked.get(job_id)
        if checked is None or time.monotonic() - checked[0] > JOB_CHECK_S:
            checked = self._job_checked[job_id] = (time.monotonic(), self.job_alive(job_id) is False)
        return checked[1]

    def _break_stale(self, owner: dict) -> None:
        breaker = self.path.with_name(self.path.name + ".break")
        try:
            fd = os.open(breaker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            # another waiter is breaking it; a breaker that died leaves a file nobody refreshes
            if time.time() - breaker.stat().st_mtime > self.stale_after_s:
                breaker.unlink(missing_ok=True)
            return
        os.close(fd)
        try:
            if self.owner() == owner:  # still the same stale owner, not a fresh lock taken meanwhile
                log.warning("breaking stale lock %s held by %s", self.path, owner)
                self.path.unlink(missing_ok=True)
                self.broken = owner
        finally:
            breaker.unlink(missing_ok=True)

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        told = False
        while not self._try_create():
            owner = self.owner()
            if owner is not None and self._is_stale(owner):
                self._break_stale(owner)
                continue
            if not told and self.on_wait is not None and owner:
                self.on_wait(owner)
                told = True
            if deadline is not None and time.monotonic() > deadline:
                raise LockTimeout(f"{self.path} is held by {owner} for longer than {self.timeout_s}s")
            time.sleep(POLL_S)
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name=f"keylock-{self.path.name}", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                log.error("lock %s vanished while held (broken by another process?)", self.path)
                return

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if (self.owner() or {}).get("token") == self.token:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> KeyLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
