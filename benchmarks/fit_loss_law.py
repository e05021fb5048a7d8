"""How long `fit_loss_law` takes on 250 points, and whether its shortcut finds the same optimum.

The published points of the Chinchilla replication (Epoch AI's `svg_extracted_data.csv`) were not
obtainable offline, so the points are synthetic: Hoffmann et al.'s law (E=1.69, A=406.4, B=410.7,
α=0.34, β=0.28), N log-uniform over 1e7..1e10, D over 1e9..1e12, log-normal noise σ=0.01.

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

from tasks.scaling.laws import fit_loss_law  # noqa: E402

TRUTH = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}


def synthetic(num_points: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = 10 ** rng.uniform(7, 10, num_points)
    d = 10 ** rng.uniform(9, 12, num_points)
    loss = TRUTH["E"] + TRUTH["A"] / n ** TRUTH["alpha"] + TRUTH["B"] / d ** TRUTH["beta"]
    return n, d, loss * np.exp(rng.normal(0, 0.01, num_points))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=250)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-full-grid", action="store_true", help="skip the ~20 s full-grid baseline")
    args = parser.parse_args()
    n, d, loss = synthetic(args.points, seed=0)

    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        fit = fit_loss_law(n, d, loss)
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    print(f"{args.points} points, {fit.num_bootstrap} bootstrap refits: "
          f"{', '.join(f'{t:.2f}' for t in times)} s (median {median:.2f} s)")
    print(f"{'param':>6} {'truth':>8} {'fit':>9}  {fit.level:.0%} interval")
    for name, value in TRUTH.items():
        low, high = fit.intervals[name]
        print(f"{name:>6} {value:8.3f} {getattr(fit, name):9.3f}  [{low:.3f}, {high:.3f}]")
    print(f"rmse of log residuals {fit.rmse_log:.4f} (noise σ 0.01); warnings: {list(fit.warnings) or 'none'}")

    if not args.skip_full_grid:
        started = time.perf_counter()
        point_only = fit_loss_law(n, d, loss, num_bootstrap=0)
        screened = time.perf_counter() - started
        started = time.perf_counter()
        full = fit_loss_law(n, d, loss, num_starts=4500, num_bootstrap=0)
        full_grid = time.perf_counter() - started
        same = all(abs(getattr(full, k) - getattr(point_only, k)) <= 1e-4 * max(1.0, abs(getattr(full, k)))
                   for k in TRUTH)
        print(f"point estimate: screened grid {screened:.2f} s, full grid {full_grid:.2f} s "
              f"(speed-up {full_grid / screened:.0f}x), same optimum: {same}")
    print(f"RESULT fit_loss_law_seconds {median:.3f}")


if __name__ == "__main__":
    main()
