"""The parallelism planner against torch's own memory accounting, on Llama 3 8B, 70B and 405B.

For each model the planner picks its layout on a cluster just large enough for it (8B on one
8 x H100 node, 70B on eight, 405B on sixty-four: worlds 8, 64 and 512, with `kiln plan`'s defaults:
the whole 8192-token context, 4M-token global batches, bf16-mixed), then `tasks.train.verify`
builds that layout for real in this one process on torch's fake process group (any world size)
and fake tensors, and runs one training step under torch's MemTracker: the first and the last
pipeline rank, deep models' steps measured at a few blocks per stage and extended by the
per-block increment (checked equal to the byte). The baseline is torch's measurement; the
figures are the planner's relative errors against it.

Prints each model's side-by-side table, then
`RESULT planner_param_bytes_max_rel_err <x>` (parameter, gradient and optimizer bytes, over every
rank checked) and, last, `RESULT planner_peak_memory_max_rel_err <y>` (the step's peak).

    python benchmarks/plan_vs_torch.py                 # all three (minutes on 2 cores)
    python benchmarks/plan_vs_torch.py --models 8b     # one
"""

from __future__ import annotations

import argparse
import time

from kiln.tasks.train.planner import plan_presets, render_plan_report
from kiln.tasks.train.verify import render_verification, verify_plan

CLUSTERS = {"8b": "h100-1node", "70b": "h100-8nodes", "405b": "h100-64nodes"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Expected duration: a few minutes on CPU (one fake-tensor training step per "
                                            "model and pipeline rank; 405B's takes the longest).")
    parser.add_argument("--models", nargs="+", choices=sorted(CLUSTERS), default=list(CLUSTERS),
                        help="the Llama 3 sizes to check (default: all three)")
    args = parser.parse_args(argv)
    bytes_errors, peak_errors = [], []
    for model in args.models:
        started = time.perf_counter()
        search = plan_presets(model, CLUSTERS[model])
        print(f"== {model} on {CLUSTERS[model]} ==")
        print(render_plan_report(search).split("\nRunners-up:")[0])
        verification = verify_plan(search)
        print(render_verification(verification))
        bytes_errors += [verification.max_error(kind) for kind in ("params", "grads", "optimizer")]
        peak_errors.append(verification.max_error("peak"))
        print(f"{model}: planned and verified in {time.perf_counter() - started:.0f} s, peak error "
              f"{verification.max_error('peak'):.2%}\n", flush=True)
    print(f"RESULT planner_param_bytes_max_rel_err {max(bytes_errors):.4g}")
    print(f"RESULT planner_peak_memory_max_rel_err {max(peak_errors):.4g}")


if __name__ == "__main__":
    main()
