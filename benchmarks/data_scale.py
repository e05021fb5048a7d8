"""The data half at growing corpus sizes: throughput and memory of collect → tokenize at ×1, ×4 and ×16.

The corpus is the bundled sample (the default run's sources) grown ×k: collected once, then every
kept document copied k - 1 times into jsonl sources beside the sample's own, each copy perturbed at
seeded positions: one copy in four with 1 % of its words replaced (a near duplicate, which dedup
removes), the others with 15 % (new text for every later stage, as more crawl would be). Each size
runs the data half of the default config (`tasks.runner.run_pipeline(..., until="tokenize")`, the
stages as `kiln run` runs them, without Prefect and MLflow) in a fresh process, in a fresh store.

Per run: documents collected per second of the whole data half, and the peak memory of the whole
run: every process of it (the driver, datatrove's worker processes, the quality classifier's
trainer) sampled every 0.25 s, their proportional set sizes (PSS: shared pages split between the
processes sharing them) summed; and apart, the driver's own peak and the workers' (summed) peak.
`--sizes 1,4,16,64` runs the issue's ×64 (hours on 2 cores); `--stage collect --sizes 1,64` runs
collect alone (minutes), whose reading runs as executor tasks and whose driver must stay flat.

Prints a table (per size: the whole peak, the driver's and the workers'), then for the largest size k
(and ×16 if run) `RESULT data_driver_peak_rss_growth_kx` (the driver's peak ×k / ×1; goal ≤ 1.3),
`RESULT data_workers_peak_rss_growth_kx`, `RESULT data_peak_rss_growth_kx` (the whole run's; goal ≤ 1.3)
and, last, `RESULT data_docs_per_s_kx_vs_1x` (goal ≥ 0.85). Medians over `--repeats`. Then ×4 again
with every data stage's `num_workers` at 1 against 2 (`--workers-size`).
The machine's load average is printed with each run: others' work slows it, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from kiln.tasks.data.collect import CollectConfig, collect_documents  # noqa: E402
from kiln.tasks.data.documents import read_shards  # noqa: E402
from kiln.tasks.data.shards import shard_paths  # noqa: E402

SIZES = (1, 4, 16)
NEAR, NEW = 0.01, 0.15  # shares of words replaced: a near duplicate, new text
DATA_STAGES_WITH_WORKERS = ("collect", "clean", "dedup", "decontaminate", "tokenize")
_RUN = """
import json, sys, time
from kiln.tasks.config import load_config
from kiln.tasks.runner import run_pipeline
from kiln.tasks.store import Store
cfg = load_config(sys.argv[1])
started = time.perf_counter()
outcomes = run_pipeline(cfg, until=sys.argv[2])
wall = time.perf_counter() - started
store = Store(cfg.store_root)
stats = {o.stage: store.manifest(o.stage, o.key)["stats"] for o in outcomes}
print(json.dumps({"wall_s": wall, "stage_s": {o.stage: o.wall_s for o in outcomes},
                  "num_in": stats["collect"]["num_in"], "num_tokens": stats.get("tokenize", {}).get("num_tokens", 0),
                  "kept": {s: stats[s]["num_kept"] for s in stats}}))
"""


def perturbed(text: str, share: float, rng: random.Random) -> str:
    """`text` with `share` of its words replaced by other words of it, its layout (lines, spaces) kept."""
    words = list(re.finditer(r"\S+", text))
    if len(words) < 2:
        return text + f" {rng.randrange(10**6)}"
    pieces, last = [], 0
    chosen = set(rng.sample(range(len(words)), max(1, round(share * len(words)))))
    for i, match in enumerate(words):
        pieces.append(text[last : match.start()])
        pieces.append(words[rng.randrange(len(words))].group() if i in chosen else match.group())
        last = match.end()
    pieces.append(text[last:])
    return "".join(pieces)


def grow(collected: Path, factor: int, folder: Path) -> list[dict]:
    """jsonl sources (one per domain) of `factor` - 1 perturbed copies of every collected document."""
    folder.mkdir(parents=True)
    handles: dict[str, object] = {}
    for doc in read_shards(shard_paths(collected)):
        for copy in range(1, factor):
            rng = random.Random(f"{doc.id}/{copy}")
            text = perturbed(doc.text, NEAR if copy % 4 == 0 else NEW, rng)
            if doc.domain not in handles:
                handles[doc.domain] = open(folder / f"{doc.domain}.jsonl", "w", encoding="utf-8")
            handles[doc.domain].write(json.dumps({"id": f"{doc.id}~{copy}", "text": text, "licence": doc.licence,
                                                  "metadata": doc.metadata}, ensure_ascii=False) + "\n")
    for handle in handles.values():
        handle.close()
    return [{"name": f"grown-{domain}", "path": str(folder / f"{domain}.jsonl"), "format": "jsonl", "domain": domain}
            for domain in sorted(handles)]


def config(default: dict, work: Path, extra_sources: list[dict], workers: int | None) -> Path:
    cfg = json.loads(json.dumps(default))
    cfg["work_dir"] = str(work)
    cfg["collect"]["sources"] = cfg["collect"]["sources"] + extra_sources
    if workers is not None:
        for stage in DATA_STAGES_WITH_WORKERS:
            cfg.setdefault(stage, {})["num_workers"] = workers
    path = work.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


class TreeMemory:
    """The peak, over samples, of the summed PSS of a process and all its descendants; and apart, the peak
    of the process itself (the driver: what must not grow with the corpus) and of its descendants together
    (the workers: datatrove's processes, the quality classifier's trainer)."""

    def __init__(self, pid: int, interval_s: float = 0.25):
        self.root, self.interval_s = psutil.Process(pid), interval_s
        self.peak_mb = self.driver_peak_mb = self.workers_peak_mb = 0.0
        self.peak_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            total, driver, count = 0, 0, 0
            try:
                processes = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for process in processes:
                try:
                    pss = process.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                total += pss
                count += 1
                driver += pss if process is self.root else 0
            self.driver_peak_mb = max(self.driver_peak_mb, driver / 2**20)
            self.workers_peak_mb = max(self.workers_peak_mb, (total - driver) / 2**20)
            if total / 2**20 > self.peak_mb:
                self.peak_mb, self.peak_processes = total / 2**20, count
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run(cfg_path: Path, until: str) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    load = os.getloadavg()[0]
    child = subprocess.Popen([sys.executable, "-c", _RUN, str(cfg_path), until], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    memory = TreeMemory(child.pid)
    out, err = child.communicate()
    memory.stop()
    if child.returncode != 0:
        raise SystemExit(f"the data half failed (exit {child.returncode}):\n{err[-4000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    return result | {"peak_mb": memory.peak_mb, "driver_peak_mb": memory.driver_peak_mb,
                     "workers_peak_mb": memory.workers_peak_mb, "processes": memory.peak_processes,
                     "load": (load + os.getloadavg()[0]) / 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Expected duration: about 30 minutes with the defaults on 2 busy cores (x1 165 s, "
                                            "x4 480 s, x16 1050 s measured at load average ~10), longer with --repeats.")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each size; medians (default: 1)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="corpus factors (1 and 16 give the RESULTs) (default: 1,4,16)")
    parser.add_argument("--workers-size", type=int, default=4,
                        help="the size that runs with 1 and 2 workers (0: no such runs) (default: 4)")
    parser.add_argument("--stage", default="tokenize", choices=("collect", "clean", "dedup", "decontaminate", "tokenize"),
                        help="the last stage run (collect: collect alone, minutes at x64) (default: tokenize)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    os.chdir(REPO)  # the default config's relative paths
    default = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    with tempfile.TemporaryDirectory(prefix="kiln-data-scale-") as tmp:
        root = Path(tmp)
        (root / "sample").mkdir()
        collect_documents(CollectConfig.model_validate(default["collect"]), root / "sample")
        sources = {k: grow(root / "sample", k, root / f"grown-{k}") if k > 1 else []
                   for k in {*sizes, args.workers_size} - {0}}
        results: dict[tuple[int, int | None], list[dict]] = {}
        cases = [(k, None) for k in sizes] + ([(args.workers_size, 1), (args.workers_size, 2)] if args.workers_size else [])
        for repeat in range(args.repeats):
            for size, workers in cases:
                name = f"x{size}-w{workers or 'default'}-{repeat}"
                result = run(config(default, root / name, sources[size], workers), args.stage)
                results.setdefault((size, workers), []).append(result)
                print(f"{name}: {result['num_in']} docs in {result['wall_s']:.1f} s "
                      f"({result['num_in'] / result['wall_s']:.1f} docs/s), peak {result['peak_mb']:.0f} MiB over "
                      f"{result['processes']} processes, load {result['load']:.1f}; stages "
                      + ", ".join(f"{s} {t:.1f}" for s, t in result["stage_s"].items()), file=sys.stderr, flush=True)

    def median(case: tuple[int, int | None], key: str) -> float:
        values = results[case]
        return statistics.median(v["num_in"] / v["wall_s"] if key == "docs_per_s" else v[key] for v in values)

    title = "collect alone" if args.stage == "collect" else f"data half (collect → {args.stage})"
    print(f"{title}, medians of {args.repeats}; {os.cpu_count()} CPUs; "
          f"mean load average during the runs {statistics.mean(v['load'] for vs in results.values() for v in vs):.1f}")
    print(f"{'corpus':<8}{'workers':<9}{'docs':>8}{'tokens':>11}{'seconds':>9}{'docs/s':>9}{'peak MiB':>10}"
          f"{'driver':>8}{'workers':>9}")
    for (size, workers), values in results.items():
        first = values[0]
        print(f"x{size:<7}{workers or 'default':<9}{first['num_in']:>8}{first['num_tokens']:>11}"
              f"{median((size, workers), 'wall_s'):>9.1f}{median((size, workers), 'docs_per_s'):>9.1f}"
              f"{median((size, workers), 'peak_mb'):>10.0f}{median((size, workers), 'driver_peak_mb'):>8.0f}"
              f"{median((size, workers), 'workers_peak_mb'):>9.0f}")
    if args.workers_size:
        w1, w2 = median((args.workers_size, 1), "docs_per_s"), median((args.workers_size, 2), "docs_per_s")
        print(f"x{args.workers_size}: 2 workers / 1 worker = {w2 / w1:.2f} in docs/s")
    top = max(sizes)
    for k in sorted({top, 16} & set(sizes) - {1}) if 1 in sizes else ():  # the largest size's, and x16's
        print(f"RESULT data_driver_peak_rss_growth_{k}x "
              f"{median((k, None), 'driver_peak_mb') / median((1, None), 'driver_peak_mb'):.2f}")
        print(f"RESULT data_workers_peak_rss_growth_{k}x "
              f"{median((k, None), 'workers_peak_mb') / max(median((1, None), 'workers_peak_mb'), 1e-9):.2f}")
        print(f"RESULT data_peak_rss_growth_{k}x {median((k, None), 'peak_mb') / median((1, None), 'peak_mb'):.2f}")
        print(f"RESULT data_docs_per_s_{k}x_vs_1x {median((k, None), 'docs_per_s') / median((1, None), 'docs_per_s'):.2f}")

if __name__ == "__main__":
    main()
