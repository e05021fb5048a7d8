"""CPU training-step throughput: Kiln's model and step against a plain reference, same run.

The reference is the same architecture (RMSNorm, RoPE, SwiGLU, causal attention, tied
embeddings) written plainly — explicit softmax attention, per-parameter AdamW — as someone
would write it without caring for speed. Both train on the same random batches; steps are
timed after a warm-up and the median step time is reported. `--compile` adds Kiln's model
under `torch.compile`. Last line: `RESULT train_tokens_per_s_ratio <Kiln / reference>`.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from tasks.train.config import ModelConfig, OptimConfig  # noqa: E402
from tasks.train.distributed import make_optimizer  # noqa: E402
from tasks.train.model import build_model  # noqa: E402


class PlainBlock(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.Parameter(torch.ones(d))
        self.norm2 = nn.Parameter(torch.ones(d))
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    @staticmethod
    def rms(x, weight):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * weight

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.rms(x, self.norm1)
        q, k, v = (proj(h).view(b, t, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        attn = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v
        x = x + self.o(attn.transpose(1, 2).reshape(b, t, d))
        h = self.rms(x, self.norm2)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def rope(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class PlainTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, cfg.d_model)
        self.blocks = nn.ModuleList(PlainBlock(cfg.d_model, cfg.n_heads, cfg.ffn_hidden) for _ in range(cfg.n_layers))
        self.norm = nn.Parameter(torch.ones(cfg.d_model))
        half = cfg.head_dim // 2
        freqs = 1.0 / (cfg.rope_theta ** (torch.arange(half) / half))
        angles = torch.outer(torch.arange(cfg.max_seq_len), freqs)
        self.cos, self.sin = angles.cos(), angles.sin()

    def forward(self, idx):
        t = idx.shape[1]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, self.cos[:t], self.sin[:t])
        return PlainBlock.rms(x, self.norm) @ self.embed.weight.T


def time_steps(model, optimizer, batches, warmup: int) -> list[float]:
    times = []
    for i, (x, y) in enumerate(batches):
        started = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--compile", action="store_true", help="also time Kiln's model under torch.compile")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, max_seq_len=args.seq_len)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=generator),) * 2
               for _ in range(args.steps + args.warmup)]
    tokens = args.batch * args.seq_len

    torch.manual_seed(0)
    reference = PlainTransformer(cfg, args.vocab)
    plain_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=False)
    torch.manual_seed(0)
    kiln = build_model(cfg, args.vocab)
    kiln_adamw = make_optimizer(kiln, OptimConfig(lr=1e-3), torch.device("cpu"))

    results = {}
    # Interleave the two so that machine noise hits both alike.
    ref_times, kiln_times = [], []
    for _ in range(2):
        ref_times += time_steps(reference, plain_adamw, batches, args.warmup)
        kiln_times += time_steps(kiln, kiln_adamw, batches, args.warmup)
    results["reference"] = tokens / statistics.median(ref_times)
    results["kiln"] = tokens / statistics.median(kiln_times)
    if args.compile:
        compiled = torch.compile(kiln)
        results["kiln+compile"] = tokens / statistics.median(time_steps(compiled, kiln_adamw, batches, args.warmup))

    print(f"model d={args.d_model} L={args.layers} H={args.heads} T={args.seq_len} B={args.batch} V={args.vocab}, "
          f"{args.threads} thread(s), median of {len(ref_times)} steps")
    for name, value in results.items():
        print(f"{name:<14} {value:10.0f} tokens/s   {value / results['reference']:.2f}x")
    print(f"RESULT train_tokens_per_s_ratio {results['kiln'] / results['reference']:.3f}")


if __name__ == "__main__":
    main()
