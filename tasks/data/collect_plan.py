"""How collect's reading is cut into tasks: the sources' files in order, grouped into tasks of about
`collect.task_bytes` of input, an uncompressed jsonl file larger than that cut into ranges of lines
(numbered by a job that counts each range's newlines first). A task's plan is plain values: every
rank receives the whole plan."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from fsspec.core import url_to_fs

from kiln.tasks.data.source_files import compression_of, list_files, resolved
from kiln.tasks.data.sources import Source, source_patterns
from kiln.tasks.errors import InputError


class TaskFile(NamedTuple):
    """A source file as a task names it (plain values: every rank gets the whole plan), or the part of
    an uncompressed jsonl file whose lines start in bytes [start, end) (`read_jsonl_range`)."""

    path: str  # on the source's filesystem
    rel: str  # relative to the source
    size: int
    start: int | None = None
    end: int | None = None
    newlines_before: int = 0  # in bytes [0, start): what numbers the range's lines


@dataclass(frozen=True)
class TaskPart:
    """Files of one source that a task reads in order (`files` None: a hub dataset, read whole)."""

    source: Source  # its path resolved (`resolved`)
    files: tuple[TaskFile, ...] | None
    whole: bool  # the source's every file: the task reports how many it has


def _source_units(source: Source, task_bytes: int, read_whole: bool) -> Iterator[tuple[TaskPart, int]]:
    """A source's parts that may go to different tasks, with their bytes: a file each, or the whole
    source as one where it must be read in one process: a hub dataset, a code tree (its LICENSE files
    speak for the files beside them), and every source when `read_whole` (a cap on documents per source:
    its first N documents in file order)."""
    source = source.model_copy(update={"path": resolved(source.path)})
    if source.format == "hf":
        yield TaskPart(source, None, True), 0
        return
    try:
        files = list_files(source.path, source_patterns(source), source.storage_options)
    except InputError as err:
        raise InputError(f"source {source.name!r}: {err}") from None
    if source.format == "code" or read_whole:
        yield TaskPart(source, tuple(TaskFile(f.path, f.rel, f.size) for f in files), True), sum(f.size for f in files)
        return
    for file in files:
        if source.format == "jsonl" and file.size > task_bytes and compression_of(file.rel, source.compression) is None:
            for start in range(0, file.size, task_bytes):  # a big file: a range of lines each
                end = min(start + task_bytes, file.size)
                yield TaskPart(source, (TaskFile(file.path, file.rel, file.size, start, end),), False), end - start
        else:
            yield TaskPart(source, (TaskFile(file.path, file.rel, file.size),), False), file.size


def plan_tasks(sources: list[Source], task_bytes: int, read_whole: bool = False,
               count: Callable[[list[LineRange]], list[int]] | None = None) -> list[list[TaskPart]]:
    """The sources' files in order, cut into tasks of about `task_bytes` of input each (a file, or a
    source read whole, is never cut; but for an uncompressed jsonl file larger than that, which is cut
    into ranges of lines): in task order, the tasks' records are the sources' in order. `count`: the
    newlines in each range (`CountNewlines` over them), which number each range's lines; default: counted here."""
    units = [unit for source in sources for unit in _source_units(source, task_bytes, read_whole)]
    ranges = [LineRange(part.source, file) for part, _ in units for file in part.files or () if file.start is not None]
    if ranges:
        counts = (count or (lambda ranges: [CountNewlines(ranges)(r)["newlines"] for r in range(len(ranges))]))(ranges)
        before: dict[str, int] = {}
        numbered = iter(counts)
        for i, (part, size) in enumerate(units):
            if part.files and part.files[0].start is not None:
                file = part.files[0]
                key = f"{part.source.name}\0{file.path}"
                units[i] = (TaskPart(part.source, (file._replace(newlines_before=before.get(key, 0)),), False), size)
                before[key] = before.get(key, 0) + next(numbered)
    tasks: list[list[TaskPart]] = []
    current: list[tuple[TaskPart, list[TaskFile]]] = []  # a task's parts; a split source's files gathered in a list
    size = 0

    def close() -> None:
        tasks.append([part if part.whole else TaskPart(part.source, tuple(files), False) for part, files in current])

    for part, num_bytes in units:
        last = current[-1][0] if current else None
        if last is not None and not last.whole and not part.whole and last.source.name == part.source.name:
            current[-1][1].extend(part.files or ())
        else:
            current.append((part, list(part.files or ())))
        size += num_bytes
        if size >= task_bytes:
            close()
            current, size = [], 0
    if current:
        close()
    return tasks


class LineRange(NamedTuple):
    source: Source
    file: TaskFile


@dataclass(frozen=True)
class CountNewlines:
    """Rank r: the newlines in range r's bytes."""

    ranges: list[LineRange]

    def __call__(self, rank: int) -> dict[str, Any]:
        source, file = self.ranges[rank]
        assert file.start is not None and file.end is not None
        fs = url_to_fs(source.path, **(source.storage_options or {}))[0]
        newlines, left = 0, file.end - file.start
        with fs.open(file.path, "rb") as handle:
            handle.seek(file.start)
            while left and (block := handle.read(min(left, 1 << 22))):
                newlines += block.count(b"\n")
                left -= len(block)
        return {"newlines": newlines}


def plan_identity(tasks: list[list[TaskPart]]) -> list[list[Any]]:
    """What each task reads, for its rank key: sources by name, files by path and size (their content
    is in the stage's key)."""
    return [[[part.source.name, None if part.files is None else [list(f[1:]) for f in part.files]]
             for part in task] for task in tasks]
