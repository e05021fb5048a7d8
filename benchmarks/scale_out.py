"""What a cluster executor costs on one machine: clean and dedup on the local, Slurm and Ray executors.

Collects the bundled corpus once (the default run's sources), then runs the clean stage's work
(`clean_documents`, `--workers` datatrove ranks) and the dedup stage's (`dedup_on_executor`, the
default fast engine as one job; `dedup_with_datatrove`, the four-stage MinHash pipeline on
`--workers` ranks) on each executor, `--repeats` times, in fresh folders. The Slurm cluster is a
real single-node one started here (`tasks.launch.local_slurm`), Ray a local cluster started here;
their start-up is printed apart, as it is paid once per cluster, not per stage. Every executor's
outputs are checked against the local ones (same kept and removed counts).

The clean settings are the default run's, with the shipped quality model instead of one trained
from references (training happens before the executor runs, identically for each).

Prints documents/s for each (median seconds) and the ratio to local; last line
`RESULT executor_overhead_ratio <slowest cluster executor's clean + dedup seconds / local's>`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from tasks.data.clean import CleanConfig, clean_documents  # noqa: E402
from tasks.data.collect import CollectConfig, collect_documents  # noqa: E402
from tasks.data.dedup import DedupConfig  # noqa: E402
from tasks.data.dedup_datatrove import dedup_with_datatrove  # noqa: E402
from tasks.data.dedup_job import dedup_on_executor  # noqa: E402
from tasks.data.documents import DOCUMENTS_FILE  # noqa: E402
from tasks.data.executors import ExecutorSettings, connect_ray  # noqa: E402
from tasks.launch.local_slurm import LocalSlurmCluster  # noqa: E402

EXECUTORS = ("local", "slurm", "ray")
Step = Callable[[Path, ExecutorSettings], dict]


def configs(workers: int, max_docs: int | None) -> tuple[CollectConfig, CleanConfig, DedupConfig]:
    """The default run's collect, clean and dedup sections (relative paths resolve from the repository)."""
    default = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    collect = CollectConfig.model_validate(default["collect"] | {"max_docs_per_source": max_docs})
    clean = CleanConfig.model_validate(
        default["clean"] | {"num_workers": workers, "quality_training": None, "quality_top_fraction": None}
    )
    return collect, clean, DedupConfig.model_validate(default.get("dedup", {}) | {"num_workers": workers})


def timed(step: Step, out: Path, executor: ExecutorSettings) -> tuple[float, dict]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.perf_counter()
    stats = step(out, executor)
    return time.perf_counter() - started, stats


def counts(stats: dict) -> tuple:
    return stats["num_in"], stats["num_kept"], sorted(stats["removed"].items()), sorted(stats["quarantined"].items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="datatrove ranks (clean, datatrove dedup), CPUs of the fast dedup job")
    parser.add_argument("--max-docs-per-source", type=int, default=None, help="a slice of the corpus (default: all)")
    args = parser.parse_args()

    os.chdir(REPO)  # the configs' relative paths
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed benchmark still stops its Slurm daemons
    collect_cfg, clean_cfg, dedup_cfg = configs(args.workers, args.max_docs_per_source)
    with tempfile.TemporaryDirectory(prefix="kiln-scale-out-") as tmp:
        work = Path(tmp)
        (work / "collect").mkdir()
        collect_documents(collect_cfg, work / "collect")
        corpus = work / "collect" / DOCUMENTS_FILE
        cleaned = work / "reference-clean" / DOCUMENTS_FILE
        steps: dict[str, Step] = {
            "clean": lambda out, ex: clean_documents(clean_cfg, corpus, out, ex),
            "dedup": lambda out, ex: dedup_on_executor(dedup_cfg, cleaned, out, ex),
            "dedup datatrove": lambda out, ex: dedup_with_datatrove(dedup_cfg, cleaned, out, tasks=args.workers,
                                                                    executor=ex),
        }
        # Every executor's dedup reads the same cleaned corpus, so its timing is not the clean's.
        _, reference = timed(steps["clean"], cleaned.parent, ExecutorSettings())
        num_docs = {"clean": reference["num_in"], "dedup": reference["num_kept"],
                    "dedup datatrove": reference["num_kept"]}

        started = time.perf_counter()
        slurm = LocalSlurmCluster(work / "slurm").start()
        os.environ.update(slurm.env)
        slurm_start = time.perf_counter() - started
        started = time.perf_counter()
        connect_ray()  # no RAY_ADDRESS: a local cluster with this machine's CPUs
        ray_start = time.perf_counter() - started
        try:
            seconds: dict[tuple[str, str], list[float]] = {}
            results: dict[tuple[str, str], tuple] = {}
            for repeat in range(args.repeats):
                for executor in EXECUTORS:
                    for name, step in steps.items():
                        elapsed, stats = timed(step, work / f"{executor}-{name}-{repeat}".replace(" ", "_"),
                                               ExecutorSettings(executor))
                        print(f"repeat {repeat}: {name} on {executor}: {elapsed:.1f} s", file=sys.stderr, flush=True)
                        seconds.setdefault((executor, name), []).append(elapsed)
                        found = results.setdefault((executor, name), counts(stats))
                        assert found == counts(stats), (executor, name, found, counts(stats))
        finally:
            slurm.stop()

    for name in steps:
        mismatched = [e for e in EXECUTORS if results[(e, name)] != results[("local", name)]]
        assert not mismatched, f"{name}: {mismatched} kept or removed other documents than local"
    median = {key: statistics.median(values) for key, values in seconds.items()}
    print(f"corpus: {reference['num_in']} documents collected, {reference['num_kept']} after clean; "
          f"{args.workers} workers; medians of {args.repeats}; {os.cpu_count()} CPUs")
    print(f"engine start-up (once per cluster, not in the ratios): slurm {slurm_start:.1f} s, ray {ray_start:.1f} s")
    print(f"{'stage':<17}{'executor':<10}{'seconds':>9}{'docs/s':>9}{'x local':>9}")
    for name in steps:
        for executor in EXECUTORS:
            s = median[(executor, name)]
            print(f"{name:<17}{executor:<10}{s:>9.2f}{num_docs[name] / s:>9.1f}{s / median[('local', name)]:>9.2f}")
    totals = {e: median[(e, "clean")] + median[(e, "dedup")] for e in EXECUTORS}
    for executor in EXECUTORS:
        print(f"clean + dedup    {executor:<10}{totals[executor]:>9.2f} s  x local {totals[executor] / totals['local']:.2f}")
    print(f"RESULT executor_overhead_ratio {max(totals['slurm'], totals['ray']) / totals['local']:.2f}")


if __name__ == "__main__":
    main()
