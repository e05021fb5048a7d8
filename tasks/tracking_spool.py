"""Tracking records MLflow could not take, kept beside the store until it can.

The store is the source of truth; MLflow shows it. So a stage must not fail, and no record may be
lost, because the tracking server was down or its SQLite database stayed locked longer than Kiln's
retries wait. `tasks.tracking.MlflowTracker` then appends the write, and every later write to the
same run, to that run's journal in `<store>/.tracking-spool/` (JSON lines; artifact files are copied
in, since a stage's partial folder moves when it commits), and replays the journals once MLflow
answers: its own as soon as it can, any other's when a later run opens the store's tracker.

A run whose creation was journaled has a local id (`spooled-...`) until its journal is replayed;
`ids.json` maps it to the MLflow run id (the run also carries the local id as tag `kiln.spooled_id`,
and a manifest written meanwhile keeps the local one). Each journal records its owner (host:pid): a
journal is replayed by its owner, or by anyone once the run has ended or its owner is dead, so that
writes to one run are never reordered. A journal that MLflow refuses (not merely cannot take now) is
moved to `refused/`, never dropped.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.tasks.crashes import owner_alive, process_owner
from kiln.tasks.keylock import KeyLock, LockTimeout

SPOOL_DIR = ".tracking-spool"  # under the store root
LOCAL_PREFIX = "spooled-"
ENDS_RUN = "set_terminated"


def spool_dir(store_root: str | Path) -> Path:
    return Path(store_root) / SPOOL_DIR


def local_run_id() -> str:
    return f"{LOCAL_PREFIX}{uuid.uuid4().hex}"


class Refused(Exception):
    """MLflow refused a write for good (not that it could not take it now): its journal is set aside."""


@dataclass
class Replayed:
    """What one replay did: runs created, writes made, journals finished, and those left for later."""

    runs: int = 0
    writes: int = 0
    journals: int = 0
    left: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


class Spool:
    """The journals of one store's spool, for one tracking URI and experiment."""

    def __init__(self, folder: Path, uri: str, experiment: str):
        self.folder, self.uri, self.experiment = folder, uri, experiment
        self._mine: dict[str, Path] = {}  # run id → this process's journal for it

    # --- writing -------------------------------------------------------------------------------------
    def append(self, run_id: str, op: str, payload: dict[str, Any]) -> Path:
        """Journal one write to `run_id` (after any earlier one of this process); returns the journal."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if op == "log_artifact":
            payload = {**payload, "path": self._keep_copy(Path(payload["path"]))}
        line = json.dumps({"op": op, "payload": payload, "at": time.time()}, default=str) + "\n"
        path = self._mine.get(run_id)
        while True:
            if path is None:
                path = self.folder / f"{time.time_ns()}-{run_id}.jsonl"
                header = {"owner": process_owner(), "uri": self.uri, "experiment": self.experiment, "run": run_id}
                path.write_text(json.dumps(header) + "\n")
            with _locked(path) as handle:
                if handle is not None:  # None: replayed and removed meanwhile; start a new journal
                    handle.seek(0, os.SEEK_END)
                    handle.write(line)
                    self._mine[run_id] = path
                    return path
            path = None

    def journaled(self, run_id: str) -> bool:
        """Whether this process has a journal for `run_id` not yet replayed (its writes must follow it)."""
        path = self._mine.get(run_id)
        if path is not None and not path.exists():
            del self._mine[run_id]
        return run_id in self._mine

    def has_mine(self) -> bool:
        """Whether this process has journals not yet replayed."""
        return any(self.journaled(run_id) for run_id in list(self._mine))

    def _keep_copy(self, path: Path) -> str:
        target = self.folder / "files" / uuid.uuid4().hex / path.name
        target.parent.mkdir(parents=True)
        if path.is_dir():
            shutil.copytree(path, target)
        elif path.is_file():
            shutil.copy2(path, target)
        return str(target)

    # --- ids -----------------------------------------------------------------------------------------
    def resolve(self, run_id: str | None) -> str | None:
        """The MLflow run id of `run_id` (a local id once its journal created the run; else itself)."""
        if run_id is None or not run_id.startswith(LOCAL_PREFIX):
            return run_id
        return self._ids().get(run_id, run_id)

    def _ids(self) -> dict[str, str]:
        path = self.folder / "ids.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def _remember(self, local: str, real: str) -> None:
        path = self.folder / "ids.json"
        with KeyLock(self.folder / "ids.lock"):
            ids = {**self._ids(), local: real}
            temporary = path.with_suffix(".tmp")
            temporary.write_text(json.dumps(ids, indent=1))
            os.replace(temporary, path)

    # --- replaying -----------------------------------------------------------------------------------
    def pending(self) -> list[Path]:
        """Journals waiting, oldest first (a parent's creation before its children's)."""
        return sorted(self.folder.glob("*.jsonl"), key=lambda p: int(p.name.split("-", 1)[0]))

    def replay(self, apply: Callable[[str, str | None, dict[str, Any]], str | None], *, mine_only: bool = False
               ) -> Replayed:
        """Replay every journal this process may (see the module doc) through `apply(op, run_id, payload)`,
        which returns the new run's id for `create_run` and raises `Refused` for a write MLflow will never
        take; stops at the first write MLflow cannot take now (that exception propagates), keeping the rest."""
        done = Replayed()
        for path in self.pending():
            if mine_only and path not in self._mine.values():
                continue
            with _locked(path, wait=False) as handle:
                if handle is None:
                    continue  # being written or replayed by another process
                header, *ops = [json.loads(line) for line in handle.read().splitlines() if line.strip()]
                if not self._may_replay(path, header, ops):
                    done.left.append(path.name)
                    continue
                try:
                    self._replay_one(header, ops, apply, done)
                except Refused as error:
                    refused = self.folder / "refused" / path.name
                    refused.parent.mkdir(exist_ok=True)
                    with open(refused, "w") as out:
                        out.write(json.dumps({**header, "refused": str(error)[:2000]}) + "\n")
                        out.writelines(json.dumps(op) + "\n" for op in ops)
                    path.unlink()
                    done.refused.append(path.name)
                    continue
                except BaseException:
                    handle.seek(0)
                    handle.truncate()
                    handle.write(json.dumps(header) + "\n")
                    handle.writelines(json.dumps(op) + "\n" for op in ops)  # the unwritten ones, in order
                    raise
                path.unlink()
                done.journals += 1
        return done

    def _may_replay(self, path: Path, header: dict[str, Any], ops: list[dict[str, Any]]) -> bool:
        if (header["uri"], header["experiment"]) != (self.uri, self.experiment):
            return False  # another MLflow's records: replayed by a run tracking there
        if path in self._mine.values() or header["owner"] == process_owner():
            return True
        ended = bool(ops) and ops[-1]["op"] == ENDS_RUN
        return ended or owner_alive(header["owner"]) is False

    def _replay_one(self, header: dict[str, Any], ops: list[dict[str, Any]],
                    apply: Callable[[str, str | None, dict[str, Any]], str | None], done: Replayed) -> None:
        """Apply `ops` in order, removing each from the list once MLflow has it."""
        local = header["run"]
        while ops:
            op = ops[0]
            if op["op"] == "create_run":
                if self.resolve(local) == local:  # not created by an interrupted earlier replay
                    payload = op["payload"]
                    tags = {**payload["tags"], "kiln.spooled_id": local}
                    if "mlflow.parentRunId" in tags:
                        tags["mlflow.parentRunId"] = self.resolve(tags["mlflow.parentRunId"])
                    self._remember(local, apply("create_run", None, {**payload, "tags": tags}))
                    done.runs += 1
            else:
                apply(op["op"], self.resolve(local), op["payload"])
            done.writes += 1
            ops.pop(0)
            if op["op"] == "log_artifact":
                shutil.rmtree(Path(op["payload"]["path"]).parent, ignore_errors=True)


@contextmanager
def _locked(path: Path, *, wait: bool = True) -> Iterator[Any]:
    """`path` open for update while this process holds its `KeyLock` (the run ledger's one lock, which
    holds across the hosts sharing the store, unlike `flock` on some shared filesystems); None when the
    file is gone (replayed and removed before we held it) or, with `wait=False`, when another holds it."""
    lock = KeyLock(path.with_name(path.name + ".lock"), timeout_s=None if wait else 0)
    try:
        lock.acquire()
    except LockTimeout:
        yield None
        return
    try:
        try:
            handle = open(path, "r+")
        except FileNotFoundError:
            yield None
            return
        with handle:
            handle.seek(0)
            yield handle
    finally:
        lock.release()
