"""Clean and dedup on the real local Slurm and Ray clusters give what the local executor gives, and a
worker killed mid-stage loses and duplicates nothing.

The corpus is a slice of the bundled sample (coreutils man pages, with their natural near
duplicates, Python sources, Czech/Danish and other man pages, and one empty document), cleaned
and deduplicated once on the local executor as the reference. Workers are killed for real, with
SIGKILL from outside (this test's own, found through its engine: tests/processes.py): on Slurm the stage then fails naming the rank's log, and a rerun skips the
rank that finished (datatrove's completion markers); on Ray datatrove resubmits the dead actor's
ranks within the same run.
"""

from __future__ import annotations

import json
import re
import sys
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

from tasks.data.clean import CleanConfig, clean_documents
from tasks.data.dedup import DedupConfig
from tasks.data.dedup_datatrove import dedup_with_datatrove
from tasks.data.dedup_job import dedup_on_executor
from tasks.data.documents import (
    DOCUMENTS_FILE,
    QUARANTINE_FILE,
    REMOVED_FILE,
    Document,
    write_documents,
)
from tasks.data.executors import ExecutorError, ExecutorSettings, build_executor
from tasks.errors import ConfigError
from tasks.launch.cluster import SlurmSettings
from tests.processes import killing_first, ray_actors, slurm_job_steps

REPO = Path(__file__).parents[3]
SAMPLE = REPO / "data" / "sample"
WORKERS = 2
SLURM, RAY = ExecutorSettings("slurm"), ExecutorSettings("ray")


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


def _clean(out: Path, corpus: Path, executor: ExecutorSettings) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    # The default run's clean settings with the shipped quality model (one trained from references differs
    # per training).
    section = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())["clean"]
    section |= {"num_workers": WORKERS, "quality_training": None, "quality_top_fraction": None}
    cfg = CleanConfig.model_validate(section)
    return clean_documents(cfg, corpus, out, executor)


def _dedup(out: Path, cleaned: Path, executor: ExecutorSettings) -> tuple[dict, dict]:
    """(fast engine's stats, datatrove engine's stats without the executor's name)."""
    (out / "fast").mkdir(parents=True)
    (out / "datatrove").mkdir()
    fast = dedup_on_executor(DedupConfig(num_workers=WORKERS), cleaned, out / "fast", executor)
    distributed = dedup_with_datatrove(DedupConfig(), cleaned, out / "datatrove", tasks=WORKERS, executor=executor)
    assert distributed.pop("executor") == executor.kind
    return fast, distributed


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict:
    """The reference: every stage on the local executor."""
    root = tmp_path_factory.mktemp("local")
    corpus = root / "corpus.jsonl"
    write_documents(corpus, _slice())
    clean = _clean(root / "clean", corpus, ExecutorSettings())
    fast, distributed = _dedup(root / "dedup", root / "clean" / DOCUMENTS_FILE, ExecutorSettings())
    # The slice exercises every count: kept, removed for several reasons, quarantined, duplicates.
    assert clean["num_kept"] > 30 and len(clean["removed"]) >= 3 and clean["quarantined"] == {"empty_text": 1}
    assert fast["num_removed"] > 0 and distributed["num_removed"] > 0
    return {"root": root, "corpus": corpus, "clean": clean, "fast": fast, "datatrove": distributed}


def _lines(path: Path) -> list[str]:
    """A JSON-lines file's records, order-insensitive (none: the file is absent)."""
    return sorted(path.read_text(encoding="utf-8").splitlines()) if path.is_file() else []


def _assert_same_files(out: Path, reference: Path) -> None:
    for name in (DOCUMENTS_FILE, REMOVED_FILE, QUARANTINE_FILE):
        assert _lines(out / name) == _lines(reference / name), name
    assert _lines(out / DOCUMENTS_FILE), "no documents kept"


@contextmanager
def _logged() -> Iterator[list[str]]:
    """What datatrove logs in this process (the driver) meanwhile, INFO and up."""
    messages: list[str] = []
    sink = logger.add(lambda message: messages.append(str(message)), level="INFO")
    try:
        yield messages
    finally:
        logger.remove(sink)


def test_clean_on_slurm_survives_a_killed_rank_and_equals_local(local, slurm_cluster, tmp_path):
    out = tmp_path / "clean"
    logs = out / "_datatrove" / "logs"
    pickle = str(logs / "executor.pik")

    ranks = slurm_job_steps(slurm_cluster.env, argument=pickle)  # this cluster's job steps running the pickle
    with killing_first(ranks) as killed, pytest.raises(ExecutorError) as failed:
        _clean(out, local["corpus"], SLURM)
    assert killed, "no Slurm rank was seen running"
    message = str(failed.value)
    assert "kiln_clean on the slurm executor: 1 of 2 ranks did not finish" in message
    dead = int(re.search(r"rank (\d): log ", message).group(1))
    assert str(logs / "logs" / f"task_{dead:05d}.log") in message
    assert re.search(rf"Slurm output {re.escape(str(logs / 'slurm_logs'))}/\d+_{dead}\.out", message)
    assert (logs / "completions" / f"{1 - dead:05d}").is_file()

    with _logged() as messages:
        stats = _clean(out, local["corpus"], SLURM)  # the rerun: only the killed rank runs again
    assert any("Launching Slurm job kiln_clean (1 tasks)" in m for m in messages), messages
    assert stats == local["clean"]
    _assert_same_files(out, local["root"] / "clean")
    assert not (out / "_datatrove").exists()


def test_dedup_on_slurm_equals_local(local, slurm_cluster, tmp_path):
    jobs = []
    fast, distributed = _dedup(tmp_path, local["root"] / "clean" / DOCUMENTS_FILE,
                               ExecutorSettings("slurm", on_job=jobs.append))
    assert fast == local["fast"] and distributed == local["datatrove"]
    for engine in ("fast", "datatrove"):
        _assert_same_files(tmp_path / engine, local["root"] / "dedup" / engine)
    assert not (tmp_path / "fast" / "_job").exists()
    # each pipeline's job is recorded for the stage: the fast job and datatrove's four, each on this node
    assert len(jobs) == 5 and len({job["job_ids"][0] for job in jobs}) == 5
    assert {job["launcher"] for job in jobs} == {"slurm executor"}
    assert all(job["nodes"] == slurm_cluster.node_names for job in jobs), jobs


def test_clean_on_ray_resubmits_a_killed_worker_and_equals_local(local, ray_cluster, tmp_path):
    # This job's RankWorker actors that have forked their rank (killed earlier, while the actor
    # starts, datatrove 0.10.1 waits forever); the rank processes carry the actor's title too.
    workers = ray_actors("RankWorker", forked=True)
    with _logged() as messages, killing_first(workers) as killed:
        stats = _clean(tmp_path, local["corpus"], RAY)
    assert killed, "no Ray rank worker was seen running"
    assert any("RayActorError" in m for m in messages), messages  # datatrove saw the death and resubmitted
    assert stats == local["clean"]
    _assert_same_files(tmp_path, local["root"] / "clean")


def test_dedup_on_ray_equals_local(local, ray_cluster, tmp_path):
    fast, distributed = _dedup(tmp_path, local["root"] / "clean" / DOCUMENTS_FILE, RAY)
    assert fast == local["fast"] and distributed == local["datatrove"]
    for engine in ("fast", "datatrove"):
        _assert_same_files(tmp_path / engine, local["root"] / "dedup" / engine)


def test_executors_are_built_from_the_cluster_section(tmp_path):
    def build(settings: ExecutorSettings, **kwargs):
        return build_executor([], tmp_path / "logs", tasks=14, jobs=3, settings=settings, job_name="kiln_x", **kwargs)

    local = build(ExecutorSettings())
    assert isinstance(local, LocalPipelineExecutor) and (local.world_size, local.workers) == (14, 3)
    ray = build(RAY, cpus_per_task=2)
    assert isinstance(ray, RayPipelineExecutor) and (ray.tasks_per_job, ray.cpus_per_task) == (5, 2)

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


def test_cluster_section_decides_the_executor():
    from tasks.config import ClusterConfig

    assert ExecutorSettings.from_cluster(ClusterConfig()) == ExecutorSettings("local")
    slurm = ClusterConfig(executor="slurm", partition="cpu", time_limit="01:00:00")
    assert ExecutorSettings.from_cluster(slurm) == ExecutorSettings("slurm", "cpu", "01:00:00")
    site = ClusterConfig(executor="slurm", slurm=SlurmSettings(account="proj"))
    assert ExecutorSettings.from_cluster(site).slurm.account == "proj"
    assert ExecutorSettings.from_cluster(ClusterConfig(executor="ray", partition="cpu")) == ExecutorSettings("ray")
    with pytest.raises(ConfigError, match="'k8s' is not one of local, slurm, ray"):
        ExecutorSettings("k8s")  # type: ignore[arg-type]
