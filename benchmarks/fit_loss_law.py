"""How long `fit_loss_law` takes on ~250 points, whether its shortcut finds the replication's optimum,
and how close it comes to Besiroglu et al. 2024's fit of Chinchilla's runs.

Points: synthetic, from the replication's law (Besiroglu et al. 2024, Table 1: E=1.82, A=482,
B=2085, α=0.348, β=0.366) over the range of Hoffmann et al.'s runs (N 5e7..1.6e10, D 2e8..4e11),
245 of them (their count), log-normal noise σ=0.01. With `--points-csv FILE` also the published
points themselves: Epoch AI's extraction of Hoffmann et al.'s Figure 4 (`svg_extracted_data.csv`
from github.com/Besiroglu/data, columns `Model Size`, `Training FLOP`, `loss`; D = FLOP / 6N).
It is not shipped with Kiln (no licence is stated); fetch it yourself to run that part.

- fit:       `fit_loss_law` with its defaults (grid screened, L-BFGS-B from the best 16 grid
             points, 200 bootstrap refits from the full-data optimum, 95% intervals). Median of
             `--repeats` runs on one core.
- full grid: the replication's search for the point estimate alone: L-BFGS-B from every one of
             the 4,500 grid points (`num_starts=4500, num_bootstrap=0`), run once. Its objective
             must match the screened fit's; its time is the baseline for the speed-up ratio.

Prints the recovered parameters and intervals; last line `RESULT fit_loss_law_seconds <median>`.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

# One core, as the target says, before numpy loads its thread pools.
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from kiln.tasks.scaling.laws import fit_loss_law  # noqa: E402

BESIROGLU = {"E": 1.82, "A": 482.0, "B": 2085.0, "alpha": 0.348, "beta": 0.366}
HOFFMANN = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}  # as published in 2022


def synthetic(num_points: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = 10 ** rng.uniform(np.log10(5e7), np.log10(1.6e10), num_points)
    d = 10 ** rng.uniform(np.log10(2e8), np.log10(4e11), num_points)
    t = BESIROGLU
    loss = t["E"] + t["A"] / n ** t["alpha"] + t["B"] / d ** t["beta"]
    return n, d, loss * np.exp(rng.normal(0, 0.01, num_points))


def published_points(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("Model Size") and r.get("Training FLOP") and r.get("loss")]
    n = np.array([float(r["Model Size"]) for r in rows])
    flops = np.array([float(r["Training FLOP"]) for r in rows])
    return n, flops / (6 * n), np.array([float(r["loss"]) for r in rows])


def report(fit, reference: dict[str, float], label: str) -> None:
    print(f"{'param':>6} {label:>10} {'fit':>9}  {fit.level:.0%} interval")
    for name, value in reference.items():
        low, high = fit.intervals[name]
        print(f"{name:>6} {value:10.3f} {getattr(fit, name):9.3f}  [{low:.3f}, {high:.3f}]")
    print(f"rmse of log residuals {fit.rmse_log:.4f}; warnings: {list(fit.warnings) or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Expected duration: under a minute with --skip-full-grid, about 1-2 minutes "
                                            "with the full-grid baseline (~20 s per repeat).")
    parser.add_argument("--points", type=int, default=245, help="synthetic points to fit (default: 245)")
    parser.add_argument("--repeats", type=int, default=3, help="timed fits of each method; medians (default: 3)")
    parser.add_argument("--skip-full-grid", action="store_true", help="skip the full-grid baseline (~20 s)")
    parser.add_argument("--points-csv", type=Path, help="Epoch AI's svg_extracted_data.csv: fit the published points (default: none)")
    args = parser.parse_args()
    n, d, loss = synthetic(args.points, seed=0)

    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        fit = fit_loss_law(n, d, loss)
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    print(f"synthetic: {args.points} points from the replication's law, {fit.num_bootstrap} bootstrap refits: "
          f"{', '.join(f'{t:.2f}' for t in times)} s (median {median:.2f} s)")
    report(fit, BESIROGLU, "truth")

    if not args.skip_full_grid:
        started = time.perf_counter()
        point_only = fit_loss_law(n, d, loss, num_bootstrap=0)
        screened = time.perf_counter() - started
        started = time.perf_counter()
        full = fit_loss_law(n, d, loss, num_starts=4500, num_bootstrap=0)
        full_grid = time.perf_counter() - started
        same = all(abs(getattr(full, k) - getattr(point_only, k)) <= 1e-4 * max(1.0, abs(getattr(full, k)))
                   for k in BESIROGLU)
        print(f"point estimate: screened grid {screened:.2f} s, full grid {full_grid:.2f} s "
              f"(speed-up {full_grid / screened:.0f}x), same optimum: {same}")

    if args.points_csv:
        pn, pd, pl = published_points(args.points_csv)
        started = time.perf_counter()
        published = fit_loss_law(pn, pd, pl)
        print(f"\npublished points ({len(pn)} runs of Hoffmann et al., extracted by Epoch AI): "
              f"{time.perf_counter() - started:.2f} s")
        report(published, BESIROGLU, "Besiroglu")
        print("Hoffmann et al. 2022 reported " + ", ".join(f"{k}={v}" for k, v in HOFFMANN.items()))
    print(f"RESULT fit_loss_law_seconds {median:.3f}")


if __name__ == "__main__":
    main()
