"""The data half on the real local Slurm and Ray clusters gives what the local executor gives, byte for
byte, and a worker killed mid-stage loses and duplicates nothing.

The corpus is a slice of the bundled sample (coreutils man pages, with their natural near
duplicates, Python sources, Czech/Danish and other man pages, and one empty document) in two
collected shards. Clean, dedup, decontaminate and tokenize run on the local executor once as the
reference, then on each cluster: every output file equals the reference's. (The datatrove dedup
engine's own four pipelines are tested locally, tests/tasks/data/test_dedup_datatrove.py: five more
cluster jobs each would add minutes to CI.) Workers are
killed for real, with SIGKILL from outside (this test's own, found through its engine:
tests/processes.py): on Slurm the stage then fails naming the rank's log, and a rerun skips the rank
that finished (datatrove's completion markers); on Ray datatrove resubmits
the dead actor's ranks within the same run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from datatrove.executor import (
    LocalPipelineExecutor,
    RayPipelineExecutor,
    SlurmPipelineExecutor,
)
from loguru import logger

from kiln.tasks.data.clean import CleanConfig, clean_documents
from kiln.tasks.data.decontaminate import DecontaminateConfig, decontaminate_documents
from kiln.tasks.data.dedup import DedupConfig
from kiln.tasks.data.dedup_job import dedup_documents
from kiln.tasks.data.documents import Document
from kiln.tasks.accounting import DocCounts
from kiln.tasks.data.executors import ExecutorError, ExecutorSettings, RankLedger, ShardRun, build_executor
from kiln.tasks.data.inspection import RemovalTally
from kiln.tasks.data.shards import shard_paths
from kiln.tasks.data.tokenize import TokenizeConfig, tokenize_corpus
from kiln.tasks.errors import ConfigError
from kiln.tasks.launch.cluster import SlurmSettings
from tests.fixtures.shards import write_stage
from tests.processes import killing_first, ray_actors, slurm_job_steps

REPO = Path(__file__).parents[3]
SAMPLE = REPO / "data" / "sample"
HELDOUT = REPO / "data" / "evals" / "heldout.jsonl"
WORKERS = 2
SLURM, RAY = ExecutorSettings("slurm"), ExecutorSettings("ray")
# Outputs that record how a run went (datatrove's logs and timings, the executor's name), not what it made.
RUN_RECORDS = ("datatrove.log", "datatrove_stats.json", "stats.json")


def _slice() -> list[Document]:
    pages = sorted((SAMPLE / "prose" / "coreutils-man").glob("*.txt"))[:40]  # b2sum..md5sum: base32/64, dir/ls
    docs = [Document(f"coreutils/{p.stem}", p.read_text(encoding="utf-8"), "coreutils", "prose", "GPL-3.0-or-later")
            for p in pages]
    for name, domain, picks in (("code/code.jsonl", "code", range(6)),
                                ("multilingual/multilingual.jsonl", "multilingual", range(0, 90, 15))):
        records = (SAMPLE / name).read_text(encoding="utf-8").splitlines()
        for i in picks:
            r = json.loads(records[i])
            docs.append(Document(r["id"], r["text"], r["source"], domain, r["licence"], r["metadata"]))
    docs.append(Document("empty", " \n", "coreutils", "prose", "GPL-3.0-or-later"))  # quarantined
    return docs


def _clean(out: Path, collected: Path, executor: ExecutorSettings) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    # The default run's clean settings with the shipped quality model (one trained from references differs
    # per training).
    section = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())["clean"]
    section |= {"num_workers": WORKERS, "quality_training": None, "quality_top_fraction": None}
    cfg = CleanConfig.model_validate(section)
    return clean_documents(cfg, collected, out, executor)


def _made(stats: dict) -> dict:
    """A stage's stats without the records of how it ran (the CPU seconds of ranks outside this process)."""
    return {key: value for key, value in stats.items() if key != "executor_cpu_s"}


def _after_clean(root: Path, executor: ExecutorSettings) -> dict[str, dict]:
    """Dedup, decontaminate and tokenize on `executor`, from the clean output in `root`; their stats."""
    (root / "dedup").mkdir()
    stats = {"dedup": _made(dedup_documents(DedupConfig(num_workers=WORKERS), shard_paths(root / "clean"),
                                            root / "dedup", executor))}
    (root / "decontaminate").mkdir()
    stats["decontaminate"] = _made(decontaminate_documents(
        DecontaminateConfig(num_workers=WORKERS), shard_paths(root / "dedup"), [HELDOUT], root / "decontaminate",
        executor=executor))
    (root / "tokenize").mkdir()
    stats["tokenize"] = _made(tokenize_corpus(TokenizeConfig(vocab_size=300, num_workers=WORKERS),
                                              root / "decontaminate", root / "tokenize", executor))
    return stats


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict:
    """The reference: every stage on the local executor."""
    root = tmp_path_factory.mktemp("local")
    collected = write_stage(root / "collect", _slice(), num_shards=2)
    stats = {"clean": _made(_clean(root / "clean", collected, ExecutorSettings()))} | _after_clean(root, ExecutorSettings())
    # The slice exercises every count: kept, removed for several reasons, quarantined, duplicates.
    clean = stats["clean"]
    assert clean["num_kept"] > 30 and len(clean["removed"]) >= 3 and clean["quarantined"] == {"empty_text": 1}
    assert stats["dedup"]["num_removed"] > 0 and stats["decontaminate"]["num_removed"] > 0
    assert stats["tokenize"]["num_tokens"] > 0
    return {"root": root, "collected": collected, "stats": stats}


def _files(folder: Path) -> dict[str, bytes]:
    """Every file a stage made under `folder`, by relative path, but the records of how it ran."""
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file() and path.name not in RUN_RECORDS and "logs" not in path.relative_to(folder).parts}


def _assert_same_files(out: Path, reference: Path) -> None:
    made, expected = _files(out), _files(reference)
    assert sorted(made) == sorted(expected)
    assert [name for name in expected if made[name] != expected[name]] == []


@contextmanager
def _logged() -> Iterator[list[str]]:
    """What datatrove logs in this process (the driver) meanwhile, INFO and up."""
    messages: list[str] = []
    sink = logger.add(lambda message: messages.append(str(message)), level="INFO")
    try:
        yield messages
    finally:
        logger.remove(sink)


def test_the_data_half_on_slurm_survives_a_killed_rank_and_equals_local(local, slurm_cluster, tmp_path):
    """Clean, with a rank killed, then rerun; then dedup, decontaminate and tokenize, as the pipeline runs them."""
    out = tmp_path / "clean"
    logs = out / "_datatrove" / "logs"
    pickle = str(logs / "executor.pik")

    ranks = slurm_job_steps(slurm_cluster.env, argument=pickle)  # this cluster's job steps running the pickle
    with killing_first(ranks) as killed, pytest.raises(ExecutorError) as failed:
        _clean(out, local["collected"], SLURM)
    assert killed, "no Slurm rank was seen running"
    message = str(failed.value)
    assert "kiln_clean on the slurm executor: 1 of 2 ranks did not finish" in message
    dead = int(re.search(r"rank (\d): log ", message).group(1))
    assert str(logs / "logs" / f"task_{dead:05d}.log") in message
    assert re.search(rf"Slurm output {re.escape(str(logs / 'slurm_logs'))}/\d+_{dead}\.out", message)
    assert (logs / "completions" / f"{1 - dead:05d}").is_file()

    jobs = []
    recorded = ExecutorSettings("slurm", on_job=jobs.append)
    stats = _clean(out, local["collected"], recorded)  # the rerun: only the killed rank runs again
    assert jobs[0]["attempts"][-1]["ranks"] == [dead]  # only the killed rank ran again
    assert _made(stats) == local["stats"]["clean"]
    assert stats["executor_cpu_s"] > 0  # the rank ran outside this process tree; it said what it used
    assert not (out / "_datatrove").exists()
    assert _after_clean(tmp_path, recorded) == {name: stats for name, stats in local["stats"].items() if name != "clean"}
    for stage in ("clean", "dedup", "decontaminate", "tokenize"):
        _assert_same_files(tmp_path / stage, local["root"] / stage)
    # each stage's jobs are recorded for its manifest: the clean rerun, dedup's two, decontaminate, tokenize's
    # (its second job encodes again the shard holding a document that a domain's empty split takes)
    assert [job["job_name"] for job in jobs] == ["kiln_clean", "kiln_dedup_sign", "kiln_dedup_write",
                                                 "kiln_decontaminate", "kiln_tokenize", "kiln_tokenize_moves"], jobs
    assert len({job["job_ids"][0] for job in jobs}) == 6 and {job["launcher"] for job in jobs} == {"slurm executor"}
    assert all(job["nodes"] == slurm_cluster.node_names for job in jobs), jobs


def test_the_data_half_on_ray_survives_a_killed_worker_and_equals_local(local, ray_cluster, tmp_path):
    # This job's RankWorker actors that have forked their rank (killed earlier, while the actor
    # starts, datatrove 0.10.1 waits forever); the rank processes carry the actor's title too.
    workers = ray_actors("RankWorker", forked=True)
    with _logged() as messages, killing_first(workers) as killed:
        stats = _clean(tmp_path / "clean", local["collected"], RAY)
    assert killed, "no Ray rank worker was seen running"
    assert any("RayActorError" in m for m in messages), messages  # datatrove saw the death and resubmitted
    assert _made(stats) == local["stats"]["clean"]
    assert _after_clean(tmp_path, RAY) == {name: stats for name, stats in local["stats"].items() if name != "clean"}
    for stage in ("clean", "dedup", "decontaminate", "tokenize"):
        _assert_same_files(tmp_path / stage, local["root"] / stage)


def test_executors_are_built_from_the_cluster_section(tmp_path):
    def build(settings: ExecutorSettings):
        return build_executor([], tmp_path / "logs", tasks=14, jobs=3, settings=settings, job_name="kiln_x")

    local = build(ExecutorSettings())
    assert isinstance(local, LocalPipelineExecutor) and (local.world_size, local.workers) == (14, 3)
    ray = build(RAY)
    assert isinstance(ray, RayPipelineExecutor) and (ray.tasks_per_job, ray.cpus_per_task) == (5, 1)

    slurm = build(ExecutorSettings("slurm", partition="cpu", time_limit="02:00:00"))
    assert isinstance(slurm, SlurmPipelineExecutor) and slurm.tasks_per_job == 5
    script = slurm.get_launch_file_contents(slurm.get_sbatch_args(max_array=3), "launch_pickled_pipeline x")
    lines = script.splitlines()
    directives = [line for line in lines[1:] if line.startswith("#SBATCH")]
    assert lines[1 : 1 + len(directives)] == directives  # sbatch reads directives only before the first command
    assert {"#SBATCH --partition=cpu", "#SBATCH --time=02:00:00", "#SBATCH --array=0-2",
            "#SBATCH --job-name=kiln_x"} <= set(directives)
    assert not any(line.startswith("#SBATCH --qos") for line in directives)
    assert f"source {Path(sys.prefix) / 'bin' / 'activate'}" in script  # the job runs this venv's Python
    assert Path(slurm.slurm_logs_folder) == tmp_path / "logs" / "slurm_logs"  # logs in the stage's folder
    # a stage's jobs are named after it and its key (tasks.stages._common.executor_settings), as training's are
    named = build(ExecutorSettings("slurm", partition="cpu", job_prefix="kiln-dedup-0123456789ab"))
    assert "#SBATCH --job-name=kiln-dedup-0123456789ab-x" in named.get_launch_file_contents(
        named.get_sbatch_args(max_array=3), "launch_pickled_pipeline x").splitlines()

    site = SlurmSettings(account="proj", qos="high", mem="8G", constraint="cpu", sbatch_lines=("--exclusive",),
                         modules=("gcc/12",), env={"HF_HOME": "/scratch/hf cache"})
    slurm = build(ExecutorSettings("slurm", partition="cpu", slurm=site))
    script = slurm.get_launch_file_contents(slurm.get_sbatch_args(max_array=3), "launch_pickled_pipeline x")
    directives = {line for line in script.splitlines() if line.startswith("#SBATCH")}
    assert {"#SBATCH --account=proj", "#SBATCH --qos=high", "#SBATCH --mem=8G", "#SBATCH --constraint=cpu",
            "#SBATCH --exclusive"} <= directives
    assert not any(line.startswith("#SBATCH --mem-per-cpu") for line in directives)  # sbatch refuses both
    body = script[script.index("module load gcc/12"):]
    assert body.index("export HF_HOME='/scratch/hf cache'") < body.index(f"source {Path(sys.prefix) / 'bin' / 'activate'}")
    assert slurm.srun_args is None  # no image: the step runs on the node, in this venv

    # in an image: pyxis runs each step in it, in this folder; nothing of this machine's environment is named
    in_image = build(ExecutorSettings("slurm", partition="cpu", slurm=site.model_copy(
        update={"container_mounts": ("/lustre:/lustre",)}), image="/lustre/images/kiln-0.1.0-cpu.sqsh"))
    assert in_image.srun_args == {"container-image": "/lustre/images/kiln-0.1.0-cpu.sqsh",
                                  "container-workdir": str(Path.cwd()), "container-mounts": "/lustre:/lustre"}
    script = in_image.get_launch_file_contents(in_image.get_sbatch_args(max_array=3), "launch_pickled_pipeline x")
    assert "export HF_HOME='/scratch/hf cache'" in script
    assert "module load" not in script and "activate" not in script and sys.prefix not in script


def test_an_unknown_executor_is_refused():
    with pytest.raises(ConfigError, match="'k8s' is not one of local, slurm, ray"):
        ExecutorSettings("k8s")  # type: ignore[arg-type]


def test_a_rank_outside_this_process_tree_reports_its_cpu_seconds(tmp_path):
    """A rank on a Slurm node or a remote Ray cluster is no descendant of the driver: its CPU seconds come
    back in the results (a stage's `executor_cpu_s`); one in this process tree is the runner's to measure."""
    ledger = RankLedger(tmp_path, ("key-0", "key-1"))
    elsewhere = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # not an ancestor of ours
    try:
        ledger.record(0, {"n": 1}, 2.5, driver_pid=elsewhere.pid)
    finally:
        elsewhere.kill()
        elsewhere.wait()
    ledger.record(1, {"n": 2}, 1.5, driver_pid=os.getpid())
    run = ledger.results()
    assert run.results == [{"n": 1}, {"n": 2}] and run.outside_cpu_s == 2.5


def test_the_ranks_summaries_add_up_in_one_way(tmp_path):
    """Counts, tallies, listings and any other summed field, over ranks that each saw part of the corpus
    (the second wrote no removed shard; the third, an empty input shard, wrote nothing)."""
    def rank(num_in: int, kept: int, removed: dict, tally: RemovalTally, shards: dict, extra: dict) -> dict:
        counts = DocCounts(num_in, kept, Counter(removed))
        return {"counts": counts.as_dict(), "tally": tally.table(), "shards": shards, **extra}

    first, second = RemovalTally(), RemovalTally()
    first.add("kept", "web", 10)
    first.add("removed", "web", 5, "gopher_quality:too_short")
    first.add("removed", "code", 7, "code_rules:too_long")
    second.add("kept", "web", 3)
    second.add("removed", "web", 4, "gopher_quality:few_stop_words")
    entry = lambda kind, i, n: {"path": f"{kind}/{i:05d}.jsonl.zst", "num_records": n, "num_bytes": 10 * n}  # noqa: E731
    run = ShardRun([
        rank(3, 1, {"gopher_quality:too_short": 1, "code_rules:too_long": 1}, first,
             {"documents": entry("documents", 0, 1), "removed": entry("removed", 0, 2), "quarantine": None},
             {"languages": {"en": 1}, "num_redacted": 1}),
        rank(2, 1, {"gopher_quality:few_stop_words": 1}, second,
             {"documents": entry("documents", 1, 1), "removed": entry("removed", 1, 1), "quarantine": None},
             {"languages": {"de": 1, "en": 2}, "num_redacted": 0}),
        rank(0, 0, {}, RemovalTally(), {"documents": None, "removed": None, "quarantine": None},
             {"languages": {}, "num_redacted": 0}),
    ], outside_cpu_s=0.0)
    assert run.counts().as_dict() == {"num_in": 5, "num_kept": 2, "num_removed": 3, "num_quarantined": 0,
                                      "removed": {"code_rules:too_long": 1, "gopher_quality:few_stop_words": 1,
                                                  "gopher_quality:too_short": 1}, "quarantined": {}}
    table = run.tally().table()
    assert table["web"]["in"] == {"docs": 4, "bytes": 22} and table["web"]["removed"] == {
        "gopher_quality": {"docs": 2, "bytes": 9}}
    assert table["code"] == {"in": {"docs": 1, "bytes": 7}, "kept": {"docs": 0, "bytes": 0},
                             "removed": {"code_rules": {"docs": 1, "bytes": 7}}, "quarantined": {}}
    assert run.total("languages") == {"en": 3, "de": 1} and run.total("num_redacted") == 1
    listing = run.listing(tmp_path)
    assert [e["path"] for e in listing["documents"]] == ["documents/00000.jsonl.zst", "documents/00001.jsonl.zst"]
    assert [e["num_records"] for e in listing["removed"]] == [2, 1] and listing["quarantine"] == []
    assert json.loads((tmp_path / "document_shards.json").read_text()) == listing
    assert ShardRun([], 0.0).total("languages") is None and ShardRun([], 0.0).counts().num_in == 0
