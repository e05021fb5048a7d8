"""What running the sweep's proxy trials as Slurm jobs costs against running them in the stage's processes.

Runs the config's whole sweep (both phases: IsoFLOP and mixture trials, then LR x batch) with
`run_sweep`, as the sweep stage does, on the tokenize stage's output of an earlier
`kiln run CONFIG --until tokenize` in WORK_DIR: once in `sweep.max_parallel` processes here
(`cluster.launcher: local`) and once as Slurm jobs (`cluster.launcher: slurm`, at most
`sweep.max_parallel` at once, each training its share of the trials in one process) on a real
single-node Slurm cluster started here, each into a fresh folder, `--repeats` times, alternating
which goes first so that a change in machine load falls on both. The cluster's start-up is paid once
and printed apart. Both sweeps must give the fit the same numbers (every trial's results but its wall
time), which is checked. MLflow logging is left out (a few calls per trial, the same for both).

Prints each run's wall time, the medians and their ratio, and each one's wall per second of summed
trial training (the trials' own time, which the machine's load moves as it moves the walls); last line
`RESULT sweep_slurm_overhead <median Slurm wall / median in-process wall>`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere
# as `kiln` sets it (flows/cli.py) before torch loads: spinning OpenMP threads slow a shared machine's
# trial processes several times, which would be measured as the in-process sweep's cost
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kiln.tasks.config import load_config  # noqa: E402
from kiln.tasks.constants import SHARDS_FILE  # noqa: E402
from kiln.tasks.graph import stage_keys  # noqa: E402
from kiln.tasks.launch.local_slurm import LocalSlurmCluster, free_port  # noqa: E402
from kiln.tasks.ledger import StageRecorder, SubRuns  # noqa: E402
from kiln.tasks.scaling.sweep import TrialResult, run_sweep  # noqa: E402
from kiln.tasks.scaling.trial_runs import JOBS_DIR, JobTrials, PoolTrials  # noqa: E402
from kiln.tasks.store import Store  # noqa: E402
from kiln.tasks.tracker import NullTracker  # noqa: E402


def fit_inputs(results: list[TrialResult]) -> list[dict]:
    return [{k: v for k, v in asdict(r).items() if k != "wall_s"} for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Expected duration: about 10 minutes per repeat on 2 cores (the default sweep "
                                            "took 306-367 s in processes and 195-246 s as Slurm jobs), plus the cluster's start.")
    parser.add_argument("--config", default="configs/default.yaml", help="whose sweep (default: configs/default.yaml)")
    parser.add_argument("--work-dir", required=True, help="a work_dir whose tokenize stage is complete")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each way, alternating (default: 1)")
    args = parser.parse_args()
    cfg = load_config(args.config, [f"work_dir={args.work_dir}"])
    store, key = Store(cfg.store_root), stage_keys(cfg)["tokenize"]
    if not store.is_complete("tokenize", key):
        sys.exit(f"no complete tokenize stage in {cfg.store_root} (key {key}): run "
                 f"`kiln run {args.config} --work-dir {args.work_dir} --until tokenize` first")
    tokenized = store.path("tokenize", key)
    shards = json.loads((tokenized / SHARDS_FILE).read_text())
    with tempfile.TemporaryDirectory(prefix="kiln-sweep-cluster-") as scratch:
        started = time.perf_counter()
        with LocalSlurmCluster(Path(scratch) / "slurm") as cluster:
            os.environ.update(cluster.env)  # sbatch, squeue, scontrol find it
            print(f"Slurm cluster started in {time.perf_counter() - started:.1f} s (paid once, not per sweep)",
                  flush=True)
            times: dict[str, list[float]] = {"in-process": [], "slurm": []}
            training: dict[str, list[float]] = {"in-process": [], "slurm": []}  # summed trial training seconds
            reference: list[dict] | None = None
            for repeat in range(args.repeats):
                order = ("in-process", "slurm") if repeat % 2 == 0 else ("slurm", "in-process")
                for where in order:
                    out = Path(scratch) / f"{where}-{repeat}"
                    subruns = SubRuns(StageRecorder(NullTracker(), "bench", "sweep", "bench"), out)
                    trials = (PoolTrials(cfg.sweep.max_parallel, cfg.cluster.max_restarts) if where == "in-process"
                              else JobTrials("slurm", cfg.cluster.model_copy(update={"rdzv_port": free_port()}),
                                             cfg.sweep.max_parallel, out / JOBS_DIR))
                    start = time.perf_counter()
                    results = run_sweep(cfg.sweep, shards, tokenized, subruns, where=trials,
                                        mixture_folds=cfg.fit.mixture_folds)
                    wall = time.perf_counter() - start
                    times[where].append(wall)
                    training[where].append(sum(r.wall_s for r in results))
                    if reference is None:
                        reference = fit_inputs(results)
                    elif fit_inputs(results) != reference:
                        sys.exit(f"repeat {repeat}: the {where} sweep's results differ from the first sweep's")
                    print(f"repeat {repeat}: {where}: {wall:.1f} s wall, {len(results)} trials, "
                          f"{sum(r.wall_s for r in results):.1f} s summed trial training time", flush=True)
    local, slurm = statistics.median(times["in-process"]), statistics.median(times["slurm"])
    print(f"median: in-process {local:.1f} s, Slurm {slurm:.1f} s (max_parallel={cfg.sweep.max_parallel}); "
          f"Slurm / in-process = {slurm / local:.2f}; the fit's inputs were identical in every run")
    # the machine's load moves both walls; wall per second of trial training moves much less
    per_second = {where: statistics.median(w / t for w, t in zip(times[where], training[where], strict=True))
                  for where in times}
    print(f"wall per second of summed trial training (less sensitive to load): in-process "
          f"{per_second['in-process']:.3f}, Slurm {per_second['slurm']:.3f}, ratio "
          f"{per_second['slurm'] / per_second['in-process']:.2f}")
    print(f"RESULT sweep_slurm_overhead {slurm / local:.3f}")


if __name__ == "__main__":
    main()
