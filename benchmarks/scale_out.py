"""What a cluster executor costs on one machine: the data half on the local, Slurm and Ray executors.

Collects the bundled corpus once (the default run's sources), and grows it ×16 as
`benchmarks/data_scale.py` does (perturbed copies). Then, at each size and on each executor, runs
the stages that run on `cluster.executor` — clean (a datatrove task per shard), dedup (signatures,
then writing, a task per shard each), decontaminate and tokenize (a task per shard) — with the
default run's settings and `--workers` tasks at a time, in fresh folders, `--repeats` times. The
Slurm cluster is a real single-node one started here (`tasks.launch.local_slurm`), Ray a local
cluster started here; their start-up is printed apart, as it is paid once per cluster, not per
stage. Every executor's outputs are checked against the local ones (the same counts, the same
shards byte for byte).

The fixed cost of a job on each executor is measured with a job of one rank that does nothing
(median of `--repeats`); a data half runs five such jobs, so at ×1 (seconds of work per stage)
they are most of a cluster's extra time, and at ×16 they should not be.

The clean settings are the default run's, with the shipped quality model instead of one trained
from references (training happens before the executor runs, identically for each).

Prints seconds and documents/s for each stage (medians) and the ratio to local; last line
`RESULT executor_overhead_ratio_16x <slowest cluster executor's data-half seconds / local's, at ×16>`.
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

from benchmarks.data_scale import grow  # noqa: E402
from kiln.tasks.data.clean import CleanConfig, clean_documents  # noqa: E402
from kiln.tasks.data.collect import CollectConfig, collect_documents  # noqa: E402
from kiln.tasks.data.decontaminate import DecontaminateConfig, decontaminate_documents  # noqa: E402
from kiln.tasks.data.dedup import DedupConfig  # noqa: E402
from kiln.tasks.data.dedup_job import dedup_documents  # noqa: E402
from kiln.tasks.data.executors import RANKS_DIR, ExecutorSettings, connect_ray, map_shards, rank_ledger  # noqa: E402
from kiln.tasks.data.shards import KINDS, shard_paths  # noqa: E402
from kiln.tasks.data.tokenize import TokenizeConfig, tokenize_corpus  # noqa: E402
from kiln.tasks.launch.local_slurm import LocalSlurmCluster  # noqa: E402

EXECUTORS = ("local", "slurm", "ray")
STAGES = ("clean", "dedup", "decontaminate", "tokenize")
EVAL_FILES = [REPO / "data/evals/heldout.jsonl", REPO / "data/evals/heldout_code.jsonl"]
Step = Callable[[Path, Path, ExecutorSettings], dict]


def configs(workers: int) -> dict[str, object]:
    """The default run's collect and data-stage sections (relative paths resolve from the repository)."""
    default = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    workers_of = {"num_workers": workers}
    return {
        "default": default,
        "collect": CollectConfig.model_validate(default["collect"]),
        "clean": CleanConfig.model_validate(default["clean"] | workers_of | {"quality_training": None,
                                                                               "quality_top_fraction": None}),
        "dedup": DedupConfig.model_validate(default["dedup"] | workers_of),
        "decontaminate": DecontaminateConfig.model_validate(default["decontaminate"] | workers_of),
        "tokenize": TokenizeConfig.model_validate(default["tokenize"] | workers_of),
    }


def steps(cfg: dict) -> dict[str, Step]:
    """Each stage's work: (its input stage's folder, its own folder, executor) -> stats."""
    return {
        "clean": lambda src, out, ex: clean_documents(cfg["clean"], src, out, ex),
        "dedup": lambda src, out, ex: dedup_documents(cfg["dedup"], shard_paths(src), out, ex),
        "decontaminate": lambda src, out, ex: decontaminate_documents(cfg["decontaminate"], shard_paths(src),
                                                                      EVAL_FILES, out, executor=ex),
        "tokenize": lambda src, out, ex: tokenize_corpus(cfg["tokenize"], src, out, ex),
    }


def data_half(cfg: dict, collected: Path, root: Path, executor: ExecutorSettings) -> dict[str, tuple[float, dict]]:
    """(seconds, stats) of each stage, each reading the one before."""
    shutil.rmtree(root, ignore_errors=True)
    results, source = {}, collected
    for name, step in steps(cfg).items():
        out = root / name
        out.mkdir(parents=True)
        started = time.perf_counter()
        stats = step(source, out, executor)
        results[name] = (time.perf_counter() - started, stats)
        source = out
    return results


def _nothing(rank: int) -> dict:
    return {}


def fixed_cost(work: Path, executor: ExecutorSettings) -> float:
    """Seconds of a job of one rank that does nothing."""
    shutil.rmtree(work, ignore_errors=True)
    started = time.perf_counter()
    ledger = rank_ledger(work / RANKS_DIR, "kiln_nothing", {}, [{}])  # the folder is new: the rank runs
    map_shards(_nothing, work, ledger, settings=executor, jobs=1, job_name="kiln_nothing")
    return time.perf_counter() - started


def made(stats: dict) -> dict:
    """What a stage made, without how it ran."""
    return {key: value for key, value in stats.items() if key != "executor_cpu_s"}


def outputs(root: Path) -> dict[str, bytes]:
    """Every shard of every stage, and tokenize's token shards, by relative path."""
    files = {}
    for stage in STAGES:
        for kind in KINDS:
            for path in sorted((root / stage / kind).glob("*")) if (root / stage / kind).is_dir() else ():
                files[f"{stage}/{kind}/{path.name}"] = path.read_bytes()
    for path in sorted((root / "tokenize" / "shards").rglob("*.bin")):
        files[path.relative_to(root).as_posix()] = path.read_bytes()
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Expected duration: about 40 minutes with the defaults on 2 busy cores (x16 took "
                                            "450-735 s per executor at load 4-37), a few minutes with --sizes 1.")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each size on each executor (default: 1)")
    parser.add_argument("--workers", type=int, default=2, help="tasks at a time, on every executor (default: 2)")
    parser.add_argument("--sizes", default="1,16", help="corpus factors (16 gives the RESULT) (default: 1,16)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    os.chdir(REPO)  # the configs' relative paths
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed benchmark still stops its Slurm daemons
    cfg = configs(args.workers)
    with tempfile.TemporaryDirectory(prefix="kiln-scale-out-") as tmp:
        work = Path(tmp)
        (work / "sample").mkdir()
        collect_documents(cfg["collect"], work / "sample")
        corpora = {}
        for size in sizes:
            corpora[size] = work / f"collect-x{size}"
            corpora[size].mkdir()
            grown = grow(work / "sample", size, work / f"grown-x{size}") if size > 1 else []
            sources = cfg["default"]["collect"]["sources"] + grown
            collect_documents(CollectConfig.model_validate(cfg["default"]["collect"] | {"sources": sources}),
                              corpora[size])

        started = time.perf_counter()
        slurm = LocalSlurmCluster(work / "slurm").start()
        os.environ.update(slurm.env)
        slurm_start = time.perf_counter() - started
        started = time.perf_counter()
        connect_ray()  # no RAY_ADDRESS: a local cluster with this machine's CPUs
        ray_start = time.perf_counter() - started
        seconds: dict[tuple[int, str, str], list[float]] = {}
        fixed: dict[str, list[float]] = {}
        reference: dict[int, tuple[dict, dict]] = {}
        num_docs: dict[tuple[int, str], int] = {}
        try:
            for repeat in range(args.repeats):
                for executor in EXECUTORS:
                    settings = ExecutorSettings(executor)
                    fixed.setdefault(executor, []).append(fixed_cost(work / f"nothing-{executor}", settings))
                    for size in sizes:
                        root = work / f"{executor}-x{size}"
                        results = data_half(cfg, corpora[size], root, settings)
                        for stage, (elapsed, stats) in results.items():
                            seconds.setdefault((size, executor, stage), []).append(elapsed)
                            num_docs[(size, stage)] = stats["num_in"]
                        print(f"repeat {repeat}: x{size} on {executor}: "
                              + ", ".join(f"{s} {t:.1f} s" for s, (t, _) in results.items())
                              + f"; load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
                        found = ({s: made(st) for s, (_, st) in results.items()}, outputs(root))
                        expected = reference.setdefault(size, found)
                        assert found[0] == expected[0], f"x{size} on {executor}: other counts than local"
                        assert found[1] == expected[1], f"x{size} on {executor}: other shards than local"
        finally:
            slurm.stop()

    median = {key: statistics.median(values) for key, values in seconds.items()}
    collected = ", ".join(f"x{size} {num_docs[(size, 'clean')]}" for size in sizes)
    print(f"corpus sizes {sizes} (documents collected: {collected}); "
          f"{args.workers} tasks at a time; medians of {args.repeats}; {os.cpu_count()} CPUs; "
          f"load average now {os.getloadavg()[0]:.1f}")
    print(f"engine start-up (once per cluster, not in the ratios): slurm {slurm_start:.1f} s, ray {ray_start:.1f} s")
    print("fixed cost of a job (one rank doing nothing): "
          + ", ".join(f"{e} {statistics.median(v):.2f} s" for e, v in fixed.items()))
    print(f"{'size':<6}{'stage':<15}{'executor':<10}{'seconds':>9}{'docs/s':>9}{'x local':>9}")
    totals: dict[tuple[int, str], float] = {}
    for size in sizes:
        for stage in STAGES:
            for executor in EXECUTORS:
                s = median[(size, executor, stage)]
                totals[(size, executor)] = totals.get((size, executor), 0.0) + s
                print(f"x{size:<5}{stage:<15}{executor:<10}{s:>9.2f}{num_docs[(size, stage)] / s:>9.1f}"
                      f"{s / median[(size, 'local', stage)]:>9.2f}")
        for executor in EXECUTORS:
            print(f"x{size:<5}{'data half':<15}{executor:<10}{totals[(size, executor)]:>9.2f}"
                  f"{num_docs[(size, 'clean')] / totals[(size, executor)]:>9.1f}"
                  f"{totals[(size, executor)] / totals[(size, 'local')]:>9.2f}")
    if 16 in sizes:
        worst = max(totals[(16, "slurm")], totals[(16, "ray")]) / totals[(16, "local")]
        print(f"RESULT executor_overhead_ratio_16x {worst:.2f}")


if __name__ == "__main__":
    main()
