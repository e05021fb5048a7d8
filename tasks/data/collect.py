"""The collect stage: read the configured sources (local or fsspec URLs) into Kiln documents.

A source is a typed config entry: its `format` (jsonl — also .gz and .zst —, txt, html, parquet,
warc, code, hf) decides which other fields it takes; every source has a `domain`, a `licence`
(optional where records or files carry their own) and an optional `weight`. Every input record
ends up in exactly one place: `documents/` (kept), `removed/` (licence not allowed or unknown;
sampled out by the source's weight; a vendored, generated or binary file of a code tree) or
`quarantine/` (unreadable or unusable input, with the file and line, row or WARC offset at fault),
each cut into shards of `shard_bytes` (`tasks.data.shards`); no input, however broken, raises
(`tasks.data.readers`, `tasks.data.code_tree`). Licences are normalised to SPDX expressions and
judged by `tasks.data.licences`; a compliance report per source records which licences were seen,
as written and normalised, and whether each is allowed.

The sources are read by tasks on `cluster.executor` (`collect_documents`): the files in order, cut
into tasks of about `task_bytes`; what the driver holds is the list of files and the tasks' counts,
never the records nor every id. The output is byte for byte that of one process reading every
source in order: ids two tasks kept are found after (`tasks.data.collect_ids`), and the kept
documents are cut into shards where that one process would cut them.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from fsspec.core import url_to_fs
from pydantic import Field

from kiln.tasks.accounting import DocCounts
from kiln.tasks.configbase import Section, runtime_field
from kiln.tasks.data.code_tree import read_code_tree
from kiln.tasks.data.collect_ids import find_earlier_kept, read_ids, write_checked
from kiln.tasks.data.collect_plan import CountNewlines, LineRange, TaskPart, plan_identity, plan_tasks
from kiln.tasks.data.compliance import SourceReport, compliance_markdown, compliance_report
from kiln.tasks.data.documents import Document, ShardWriter
from kiln.tasks.data.executors import LOCAL, RANKS_DIR, ExecutorSettings, ShardRun, map_shards, rank_ledger
from kiln.tasks.data.inspection import RemovalTally, text_bytes, write_removal_report
from kiln.tasks.data.licences import LicencePolicy, LicenceVerdict, normalise
from kiln.tasks.data.readers import READERS, Candidate, read_dataset, read_jsonl_range
from kiln.tasks.data.shards import DOCUMENTS, QUARANTINE, REMOVED, RotatingShards, shard_name, write_listing
from kiln.tasks.data.source_files import SourceFile, is_remote, list_files, local_path, resolved
from kiln.tasks.data.sources import NEEDS_SOURCE_LICENCE, Source, remote_identity, source_patterns
from kiln.tasks.errors import ConfigError, InputError
from kiln.tasks.store import file_sha256

# SPDX ids ("public-domain" reads as LicenseRef-public-domain) of licences that allow training and redistribution of derived text.
OPEN_LICENCES = [
    "MIT", "MIT-0", "Apache-2.0", "BSD-2-Clause", "BSD-3-Clause", "ISC", "Zlib", "Unlicense",
    "PSF-2.0", "MPL-2.0", "EPL-2.0",
    "GPL-2.0-only", "GPL-2.0-or-later", "GPL-3.0-only", "GPL-3.0-or-later",
    "LGPL-2.1-only", "LGPL-2.1-or-later", "LGPL-3.0-only", "LGPL-3.0-or-later",
    "AGPL-3.0-only", "AGPL-3.0-or-later",
    "CC-BY-3.0", "CC-BY-4.0", "CC-BY-SA-3.0", "CC-BY-SA-4.0", "CC0-1.0",
    "ODC-By-1.0", "ODbL-1.0", "PDDL-1.0", "public-domain",
]  # fmt: skip


class CollectConfig(Section):
    sources: list[Source] = []
    allowed_licences: list[str] = OPEN_LICENCES
    # Keep only the first N documents of each source (files in sorted order): for tiny runs.
    max_docs_per_source: int | None = Field(None, ge=1)
    min_chars: int = Field(1, ge=0)
    # The largest input record, in bytes: a jsonl line, or a whole txt/html file. Larger ones are
    # quarantined as `too_large` without being read into memory (a corrupt file with no newline,
    # a dump of a binary); 10 MB is far above any real document, far below the memory of a worker.
    max_doc_bytes: int = Field(10_000_000, ge=1)
    # The size of a shard of the output (uncompressed JSON lines; zstd stores about a quarter): each
    # later data stage processes one shard per rank, so shards are the unit of parallel work.
    shard_bytes: int = Field(100_000_000, ge=1)
    # The input a task reads: files in order, grouped up to this many bytes, and an uncompressed jsonl file
    # larger than it cut into ranges of lines of this size. Runtime only: the output is the same.
    task_bytes: int = runtime_field(64_000_000, ge=1)
    # Tasks read at once on cluster.executor; the output is the same.
    num_workers: int = runtime_field(1, ge=1)

    def domains(self) -> list[str]:
        """Every domain the sources' documents may have, in the order the sources name them."""
        return list(dict.fromkeys(domain for source in self.sources for domain in source.all_domains()))

    def identity(self) -> dict[str, Any]:
        """Remote sources' content enters the key as their listing (names, sizes, ETags, version ids): a
        local source's files are fingerprinted by the stage (`source_paths`), a bucket's cannot be read
        for that without downloading it."""
        remote = remote_identity(self.sources)
        return super().identity() | ({"remote_sources_sha256": remote} if remote else {})


def source_paths(cfg: CollectConfig) -> list[Path]:
    """The local input paths, for the stage key (their content is fingerprinted, not just their
    names); a glob stands for its folder. Remote sources enter the key through `CollectConfig.identity`."""
    paths = [local_path(source.path) for source in cfg.sources]
    return [path for path in paths if path is not None]


def _is_hub_id(source: Source) -> bool:
    """A dataset named by its hub id (`org/name`), not a local folder: nothing to check offline."""
    plain = source.path.removeprefix("file://")
    return (source.format == "hf" and not Path(plain).exists() and not source.path.startswith(("/", ".", "file://"))
            and not is_remote(source.path))


def _check_config(cfg: CollectConfig) -> LicencePolicy:
    """Fail before writing anything if a source cannot be read as configured; the licence policy."""
    try:
        policy = LicencePolicy(cfg.allowed_licences)
    except ValueError as err:
        raise ConfigError(f"collect.allowed_licences: {err}") from None
    seen: dict[str, int] = {}
    for i, source in enumerate(cfg.sources):
        if source.name in seen:
            raise ConfigError(
                f"collect.sources[{i}].name: source name {source.name!r} is already used by "
                f"collect.sources[{seen[source.name]}]; give every source a unique name"
            )
        seen[source.name] = i
        if source.licence is None and source.format in NEEDS_SOURCE_LICENCE:
            raise ConfigError(
                f"collect.sources[{i}].licence: source {source.name!r} is {source.format}, whose "
                "files carry no licence; set the licence of the source (an SPDX id)"
            )
        if source.licence is not None and normalise(source.licence) is None:
            raise ConfigError(
                f"collect.sources[{i}].licence: {source.licence!r} is no SPDX licence expression; use SPDX "
                "ids (https://spdx.org/licenses/, or LicenseRef-...) joined by AND, OR, WITH"
            )
        local = local_path(source.path)
        if local is not None and not local.exists() and not _is_hub_id(source):
            raise InputError(
                f"source {source.name!r}: path {source.path!r} does not exist (relative to "
                f"{Path.cwd()}); fix collect.sources[{i}].path"
            )
    return policy


def read_candidates(source: Source, max_bytes: int, report: SourceReport) -> Iterator[Candidate]:
    """Every candidate of one source, files in sorted order (Kiln's own where this folder lacks them: `resolved`)."""
    source = source.model_copy(update={"path": resolved(source.path)})
    if source.format == "hf":
        report.num_files = 1
        yield from read_dataset(source, max_bytes)
        return
    try:
        files = list_files(source.path, source_patterns(source), source.storage_options)
    except InputError as err:
        raise InputError(f"source {source.name!r}: {err}") from None
    report.num_files = len(files)
    if source.format == "code":
        yield from read_code_tree(files, source, max_bytes)
        return
    reader = READERS[source.format]
    for file in files:
        yield from reader(file, source, max_bytes)


def _sampled(doc_id: str, weight: float) -> bool:
    """Whether a source of `weight` keeps the document `doc_id`: a hash, so every run keeps the same ones."""
    return weight >= 1.0 or int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big") < weight * 2**64


WORK_DIR = "_collect"  # the jobs' logs, records, kept lines and checked ids, while the stage runs
KEPT, IDS, _LENGTHS = "kept", "ids", ".lengths.npy"  # in a run's folder: each task's kept lines, its checked ids
_BLOCK_BYTES = 1 << 20  # what `_Pack` copies at once
_MAX_REASON_LICENCE_CHARS = 100  # a licence as written, in a reason (a stats key); in full in the removed records


def _report_of(report: SourceReport) -> dict[str, Any]:
    """A task's share of a source's report, JSON-able (its rank's summary)."""
    return {"num_files": report.num_files, "num_kept": report.num_kept, "num_chars": report.num_chars,
            "removed": dict(report.removed), "quarantined": dict(report.quarantined),
            "licences": dict(report.licences), "statuses": report.statuses,
            "unknown_keys": {k: list(v) for k, v in report.unknown_keys.items()},
            "spellings": {k: dict(v) for k, v in report.spellings.items()}, "capped": report.capped}


def _add_report(report: SourceReport, part: dict[str, Any]) -> None:
    report.num_files += part["num_files"]
    report.num_kept += part["num_kept"]
    report.num_chars += part["num_chars"]
    report.removed.update(part["removed"])
    report.quarantined.update(part["quarantined"])
    report.licences.update(part["licences"])
    report.statuses.update(part["statuses"])
    report.unknown_keys.update({k: tuple(v) for k, v in part["unknown_keys"].items()})
    for label, spellings in part["spellings"].items():
        report.spellings[label].update(spellings)
    report.capped = report.capped or part["capped"]


@dataclass(frozen=True)
class _ReadTask:
    """Rank r of a collect job: read task `ranks[r]`'s files (`tasks`), judge every record, and write the
    task's removed and quarantined shards (`RRRRR.NNNNN.jsonl.zst` in `out_dir`), its kept documents'
    lines (`run_dir/kept/RRRRR.jsonl`, cut into the stage's shards by `_Pack`) and the ids it checked
    (`run_dir/ids/RRRRR.*`, `tasks.data.collect_ids`), with the ids in `prior[r]` (those earlier tasks
    kept) as already seen. Returns the task's counts, tally, reports by source and shard listing."""

    cfg: CollectConfig
    tasks: list[list[TaskPart]]
    out_dir: Path
    run_dir: Path
    ranks: tuple[int, ...] | None = None  # None: rank r is task r
    prior: tuple[Path | None, ...] | None = None

    def __call__(self, rank: int) -> dict[str, Any]:
        task = rank if self.ranks is None else self.ranks[rank]
        seen = read_ids(None if self.prior is None else self.prior[rank])
        for kind in (REMOVED, QUARANTINE):  # an earlier attempt's shards (a crash, or a run before the ids were known)
            for path in (self.out_dir / kind).glob(f"{task:05d}.*"):
                path.unlink()
        return _read_task(self.cfg, self.tasks[task], task, self.out_dir, self.run_dir, seen)


def _read_task(cfg: CollectConfig, parts: list[TaskPart], task: int, out_dir: Path, run_dir: Path,
               seen_ids: set[str]) -> dict[str, Any]:
    policy = LicencePolicy(cfg.allowed_licences)
    counts = DocCounts()
    reports: dict[str, SourceReport] = {}
    by_domain: Counter[str] = Counter()
    by_format: Counter[str] = Counter()
    num_repaired = 0
    checked: list[str] = []  # every id that reached the id check, in order, and whether it was kept
    kept_flags: list[bool] = []
    kept_bytes: list[int] = []  # each kept line's, for cutting the stage's shards (`_cut`)
    tally = RemovalTally()  # documents and bytes by domain and reason, counted while writing
    with (
        _opened(run_dir / KEPT / f"{task:05d}.jsonl") as kept,  # a plain file: `_Pack` compresses its lines
        RotatingShards(out_dir, REMOVED, cfg.shard_bytes, task) as removed,
        RotatingShards(out_dir, QUARANTINE, cfg.shard_bytes, task) as quarantine,
    ):
        for part in parts:
            source = part.source
            report = reports.setdefault(source.name, SourceReport(source.name, source.path, source.format,
                                                                  source.domain, source.licence))
            candidates = _part_candidates(part, cfg.max_doc_bytes, report)
            for candidate in candidates:
                if cfg.max_docs_per_source is not None and report.num_kept >= cfg.max_docs_per_source:
                    report.capped = True
                    break
                counts.num_in += 1
                num_repaired += candidate.num_repaired > 0
                reason, doc, verdict = _judge(candidate, source, cfg.min_chars, policy, seen_ids, checked)
                if len(checked) > len(kept_flags):
                    kept_flags.append(reason is None)
                log_record = {"source": source.name, **candidate.location}
                if verdict is not None:
                    report.saw(verdict)
                if reason is None:
                    assert doc is not None
                    seen_ids.add(doc.id)
                    line = doc.to_json_line()
                    kept.write(line)
                    kept_bytes.append(len(line))
                    tally.add("kept", doc.domain, text_bytes(doc.text))  # the record's own domain (domain_field)
                    counts.num_kept += 1
                    report.num_kept += 1
                    report.num_chars += len(doc.text)
                    by_domain[doc.domain] += 1
                    by_format[source.format] += 1
                elif doc is not None:  # readable, but its licence is not allowed (or not known), or sampled out
                    removed.add(reason, {**log_record, "document": json.loads(doc.to_json())})
                    tally.add("removed", doc.domain, text_bytes(doc.text), reason)
                    counts.removed[reason] += 1
                    report.removed[reason] += 1
                else:
                    extra = {key: value for key, value in (("detail", candidate.detail), ("raw", candidate.raw),
                                                           ("raw_prefix", candidate.raw_prefix)) if value}
                    raw_bytes = text_bytes(extra.get("raw") or extra.get("raw_prefix") or "")
                    if candidate.skip is not None:  # a file of a code tree that is no document
                        removed.add(reason, {**log_record, **extra})
                        tally.add("removed", source.domain, raw_bytes, reason)
                        counts.removed[reason] += 1
                        report.removed[reason] += 1
                        continue
                    quarantine.add(reason, {**log_record, **extra})
                    tally.add("quarantined", source.domain, raw_bytes, reason)
                    counts.quarantined[reason] += 1
                    report.quarantined[reason] += 1
            candidates.close()  # a capped source: close its open file now
        shards = {REMOVED: removed.close(), QUARANTINE: quarantine.close()}
    np.save(run_dir / KEPT / f"{task:05d}{_LENGTHS}", np.asarray(kept_bytes, dtype=np.int64))
    write_checked(run_dir / IDS / f"{task:05d}", checked, kept_flags)
    return {"counts": counts.as_dict(), "tally": tally.table(), "shards": shards, "num_repaired": num_repaired,
            "by_domain": dict(by_domain), "by_format": dict(by_format),
            "reports": {name: _report_of(report) for name, report in reports.items()}}


def _part_candidates(part: TaskPart, max_bytes: int, report: SourceReport) -> Iterator[Candidate]:
    """Every candidate of a part's files, in order."""
    source = part.source
    if part.files is None:
        report.num_files += 1
        yield from read_dataset(source, max_bytes)
        return
    report.num_files += sum(file.start in (None, 0) for file in part.files)  # a file cut in ranges: once
    fs = url_to_fs(source.path, **(source.storage_options or {}))[0]
    files = [SourceFile(fs, file.path, file.rel, file.size) for file in part.files]
    if source.format == "code":
        yield from read_code_tree(files, source, max_bytes)
        return
    reader = READERS[source.format]
    for file, named in zip(files, part.files):
        if named.start is None:
            yield from reader(file, source, max_bytes)
        else:
            assert named.end is not None
            yield from read_jsonl_range(file, source, max_bytes, named.start, named.end, named.newlines_before)


def collect_documents(cfg: CollectConfig, out_dir: Path, executor: ExecutorSettings = LOCAL) -> dict:
    """Read every source into shards in `out_dir` (`tasks.data.shards`) and write the compliance report.

    The sources' files are cut into tasks of about `task_bytes` (`plan_tasks`) that run on `executor`, `cfg.num_workers` at a
    time; each writes its own removed and quarantined shards and its kept lines, and returns its counts,
    which this process adds up: no record passes through it. An id kept by an earlier task is found after
    (`tasks.data.collect_ids`), and the later tasks that used it run again with it already seen. Then a
    second job cuts the kept lines into shards of `shard_bytes` exactly where one process reading every
    source in order cuts them (`_cut`, `_Pack`): the documents, their shards and every count are byte for
    byte what one process writes, whatever the tasks and workers."""
    policy = _check_config(cfg)
    out_dir = out_dir.resolve()  # Slurm and Ray workers do not share this process's working directory
    work = out_dir / WORK_DIR

    def count(ranges: list[LineRange]) -> list[int]:  # a job of its own: the big files' bytes are read once more
        lines = work / "lines"
        ledger = rank_ledger(lines / RANKS_DIR, "kiln_collect_lines", [[r.source.name, *r.file[1:5]] for r in ranges],
                             [{}] * len(ranges))
        counted = map_shards(CountNewlines(ranges), lines, ledger, settings=executor, jobs=cfg.num_workers,
                             job_name="kiln_collect_lines")
        return [result["newlines"] for result in counted.results]

    tasks = plan_tasks(cfg.sources, cfg.task_bytes, cfg.max_docs_per_source is not None, count)
    identity = {"config": cfg.identity(), "tasks": plan_identity(tasks)}
    read = work / "read"
    ledger = rank_ledger(read / RANKS_DIR, "kiln_collect", identity, [{}] * len(tasks))
    run = map_shards(_ReadTask(cfg, tasks, out_dir, read), read, ledger, settings=executor, jobs=cfg.num_workers,
                     job_name="kiln_collect", outputs=[out_dir / REMOVED, out_dir / QUARANTINE, read / IDS, read / KEPT])
    results, outside_cpu_s = list(run.results), run.outside_cpu_s
    runs = [read] * len(tasks)  # the folder of each task's last run
    versions = list(ledger.keys)  # the key of each task's last run
    priors: list[str | None] = [None] * len(tasks)  # the sha256 of the ids each task's last run had as seen
    for attempt in range(len(tasks) + 1):  # settles in one round unless a capped source lost documents to it
        found = find_earlier_kept([runs[t] / IDS / f"{t:05d}" for t in range(len(tasks))],
                                  work / f"duplicates-{attempt}")
        changed = [t for t in range(len(tasks)) if priors[t] != (file_sha256(found[t]) if t in found else None)]
        if not changed:
            break
        again = work / f"again-{attempt}"
        ledger = rank_ledger(again / RANKS_DIR, "kiln_collect_again", identity,
                             [{"seen": found[t]} if t in found else {} for t in changed])
        rerun = map_shards(_ReadTask(cfg, tasks, out_dir, again, tuple(changed), tuple(found.get(t) for t in changed)),
                           again, ledger, settings=executor, jobs=cfg.num_workers, job_name="kiln_collect_again")
        outside_cpu_s += rerun.outside_cpu_s
        for i, t in enumerate(changed):
            results[t], runs[t], versions[t] = rerun.results[i], again, ledger.keys[i]
            priors[t] = file_sha256(found[t]) if t in found else None
    else:
        raise AssertionError("collect's duplicate ids did not settle")
    kept_files = [runs[t] / KEPT / f"{t:05d}" for t in range(len(tasks))]
    shards = _cut(kept_files, cfg.shard_bytes)
    # a pack rank writes a run of shards: about a task's worth of documents, and few ranks for small shards
    per_rank = max(1, math.ceil(len(shards) / max(1, min(len(shards), max(len(tasks), cfg.num_workers)))))
    packer = _Pack(shards, kept_files, out_dir, per_rank)
    pack = work / "pack"
    packed = map_shards(packer, pack, rank_ledger(pack / RANKS_DIR, "kiln_collect_pack",
                                                  {"shards": shards, "per_rank": per_rank, "tasks": versions},
                                                  [{}] * math.ceil(len(shards) / per_rank)),
                        settings=executor, jobs=cfg.num_workers, job_name="kiln_collect_pack")
    outside_cpu_s += packed.outside_cpu_s
    stats = _merge(cfg, policy, ShardRun(results, outside_cpu_s), [e for r in packed.results for e in r["shards"]],
                   out_dir)
    shutil.rmtree(work)
    return stats


def _cut(kept_files: list[Path], shard_bytes: int) -> list[list[tuple[int, int, int]]]:
    """The stage's shards of kept documents as one process writing the tasks' kept lines in order cuts
    them (`RotatingShards`: a new shard once the current one holds `shard_bytes`): each a list of
    pieces (task, first line, end line). Reads one task's line lengths at a time."""
    shards: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    size = 0
    for task, stem in enumerate(kept_files):
        ends = np.concatenate([[0], np.cumsum(np.load(stem.with_name(stem.name + _LENGTHS)))])
        start, count = 0, len(ends) - 1
        while start < count:
            if size >= shard_bytes:
                shards.append(current)
                current, size = [], 0
            stop = min(int(np.searchsorted(ends, ends[start] + (shard_bytes - size), side="left")), count)
            current.append((task, start, stop))
            size += int(ends[stop] - ends[start])
            start = stop
    if current:
        shards.append(current)
    return shards


@dataclass(frozen=True)
class _Pack:
    """Rank r: write the stage's kept shards `per_rank * r` to `per_rank * (r + 1)` (`documents/NNNNN.jsonl.zst`),
    each from its pieces of the tasks' kept lines (`shards[g]`: task, first line, end line)."""

    shards: list[list[tuple[int, int, int]]]
    kept_files: list[Path]
    out_dir: Path
    per_rank: int

    def __call__(self, rank: int) -> dict[str, Any]:
        entries = []
        for index in range(self.per_rank * rank, min(self.per_rank * (rank + 1), len(self.shards))):
            with ShardWriter(self.out_dir / DOCUMENTS / shard_name(index)) as writer:
                for task, start, stop in self.shards[index]:
                    stem = self.kept_files[task]
                    ends = np.concatenate([[0], np.cumsum(np.load(stem.with_name(stem.name + _LENGTHS)))])
                    with open(stem.with_name(stem.name + ".jsonl"), "rb") as handle:
                        handle.seek(int(ends[start]))
                        left = int(ends[stop] - ends[start])
                        while left:  # blocks of whole lines, so each block's records are counted
                            end = min(stop, int(np.searchsorted(ends, ends[start] + _BLOCK_BYTES, side="right")) - 1)
                            end = max(end, start + 1)
                            size = int(ends[end] - ends[start])
                            writer.write_lines(handle.read(size), end - start)
                            start, left = end, left - size
                writer.close()
                entries.append({"path": f"{DOCUMENTS}/{shard_name(index)}", "num_records": writer.num_records,
                                "num_bytes": writer.num_bytes})
        return {"shards": entries}


@contextmanager
def _opened(path: Path) -> Iterator[BinaryIO]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        yield handle


def _merge(cfg: CollectConfig, policy: LicencePolicy, run: ShardRun, kept: list[dict[str, Any]],
           out_dir: Path) -> dict[str, Any]:
    """The tasks' summaries added up: the stage's stats, compliance report, removal report and listing."""
    reports = [SourceReport(source.name, source.path, source.format, source.domain, source.licence)
               for source in cfg.sources]
    by_name = {report.name: report for report in reports}
    for result in run.results:
        for name, part in result["reports"].items():
            _add_report(by_name[name], part)
    compliance = compliance_report(reports, policy.allowed)
    (out_dir / "compliance.json").write_text(json.dumps(compliance, indent=2) + "\n", encoding="utf-8")
    (out_dir / "compliance.md").write_text(compliance_markdown(compliance), encoding="utf-8")
    return {
        **run.counts().as_dict(),
        "num_repaired": run.total("num_repaired") or 0,  # inputs whose lone surrogates became U+FFFD (tasks.data.untrusted)
        "by_source": {r.name: r.num_kept for r in reports},
        "by_domain": dict(sorted((run.total("by_domain") or {}).items())),
        "by_format": dict(sorted((run.total("by_format") or {}).items())),
        "num_chars": sum(r.num_chars for r in reports),
        "accounting": write_removal_report(out_dir, "collect", run.tally().table()),  # removals.json/.md/.png
        "shards": write_listing(out_dir, {DOCUMENTS: kept, **{kind: [entry for result in run.results
                                                                      for entry in result["shards"][kind]]
                                                               for kind in (REMOVED, QUARANTINE)}}),
        "num_tasks": len(run.results),
        "executor_cpu_s": run.outside_cpu_s,
    }


def _position(location: dict[str, Any]) -> Any:
    """Where in its file a record without an id was: its line, row or byte offset."""
    return next((location[key] for key in ("line", "row", "offset") if key in location), None)


def _domain_of(candidate: Candidate, source: Source) -> str | None:
    """The candidate's domain: its `domain_field` (a declared domain), else the source's; None (with the
    candidate's detail saying why) for a value the source does not declare."""
    field = getattr(source, "domain_field", None)
    value = None if field is None else candidate.metadata.get(field)
    if value is None:
        return source.domain
    if isinstance(value, str) and value in source.all_domains():
        return value
    candidate.detail = (f"field {field!r} is {value!r}, not one of the source's domains {source.all_domains()}; "
                        f"add it to the source's `domains` or fix the record")
    candidate.raw = json.dumps({"id": candidate.id, "text": candidate.text, "licence": candidate.licence,
                                "metadata": candidate.metadata}, ensure_ascii=False)  # quarantined whole, not lost
    return None


def _judge(
    candidate: Candidate, source: Source, min_chars: int, policy: LicencePolicy, seen_ids: set[str],
    checked: list[str],
) -> tuple[str | None, Document | None, LicenceVerdict | None]:
    """(None, doc, verdict) to keep; (reason, doc, verdict) to remove; (reason, None, None) to quarantine
    (or to remove, for a candidate with a `skip` reason). A record that reaches the id check appends its
    id to `checked` (what `tasks.data.collect_ids` compares across tasks)."""
    if candidate.skip is not None:
        return candidate.skip, None, None
    if candidate.problem is not None:
        return candidate.problem, None, None
    assert candidate.text is not None
    domain = _domain_of(candidate, source)
    if domain is None:
        return "unknown_domain", None, None
    written = candidate.licence or source.licence
    if written is None:
        return "missing_licence", None, None
    if len(candidate.text.strip()) < min_chars:
        return "empty_text", None, None
    if candidate.id is not None:
        doc_id = f"{source.name}/{candidate.id}"
    else:
        doc_id = f"{source.name}/{candidate.location['path']}:{_position(candidate.location)}"
    checked.append(doc_id)
    if doc_id in seen_ids:
        candidate.detail = f"id {doc_id!r} was already used by an earlier record"
        return "duplicate_id", None, None
    verdict = policy.judge(written)
    metadata = candidate.metadata
    if verdict.label != written:  # provenance: the licence as the input wrote it
        metadata = {**metadata, "licence_as_written": written}
    doc = Document(doc_id, candidate.text, source.name, domain, verdict.label, metadata)
    if not _sampled(doc_id, source.weight):
        return "sampled_out", doc, None
    if verdict.status == "unknown":
        shown = written if len(written) <= _MAX_REASON_LICENCE_CHARS else written[:_MAX_REASON_LICENCE_CHARS] + "…"
        return f"licence_unknown:{shown}", doc, verdict
    if verdict.status == "not_allowed":
        return f"licence_not_allowed:{verdict.label}", doc, verdict
    return None, doc, verdict
