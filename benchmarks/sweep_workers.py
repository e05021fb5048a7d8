"""How long the default sweep takes with 1 and with 2 worker processes (`sweep.max_parallel`).

Runs the config's whole sweep (both phases: IsoFLOP and mixture trials, then LR x batch) with
`run_sweep`, as the sweep stage does, on the tokenize stage's output of an earlier
`kiln run CONFIG --until tokenize` in WORK_DIR, once per worker count per repeat (alternating, so
a change in machine load falls on both), each into a fresh folder. MLflow logging is left out: a
few calls per trial. Prints each run's wall time and the trials' summed training time, the
median per worker count and their ratio; last line `RESULT sweep_speedup_2_workers <ratio>`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `kiln` sets it (flows/cli.py) before torch loads

from kiln.tasks.config import load_config  # noqa: E402
from kiln.tasks.constants import SHARDS_FILE  # noqa: E402
from kiln.tasks.graph import stage_keys  # noqa: E402
from kiln.tasks.ledger import StageRecorder, SubRuns  # noqa: E402
from kiln.tasks.scaling.sweep import run_sweep  # noqa: E402
from kiln.tasks.scaling.trial_runs import PoolTrials  # noqa: E402
from kiln.tasks.store import Store  # noqa: E402
from kiln.tasks.tracker import NullTracker  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Expected duration: about 10-12 minutes per repeat on 2 cores (one sweep with 1 "
                                            "worker and one with 2, ~5 min each).")
    parser.add_argument("--config", default="configs/default.yaml", help="whose sweep (default: configs/default.yaml)")
    parser.add_argument("--work-dir", required=True, help="a work_dir whose tokenize stage is complete")
    parser.add_argument("--repeats", type=int, default=1, help="runs per worker count, alternating (default: 1)")
    args = parser.parse_args()
    cfg = load_config(args.config, [f"work_dir={args.work_dir}"])
    store, key = Store(cfg.store_root), stage_keys(cfg)["tokenize"]
    if not store.is_complete("tokenize", key):
        sys.exit(f"no complete tokenize stage in {cfg.store_root} (key {key}): run "
                 f"`kiln run {args.config} --work-dir {args.work_dir} --until tokenize` first")
    tokenized = store.path("tokenize", key)
    shards = json.loads((tokenized / SHARDS_FILE).read_text())
    times: dict[int, list[float]] = {1: [], 2: []}
    for repeat in range(args.repeats):
        for workers in (1, 2):
            sweep = cfg.sweep.model_copy(update={"max_parallel": workers})
            with tempfile.TemporaryDirectory(prefix="kiln-sweep-bench-") as out:
                subruns = SubRuns(StageRecorder(NullTracker(), "bench", "sweep", "bench"), Path(out))
                start = time.perf_counter()
                results = run_sweep(sweep, shards, tokenized, subruns, where=PoolTrials(workers),
                                    mixture_folds=cfg.fit.mixture_folds)
                wall = time.perf_counter() - start
            times[workers].append(wall)
            print(f"repeat {repeat}: {workers} worker(s): {wall:.1f} s wall, {len(results)} trials, "
                  f"{sum(r.wall_s for r in results):.1f} s summed trial training time", flush=True)
    one, two = statistics.median(times[1]), statistics.median(times[2])
    print(f"median: 1 worker {one:.1f} s, 2 workers {two:.1f} s; 1 / 2 workers = {one / two:.2f}")
    print(f"RESULT sweep_speedup_2_workers {one / two:.3f}")


if __name__ == "__main__":
    main()
