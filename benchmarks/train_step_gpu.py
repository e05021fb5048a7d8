"""GPU training-step MFU: Kiln's ~1B model and train step on one H100/H200, against the chip's peak.

Target: MFU >= 0.45 on an H100 or H200 (1b preset with grouped-query attention, 4 query heads per
K/V head; vocab 32000, seq 2048, bf16-mixed, torch.compile, no activation checkpointing).

What runs is the production step as a bf16-mixed multi-GPU layout runs it on each rank: the model
built on the meta device, sharded by FSDP2 with `MixedPrecisionPolicy(param bf16, reduce fp32)`
over a one-rank mesh (`Layout.build`, exactly as `tasks.train.parallel` builds every layout;
a one-process training run would instead use autocast), materialised and initialised on the GPU,
then `tasks.train.loop.train_step`: bf16 forward, fp32 cross-entropy, backward with fp32
gradient reduction, gradient clipping and fused AdamW on the fp32 master shards (`make_optimizer`).
`run.compile` compiles block by block, as the loop does for a sharded model; activation
checkpointing and compile fail together in backward with torch 2.13, so the script refuses that
combination. Random token batches already on the device stand in for data, so data loading is
not timed.

The micro-batch is `--batch`, or else the largest power of two whose step fits in memory, found by
doubling until CUDA runs out of memory. The search runs eagerly: a compiled model would recompile
(a minute or more at 1B) for every new shape, and inductor's fused graph keeps no more activations
than eager mode does, so a size that fits eagerly fits compiled.

Steps are timed with CUDA events after `--warmup` steps (which absorb compilation); the median is
reported. FLOPs per token come from `tasks.train.model.flops_per_token`: 6N plus the attention
term 12 L d T (scores and values over the full T x T matrix, as PaLM and nanoGPT count it; the
causal mask is not discounted). Recomputation under activation checkpointing is not counted, as
MFU counts model FLOPs only. MFU divides achieved FLOP/s by the device's dense bf16 peak, looked up
from `torch.cuda.get_device_name()` or given with `--peak-tflops`.

Without CUDA the script refuses to run, except as `--device cpu --preset tiny`: the same code path
on a gloo one-rank mesh, for tests (its MFU is NaN unless `--peak-tflops` is given).
Last line: `RESULT train_mfu <fraction>`.

    python benchmarks/train_step_gpu.py                      # 1b with 4:1 GQA, batch search, compiled
    python benchmarks/train_step_gpu.py --batch 8 --no-compile --activation-checkpointing full
    python benchmarks/train_step_gpu.py --device cpu --preset tiny --no-compile --batch 2 --steps 3
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import time

# Allocation-heavy batch search and near-full memory fragment the default allocator; growable
# segments avoid spurious out-of-memory errors. Set before torch initialises CUDA.
if "PYTORCH_ALLOC_CONF" not in os.environ and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kiln.tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig  # noqa: E402
# the loop's own layout and step, so that this measures what production training runs
from kiln.tasks.train.distributed import Layout, make_optimizer  # noqa: E402
from kiln.tasks.train.trainer import train_step  # noqa: E402
from kiln.tasks.train.model import count_parameters, flops_per_token, seeded_weights  # noqa: E402
from kiln.tasks.train.parallel import build_mesh  # noqa: E402
from kiln.tasks.train.planner import load_preset  # noqa: E402

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s from NVIDIA's data sheets, matched as
# substrings of the device name in this order: the more specific names first.
PEAK_BF16_TFLOPS = (
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM: "NVIDIA H100 80GB HBM3"
    ("A100", 312.0),
)
SEARCH_STEPS = 2  # the first step of a size allocates the optimizer state, the second is steady


def peak_tflops_for(device_name: str) -> float | None:
    """The table's bf16 dense peak for a device name, or None when the device is not listed."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


def one_rank_layout(device: torch.device) -> Layout:
    """The layout of one rank of a data-parallel job, on a one-rank process group (nccl on CUDA,
    gloo on CPU): `Layout.build` then applies FSDP2 with the run's mixed-precision policy."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                                store=dist.HashStore(), device_id=device if device.type == "cuda" else None)
    dims = ParallelDims()
    return Layout(dims, device, build_mesh(dims, device.type))


def kiln_step(layout: Layout, model, optimizer, x: torch.Tensor) -> None:
    """One production train step (inputs double as targets: the timing does not depend on them)."""
    train_step(layout, model, None, optimizer, x, x, 1, 1.0, 0.0)


def fits(layout: Layout, model, optimizer, run_cfg: TrainRunConfig, vocab: int, device: torch.device) -> bool:
    """Whether SEARCH_STEPS train steps at run_cfg.batch_size run without CUDA running out of memory."""
    x = torch.randint(0, vocab, (run_cfg.batch_size, run_cfg.seq_len), device=device)
    try:
        for _ in range(SEARCH_STEPS):
            kiln_step(layout, model, optimizer, x)
        ok = True
    except torch.OutOfMemoryError:
        ok = False
    # outside the except block, so the traceback's tensors are already released
    optimizer.zero_grad(set_to_none=True)
    del x
    torch.cuda.empty_cache()
    return ok


def find_batch(layout: Layout, model, optimizer, run_cfg: TrainRunConfig, vocab: int, device: torch.device,
               limit: int) -> int:
    """The largest power of two <= limit whose train step fits: double until OOM, back off one."""
    batch = 0
    candidate = 1
    while candidate <= limit:
        ok = fits(layout, model, optimizer, run_cfg.model_copy(update={"batch_size": candidate}), vocab, device)
        print(f"batch search: micro-batch {candidate:>3} {'fits' if ok else 'out of memory'}", flush=True)
        if not ok:
            break
        batch, candidate = candidate, candidate * 2
    if batch == 0:
        sys.exit("even micro-batch 1 runs out of memory: add --activation-checkpointing full or lower --seq-len")
    return batch


def time_steps(layout: Layout, model, optimizer, batches, device: torch.device, warmup: int) -> list[float]:
    """Seconds per step for each batch after the first `warmup`: CUDA events on GPU, wall clock on CPU."""
    times = []
    for i, x in enumerate(batches):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            kiln_step(layout, model, optimizer, x)
            end.record()
            torch.cuda.synchronize(device)
            seconds = start.elapsed_time(end) / 1e3
        else:
            started = time.perf_counter()
            kiln_step(layout, model, optimizer, x)
            seconds = time.perf_counter() - started
        if i >= warmup:
            times.append(seconds)
    return times


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: the process's peak RSS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Expected duration: a few minutes on one H100 (the batch search and compilation "
                                            "dominate); seconds with --device cpu --preset tiny --no-compile.")
    parser.add_argument("--preset", default="1b", help="model preset name or .yaml path (default 1b)")
    parser.add_argument("--n-kv-heads", type=int, default=None,
                        help="K/V heads (grouped-query attention); default: a quarter of the preset's query heads")
    parser.add_argument("--precision", choices=("bf16-mixed", "fp32"), default="bf16-mixed",
                        help="training precision (default: bf16-mixed)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default: 32000)")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the preset's max_seq_len")
    parser.add_argument("--batch", type=int, default=None, help="micro-batch; default: search on CUDA, 2 on CPU")
    parser.add_argument("--max-batch", type=int, default=64, help="upper bound of the batch search (default: 64)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default: 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here) (default: 5)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="run the model eagerly")
    parser.add_argument("--activation-checkpointing", choices=("none", "selective", "full"), default="none",
                        help="recompute block activations in backward (default: none)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: the table's for the device)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where to train (default: cuda)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "no CUDA device: this benchmark needs an H100/H200-class GPU. To check the code path "
                       "on CPU, run with --device cpu --preset tiny\n")
    if args.device == "cpu" and args.preset != "tiny":
        parser.exit(2, f"--device cpu runs only --preset tiny (a {args.preset!r} step on CPU is not a "
                       "meaningful MFU measurement)\n")
    if args.activation_checkpointing != "none" and args.compile:
        # seen with torch 2.13: model.compile() over the composable `checkpoint` of
        # tasks.train.parallel fails in the first backward ("Recomputed values ... have different
        # metadata"), as tasks.train.loop would with both set; refuse before spending device time
        parser.exit(2, "--activation-checkpointing cannot be combined with torch.compile in Kiln yet "
                       "(the recompute fails in backward): add --no-compile\n")
    for name in ("batch", "max_batch", "steps", "peak_tflops", "seq_len", "n_kv_heads"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.exit(2, f"--{name.replace('_', '-')} must be positive, got {value}\n")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    cfg = load_preset(args.preset, ModelConfig)
    cfg = cfg.model_copy(update={"n_kv_heads": args.n_kv_heads or max(1, cfg.n_heads // 4)})
    seq_len = args.seq_len or cfg.max_seq_len
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
        peak = args.peak_tflops or peak_tflops_for(device_name)
        if peak is None:
            known = ", ".join(key for key, _ in PEAK_BF16_TFLOPS)
            sys.exit(f"no bf16 peak known for {device_name!r} (table: {known}): pass --peak-tflops")
    else:
        device_name, peak = "CPU", args.peak_tflops
    peak_source = "--peak-tflops" if args.peak_tflops else "table"

    # built eagerly: the batch search below must not recompile for every size
    run_cfg = TrainRunConfig(
        batch_size=args.batch or 2, seq_len=seq_len, device=args.device, precision=args.precision,
        activation_checkpointing=args.activation_checkpointing,
    )
    run_cfg.check_fits(cfg)
    layout = one_rank_layout(device)
    model, _ = layout.build(cfg, args.vocab, run_cfg, 0.0, seeded_weights(cfg, 0))
    optimizer = make_optimizer(model, OptimConfig(lr=3e-4), layout.device)
    batch_source = "--batch" if args.batch else "default"
    if args.batch is None and device.type == "cuda":
        batch = find_batch(layout, model, optimizer, run_cfg, args.vocab, device, args.max_batch)
        run_cfg, batch_source = run_cfg.model_copy(update={"batch_size": batch}), "largest power of two that fits"
    if args.compile:
        for block in model.blocks.children():  # block by block, as Layout.build compiles a sharded model
            block.compile()

    batches = [torch.randint(0, args.vocab, (run_cfg.batch_size, seq_len), device=device)
               for _ in range(args.warmup + args.steps)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        retries_before = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    try:
        times = time_steps(layout, model, optimizer, batches, device, args.warmup)
    except torch.OutOfMemoryError:
        sys.exit(f"micro-batch {run_cfg.batch_size} ran out of memory once compiled: rerun with "
                 f"--batch {max(1, run_cfg.batch_size // 2)} or --activation-checkpointing full")
    finally:
        dist.destroy_process_group()

    step_s = statistics.median(times)
    tokens_per_step = run_cfg.batch_size * seq_len
    tokens_per_s = tokens_per_step / step_s
    flops_tok = flops_per_token(cfg, args.vocab, seq_len)
    attention_flops_tok = flops_tok - flops_per_token(cfg, args.vocab, 0)  # seq 0 drops the T term
    achieved_tflops = flops_tok * tokens_per_s / 1e12
    mfu = achieved_tflops / peak if peak else math.nan

    print(f"device      {device_name}, peak {peak or 'unknown'} TFLOP/s"
          + (f" bf16 dense ({peak_source})" if peak else " (pass --peak-tflops for MFU)"))
    print(f"model       {args.preset}: {count_parameters(cfg, args.vocab) / 1e9:.3f}B params, d={cfg.d_model} "
          f"L={cfg.n_layers} H={cfg.n_heads} KV heads={cfg.kv_heads} ffn={cfg.ffn_hidden}, vocab {args.vocab}, "
          f"seq {seq_len}")
    print(f"step        micro-batch {run_cfg.batch_size} ({batch_source}), {tokens_per_step} tokens, "
          f"{args.precision} (FSDP2 on a one-rank mesh), compile {'on' if args.compile else 'off'}, "
          f"activation checkpointing {args.activation_checkpointing}, fused AdamW")
    print(f"time        median {step_s * 1e3:.1f} ms/step over {len(times)} steps after {args.warmup} warm-up "
          f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f})")
    print(f"throughput  {tokens_per_s:,.0f} tokens/s")
    print(f"flops/token {flops_tok / 1e9:.4g} GFLOP, including the attention term 12·L·d·T = "
          f"{attention_flops_tok / 1e9:.4g} GFLOP ({attention_flops_tok / flops_tok:.1%}, full T×T)")
    print(f"achieved    {achieved_tflops:.4g} TFLOP/s, MFU {mfu:.3f} "
          f"(without the attention term: {mfu * (1 - attention_flops_tok / flops_tok):.3f})")
    print(f"peak memory {peak_memory_gib(device):.2f} GiB" + (" (allocated)" if device.type == "cuda" else " (RSS)"))
    if device.type == "cuda":
        retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries_before
        if retries:
            print(f"warning     {retries} allocator retries (memory nearly full slows steps): try a smaller --batch")
    print(f"RESULT train_mfu {mfu:.4f}")


if __name__ == "__main__":
    main()
