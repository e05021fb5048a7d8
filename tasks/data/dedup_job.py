"""The fast dedup engine on a cluster executor: the whole single-node dedup (or a new batch's dedup
against a saved index) as one datatrove task.

The fast engine's clustering needs every signature in one process, so it is not split into
ranks; on `cluster.executor: slurm | ray` it runs as one job with `num_workers` CPUs on the
cluster (where the data and the cores are) instead of in the orchestrating process. The job
writes the stage's files into `out_dir` as the local run does and leaves its stats in the job's
folder for this process to return.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from tasks.data.dedup import DedupConfig, dedup_against_index, dedup_documents
from tasks.data.executors import LOCAL, ExecutorSettings, run_pipeline

JOB_DIR = "_job"  # datatrove's logs and the job's result, removed once the stage has its files
RESULT_FILE = "result.json"


class DedupJob(PipelineStep):
    """`dedup_documents` (or, given `index_dir`, `dedup_against_index`) as a pipeline step (rank 0 of 1);
    its stats go to `RESULT_FILE`."""

    name = "Kiln fast dedup"
    type = "DEDUP"

    def __init__(self, cfg: DedupConfig, input_file: Path, out_dir: Path, index_dir: Path | None = None):
        super().__init__()
        self.cfg, self.input_file, self.out_dir, self.index_dir = cfg, input_file, out_dir, index_dir

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        stats = dedup(self.cfg, self.input_file, self.out_dir, self.index_dir)
        self.stat_update("documents", value=stats["num_in"])
        (self.out_dir / JOB_DIR / RESULT_FILE).write_text(json.dumps(stats))
        yield from ()


def dedup(cfg: DedupConfig, input_file: Path, out_dir: Path, index_dir: Path | None = None) -> dict:
    """The fast dedup of `input_file`, against the saved index in `index_dir` if one is given."""
    if index_dir is None:
        return dedup_documents(cfg, input_file, out_dir)
    return dedup_against_index(cfg, index_dir, input_file, out_dir)


def dedup_on_executor(cfg: DedupConfig, input_file: Path, out_dir: Path, executor: ExecutorSettings = LOCAL,
                      index_dir: Path | None = None) -> dict:
    """The fast dedup of `input_file` (against `index_dir`, if given) into `out_dir`: here when local,
    else as one job on `executor`."""
    if executor.kind == "local":
        return dedup(cfg, input_file, out_dir, index_dir)
    # Absolute: Slurm and Ray workers do not share this process's working directory.
    input_file, out_dir = input_file.resolve(), out_dir.resolve()
    index_dir = None if index_dir is None else index_dir.resolve()
    job_dir = out_dir / JOB_DIR
    shutil.rmtree(job_dir, ignore_errors=True)  # one rank: nothing of an earlier attempt to keep
    job_dir.mkdir(parents=True)
    run_pipeline([DedupJob(cfg, input_file, out_dir, index_dir)], job_dir, tasks=1, jobs=1, settings=executor,
                 job_name="kiln_dedup_fast", cpus_per_task=cfg.num_workers)
    stats = json.loads((job_dir / RESULT_FILE).read_text())
    shutil.rmtree(job_dir)
    return stats
