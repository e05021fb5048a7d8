"""CPU training-step throughput: Kiln's model and step against nanoGPT's, same shape, same run.

The reference is what a user would compare Kiln with: Karpathy's nanoGPT `model.py` and the step
of its `train.py`, written as its authors write it — GPT-2 blocks (LayerNorm with biases, one
fused QKV projection, `scaled_dot_product_attention(is_causal=True)`, a 4x GELU MLP with biases),
learned positional embeddings, embeddings tied to the output head, and `configure_optimizers`'
AdamW (decay on 2-D parameters, fused kernel where the device has one). The one departure:
nanoGPT asks for the fused kernel only on CUDA; torch >= 2.4 has it on CPU too, and it is the
faster CPU AdamW, so the reference gets it here (a stronger anchor, not a weaker one).

Kiln runs its production step on a one-process layout: `Layout.build` (which compiles the
model, loss included, when `--compile`, as `train.run.compile` does), `Layout.forward_backward`
(the model's fp32 loss: eager, the output projection fused with the cross-entropy chunk by
chunk; compiled, left to inductor), `clip_grad_norm` and `make_optimizer`'s fused AdamW — the
body of `tasks.train.loop.train_step`. The reference step is nanoGPT's: forward with targets,
backward, `clip_grad_norm_(1.0)`, AdamW step, `zero_grad(set_to_none=True)`.

Shapes (d_model, layers, heads, seq_len, vocab, batch) are the same; parameter counts must agree
within 1% (nanoGPT's 4 d MLP against Kiln's SwiGLU of width ~8/3 d holds 2 matrices of 4 d^2
against 3 of ~8/3 d^2 — the same; 5,310,720 against 5,322,240 at the default shape), else the
script stops: `--ref-mlp-hidden` then sets the reference's width. Every model sees the same batches.
Steps are interleaved — one step of each model in turn, the order rotating every round — so the
noise of a shared machine falls on all of them alike; the median step time after `--warmup`
rounds is reported. Two checks against load that changes mid-run ride along: the median of the
per-round ratios, and the ratio of median process CPU times (work done, which other processes'
load barely moves; it misses time lost to imperfect parallelism). Without `--compile` the two
eager models run; with it, also a compiled copy of each (the reference compiled nanoGPT's way,
`torch.compile(model)`; nanoGPT compiles by default, so compiled against compiled is the
comparison its users would make, and compiled Kiln against eager nanoGPT is printed too). Each
model's first step runs alone before the interleaved rounds; a compiled model's compile time is
that step's time less its median step.

Where the time goes: after the timed rounds each model runs a few steps under torch's profiler,
and the share of their wall time spent in matmuls (MKL's GEMMs) and in attention (the flash
kernel) is printed. Both models run those kernels alike, at the same FLOPs; the rest (norms,
activations, the loss's softmax, the optimizer, Python) is where one step can beat another. So
compiled Kiln's ratio divided by its matmul-and-attention share is its ceiling against eager
nanoGPT: the ratio it would reach were everything else free.

Results: `RESULT train_tokens_per_s_ratio <Kiln / reference>`, eager against eager, and with
`--compile` then `RESULT train_compiled_vs_nanogpt_eager_ratio` (compiled Kiln against eager
nanoGPT, the goal of issue 34), `RESULT train_compiled_ceiling_vs_nanogpt_eager` (that ceiling)
and `RESULT train_compiled_ratio` (compiled against compiled, last).
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from kiln.tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig  # noqa: E402
from kiln.tasks.train.distributed import Layout, clip_grad_norm, make_optimizer  # noqa: E402
from kiln.tasks.train.model import count_parameters, seeded_weights  # noqa: E402

GRAD_CLIP = 1.0  # nanoGPT's train.py default, and Kiln's optim.grad_clip default
PROFILED_STEPS = 3


# --- the reference: nanoGPT's model.py (dropout kept at its default 0.0, no generate/from_pretrained)


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2 vocab_size of 50257, padded up to nearest multiple of 64 for efficiency
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    mlp_hidden: int | None = None  # None: nanoGPT's 4 * n_embd
    dropout: float = 0.0
    bias: bool = True  # True: bias in Linears and LayerNorms, like GPT-2. False: a bit better and faster


class LayerNorm(nn.Module):
    """LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False"""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_hidden or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying: https://paperswithcode.com/method/weight-tying
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # apply special scaled init to the residual projections, per GPT-2 paper
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, \
            f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)  # shape (t)
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas: tuple[float, float],
                             device_type: str) -> torch.optim.AdamW:
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        # any parameter that is 2D will be weight decayed, otherwise no:
        # all weight tensors in matmuls + embeddings decay, all biases and layernorms don't
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        fused_available = "fused" in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type in ("cuda", "cpu")  # nanoGPT: == "cuda" (see the docstring)
        extra_args = dict(fused=True) if use_fused else dict()
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)


# --- the two training steps


Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | float]  # returns the step's loss


def kiln_step(cfg: ModelConfig, vocab: int, optim: OptimConfig, run: TrainRunConfig) -> tuple[Step, int]:
    layout = Layout.create(ParallelDims(), torch.device("cpu"))
    model, schedule = layout.build(cfg, vocab, run, optim.z_loss, seeded_weights(cfg, 0))
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == count_parameters(cfg, vocab)
    optimizer = make_optimizer(model, optim, layout.device)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:  # tasks.train.loop.train_step
        loss = layout.forward_backward(model, schedule, x, y, run.grad_accum, optim.z_loss)
        clip_grad_norm(list(model.parameters()), optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step, n_params


def reference_step(config: GPTConfig, optim: OptimConfig, compile: bool) -> tuple[Step, int]:
    torch.manual_seed(0)
    model = GPT(config)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = model.configure_optimizers(optim.weight_decay, optim.lr, (optim.beta1, optim.beta2), "cpu")
    if compile:
        model = torch.compile(model)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # nanoGPT's train.py, grad_accum 1, fp32
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()  # train.py reads it (.item()) only every log_interval steps

    return step, n_params


def interleaved_times(steps: dict[str, Step], batches: list[tuple[torch.Tensor, torch.Tensor]],
                      warmup: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(wall-clock, process CPU) seconds of each model's steps after `warmup` rounds; each round
    runs one step of every model, the starting model rotating from round to round."""
    names = list(steps)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for i, (x, y) in enumerate(batches):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            started, cpu_started = time.perf_counter(), time.process_time()
            steps[name](x, y)
            if i >= warmup:
                wall[name].append(time.perf_counter() - started)
                cpu[name].append(time.process_time() - cpu_started)
    return wall, cpu


MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm"}


def time_split(step: Step, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """(matmuls' share, attention's share) of the wall time of `batches`' steps under torch's
    profiler: the kernels every model here runs alike (MKL's GEMMs, the flash attention kernel),
    which no rewrite of the rest of the step makes faster."""
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        started = time.perf_counter()
        for x, y in batches:
            step(x, y)
        wall = time.perf_counter() - started
    matmul = attention = 0.0
    for event in profiled.key_averages():
        if event.key in MATMUL_OPS:
            matmul += event.self_cpu_time_total / 1e6
        elif "scaled_dot_product" in event.key:
            attention += event.self_cpu_time_total / 1e6
    return matmul / wall, attention / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Expected duration: under a minute eager with the defaults on 2 cores; "
                                            "--compile adds the compilation (3-9 s with inductor's cache warm, ~50 s cold).")
    parser.add_argument("--d-model", type=int, default=256, help="model width (default: 256)")
    parser.add_argument("--layers", type=int, default=4, help="blocks (default: 4)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default: 8)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: 256)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default: 8)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default: 8192)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per model (default: 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (they absorb compilation) (default: 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--ref-mlp-hidden", type=int, default=None,
                        help="the reference MLP's width (default nanoGPT's 4 * d_model)")
    parser.add_argument("--compile", action="store_true", help="also time compiled copies of both models")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    cfg = ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, max_seq_len=args.seq_len)
    gpt = GPTConfig(block_size=args.seq_len, vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.d_model, mlp_hidden=args.ref_mlp_hidden)
    optim = OptimConfig(lr=1e-3)
    run = TrainRunConfig(batch_size=args.batch, seq_len=args.seq_len)

    steps: dict[str, Step] = {}
    steps["kiln eager"], kiln_params = kiln_step(cfg, args.vocab, optim, run)
    steps["nanoGPT eager"], ref_params = reference_step(gpt, optim, compile=False)
    if args.compile:
        steps["kiln compiled"], _ = kiln_step(cfg, args.vocab, optim, run.model_copy(update={"compile": True}))
        steps["nanoGPT compiled"], _ = reference_step(gpt, optim, compile=True)
    ref_hidden = args.ref_mlp_hidden or 4 * args.d_model
    print(f"parameters: kiln {kiln_params:,} (SwiGLU width {cfg.ffn_hidden}), "
          f"nanoGPT {ref_params:,} (GELU width {ref_hidden}): {ref_params / kiln_params - 1:+.2%}")
    if abs(ref_params / kiln_params - 1) > 0.01:
        raise SystemExit(f"parameter counts differ by more than 1%: set --ref-mlp-hidden (now {ref_hidden})")

    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=generator)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    first = {}
    for name, step in steps.items():  # alone, so that compiling one model does not slow another's steps
        started = time.perf_counter()
        step(*batches[0])
        first[name] = time.perf_counter() - started
    times, cpu_times = interleaved_times(steps, batches, args.warmup)

    tokens_per_step = args.batch * args.seq_len
    rate = {name: tokens_per_step / statistics.median(t) for name, t in times.items()}
    print(f"d={args.d_model} L={args.layers} H={args.heads} T={args.seq_len} B={args.batch} V={args.vocab}, "
          f"{args.threads} thread(s), median of {args.steps} interleaved steps after {args.warmup} warm-up rounds")
    for name, value in rate.items():
        compile_s = f", compile {first[name] - statistics.median(times[name]):.1f} s" if "compiled" in name else ""
        print(f"{name:<17} {1e3 * statistics.median(times[name]):8.1f} ms/step {value:9.0f} tokens/s "
              f"(CPU time {1e3 * statistics.median(cpu_times[name]):7.1f} ms/step{compile_s})")
    pairs = [("kiln eager", "nanoGPT eager")]
    if args.compile:
        pairs += [("kiln compiled", "nanoGPT compiled"), ("kiln compiled", "nanoGPT eager")]
    for kiln, ref in pairs:
        # the same ratio from each round's pair of steps: robust to load that changes mid-run
        paired = statistics.median(r / k for k, r in zip(times[kiln], times[ref]))
        by_cpu = statistics.median(cpu_times[ref]) / statistics.median(cpu_times[kiln])
        print(f"{kiln} / {ref}: {rate[kiln] / rate[ref]:.3f} "
              f"(median of per-round ratios {paired:.3f}, by CPU time {by_cpu:.3f})")
    print(f"where the time goes ({PROFILED_STEPS} profiled steps each, after the timed ones): "
          "matmuls, attention, everything else")
    shares = {}
    for name, step in steps.items():
        matmul, attention = shares[name] = time_split(step, batches[:PROFILED_STEPS])
        print(f"{name:<17} {matmul:6.1%} {attention:6.1%} {1 - matmul - attention:6.1%}")
    print(f"RESULT train_tokens_per_s_ratio {rate['kiln eager'] / rate['nanoGPT eager']:.3f}")
    if args.compile:
        compiled_vs_eager = rate["kiln compiled"] / rate["nanoGPT eager"]
        # were all but its matmuls and attention free, kiln compiled would run 1 / (their share) faster
        ceiling = compiled_vs_eager / sum(shares["kiln compiled"])
        print(f"kiln compiled / nanoGPT eager were everything but its matmuls and attention free: {ceiling:.3f}")
        print(f"RESULT train_compiled_vs_nanogpt_eager_ratio {compiled_vs_eager:.3f}")
        print(f"RESULT train_compiled_ceiling_vs_nanogpt_eager {ceiling:.3f}")
        print(f"RESULT train_compiled_ratio {rate['kiln compiled'] / rate['nanoGPT compiled']:.3f}")


if __name__ == "__main__":
    main()
