"""How much a cached rerun saves: the tiny pipeline cold, then again with every stage cached.

Runs `kiln run` twice in fresh processes (so Prefect's start-up is paid both times, as a user
pays it) in a temporary working directory, repeats `--repeats` times, and prints medians and
the ratio. Last line: `RESULT pipeline_cached_rerun_speedup <cold / cached>`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def timed_run(config: str, work_dir: Path) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "flows.cli", "run", config, f"work_dir={work_dir}"], cwd=REPO,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    cold, cached = [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            cold.append(timed_run(args.config, Path(tmp)))
            cached.append(timed_run(args.config, Path(tmp)))
    print(f"config {args.config}, {args.repeats} repeat(s)")
    print(f"cold run      median {statistics.median(cold):7.1f}s  {cold}")
    print(f"cached rerun  median {statistics.median(cached):7.1f}s  {cached}")
    print(f"RESULT pipeline_cached_rerun_speedup {statistics.median(cold) / statistics.median(cached):.2f}")


if __name__ == "__main__":
    main()
