"""`make bench`: the hot-path benchmarks at a small size, one table of their ratios, with the machine's load.

Runs, one after another, each in its own process (each prints its own report to the log and `RESULT`
lines, collected here):
- `benchmarks/dedup.py --repeats 3`: the whole dedup stage against datasketch and rensa (rensa's row
  only where it is installed: a benchmark-only dependency), medians of 3;
- `benchmarks/clean_overhead.py --repeats 3`: Kiln's clean against the same filters as a plain
  datatrove pipeline (Kiln's seconds / datatrove's: the issue sets no goal; lower is better);
- `benchmarks/train_step.py --steps 10 --compile`: the training step against nanoGPT's, eager and compiled;
- `benchmarks/data_scale.py --sizes 1,2 --workers-size 0`: the data half at x1 and x2 (the README's
  ×16 run takes an hour; this is its smoke-sized version).

Prints one table (ratio, goal, whether met, seconds, load average before and after each) and the load
averages of the whole run. The machine is shared: a ratio under load is a ratio under load, and the
README says which load each quoted number had. Each benchmark's full output goes to `--log`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# (script and arguments, timeout in seconds, {RESULT name: (goal, "min" or "max")})
BENCHMARKS = [
    (["dedup.py", "--repeats", "3"], 240, {
        "dedup_stage_speedup": (5.0, "min"), "dedup_stage_speedup_vs_rensa": (1.3, "min"),
        "dedup_signature_path_speedup": (None, "min")}),
    (["clean_overhead.py", "--repeats", "3"], 180, {"clean_overhead_ratio": (None, "max")}),
    (["train_step.py", "--steps", "10", "--compile"], 150, {
        "train_tokens_per_s_ratio": (1.0, "min"), "train_compiled_vs_nanogpt_eager_ratio": (1.2, "min"),
        "train_compiled_ceiling_vs_nanogpt_eager": (None, "min"), "train_compiled_ratio": (None, "min")}),
    (["data_scale.py", "--sizes", "1,2", "--workers-size", "0"], 240, {
        "data_peak_rss_growth_2x": (1.3, "max"), "data_driver_peak_rss_growth_2x": (1.3, "max"),
        "data_docs_per_s_2x_vs_1x": (0.85, "min")}),
]


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Expected duration: about 4 minutes on 2 cores (190 s measured at load average 0.6-2).")
    parser.add_argument("--log", type=Path, default=REPO / "kiln-work" / "bench.log",
                        help="where each benchmark's full output goes (default: kiln-work/bench.log)")
    parser.add_argument("--only", help="run only the benchmarks whose script name contains this (default: all)")
    args = parser.parse_args()
    args.log.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    started, load_before = time.perf_counter(), load()
    with args.log.open("w") as log:
        for argv, timeout, goals in BENCHMARKS:
            if args.only and args.only not in argv[0]:
                continue
            before, clock = load(), time.perf_counter()
            print(f"running {' '.join(argv)} (load {before}) ...", file=sys.stderr, flush=True)
            try:
                done = subprocess.run([sys.executable, str(REPO / "benchmarks" / argv[0]), *argv[1:]], cwd=REPO,
                                      capture_output=True, text=True, timeout=timeout)
                output, status = done.stdout + done.stderr, "" if done.returncode == 0 else f"exit {done.returncode}"
            except subprocess.TimeoutExpired as expired:
                output = (expired.stdout or b"").decode() + (expired.stderr or b"").decode()
                status = f"timed out after {timeout} s"
            seconds = time.perf_counter() - clock
            log.write(f"===== {' '.join(argv)}: {status or 'ok'}, {seconds:.0f} s\n{output}\n")
            log.flush()
            results = {line.split()[1]: float(line.split()[2]) for line in output.splitlines()
                       if line.startswith("RESULT ") and len(line.split()) == 3}
            for name, (goal, sense) in goals.items():
                value = results.get(name)
                met = ("" if goal is None or value is None else
                       "yes" if (value >= goal if sense == "min" else value <= goal) else "NO")
                rows.append((name, value, goal, sense, met, seconds, before, load(), status))
    print(f"make bench: {time.perf_counter() - started:.0f} s, load average (1/5/15 min) {load_before} before, "
          f"{load()} after; {os.cpu_count()} CPUs; full output in {args.log}")
    print(f"{'ratio':<40}{'value':>8}{'goal':>9}{'met':>5}{'seconds':>9}   load before -> after")
    for name, value, goal, sense, met, seconds, before, after, status in rows:
        shown = "-" if value is None else f"{value:.2f}"
        target = "" if goal is None else (">=" if sense == "min" else "<=") + f"{goal:g}"
        print(f"{name:<40}{shown:>8}{target:>9}{met:>5}{seconds:>9.0f}   {before} -> {after}"
              + (f"   ({status})" if status else ""))


if __name__ == "__main__":
    main()
