"""The decoder-only transformer Kiln trains, its initialisation, its analytic size and cost, and model IO.

By default Llama's blocks: pre-RMSNorm, rotary position embeddings, causal scaled-dot-product
attention with grouped-query heads (optionally with QK-norm) and a SwiGLU MLP. Every other
architecture option of `ModelConfig` is a branch taken at construction (which modules exist) or
a per-block setting read in forward; with the defaults the computation is the same as before
they existed, op for op. No distributed code lives here: parallelism is applied to the module
from outside, and can swap each block's attention callable (`Attention.attention`).

Attention is torch's scaled-dot-product attention: with `is_causal` for full causal attention
from position 0 (the fused kernel skips the masked blocks), and with an explicit mask otherwise
(a sliding window, ALiBi's biases, or the offset queries of context parallelism; the mask is
built per call from the positions, `attention_mask`). flex_attention does not serve here:
torch 2.13 has no backward for it on CPU.

Construction allocates but does not initialise (torchtitan's split): a model is built on the
meta device, parallelised, materialised with `to_empty` and then initialised shard by shard
(`tasks.train.parallel.init_weights`). Initialisation is layout-independent by construction:
each parameter's full value is drawn from a generator seeded by (seed, parameter name)
(`initial_value`), so a rank computes exactly the slice of it that it holds, and one seed gives
the same weights on one process, under FSDP, TP or a pipeline.

In training, `Transformer.forward` takes the targets and returns the loss
(`tasks.train.loss.linear_cross_entropy`: the output projection fused with the cross-entropy,
plus z-loss and the multi-token prediction heads' terms); without targets it returns the
next-token logits, the only thing inference and export see.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kiln.tasks.train.config import ModelConfig, RopeScaling, revalidated
from kiln.tasks.train.loss import linear_cross_entropy, objective
from kiln.tasks.train.rms_norm import RMSNorm

Device = torch.device | str | None
INIT_STD = 0.02
MODEL_FILE = "model.pt"
CONFIG_FILE = "model_config.json"
ALIBI_MAX_EXPONENT = 8  # ALiBi's slopes are 2^(-8 i / n) for heads i = 1..n (Press et al. 2022)


# ---- positions ---------------------------------------------------------------------------------


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(the inverse frequencies theta^(-2i/d) of each rotated pair, in float64, as `cfg.rope_scaling`
    changes them; the factor cos and sin are scaled by: YaRN's 0.1 ln(factor) + 1, else 1)."""
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    scaling: RopeScaling | None = cfg.rope_scaling
    theta = cfg.rope_theta
    if scaling is not None and scaling.kind == "ntk":
        theta *= scaling.factor ** (dim / (dim - 2))
    inv_freq = 1.0 / theta**exponents
    if scaling is None or scaling.kind == "ntk":
        return inv_freq, 1.0
    if scaling.kind == "linear":
        return inv_freq / scaling.factor, 1.0
    # YaRN, as transformers' `_compute_yarn_parameters` (truncated correction range): pair i turns
    # original_max_seq_len * inv_freq[i] / (2 pi) times over the original context
    def correction_dim(rotations: float) -> float:
        return dim * math.log(scaling.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    inv_freq = inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)
    return inv_freq, 0.1 * math.log(scaling.factor) + 1.0


def rope_tables(cfg: ModelConfig, device: Device = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [max_seq_len, head_dim // 2] (on `device`, or torch's default one)."""
    inv_freq, scale = rope_frequencies(cfg)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq).to(device)
    return (angles.cos() * scale).float(), (angles.sin() * scale).float()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (first half, second half) pairs of x [B, H, T, D] by the position angles:
    (x1 cos - x2 sin, x1 sin + x2 cos), computed as x [cos, cos] + [x2, x1] [-sin, sin].

    Bit for bit the same numbers as the two halves computed apart (negation is exact, and a sum
    of two products does not depend on their order), forward and backward, with the same bytes
    moved but in 4 full-width ops instead of 7 (4 instead of 8 in backward): an eager CPU step
    runs each op as its own parallel region (issue 34). A block also keeps less for backward: the
    half-width form left the projection's q alive beside the rotated q (MemTracker's count), this
    one keeps only its [T, D] tables (`tasks.train.plan_memory` prices both). Not addcmul: its
    fused multiply-add rounds once, which changes the last bits."""
    x1, x2 = x.chunk(2, dim=-1)
    cos2, sin2 = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # [T, D]: small
    return (x * cos2 + torch.cat((x2, x1), dim=-1) * sin2).type_as(x)


def alibi_slopes(n_heads: int) -> tuple[float, ...]:
    """ALiBi's slope of each head: 2^(-8 i / n) for i = 1..n when n is a power of two; otherwise
    those of the next power of two, odd-numbered first (Press et al.'s rule, as MPT and BLOOM
    compute it)."""
    n = 2 ** math.ceil(math.log2(n_heads))
    slopes = [2.0 ** (-ALIBI_MAX_EXPONENT * i / n) for i in range(1, n + 1)]
    return tuple((slopes[1::2] + slopes[::2])[:n_heads] if n != n_heads else slopes)


# ---- attention ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionPattern:
    """Which keys a block's queries see, and the bias added to their scores: all earlier
    positions (window None) or the last `window` (itself included); ALiBi's per-head `slopes`
    times the distance subtracted, or nothing. Static per block: plain Python values."""

    window: int | None = None
    slopes: tuple[float, ...] | None = None

    @property
    def plain(self) -> bool:
        """Full causal attention without a bias: the fused kernel's `is_causal` path."""
        return self.window is None and self.slopes is None


FULL_CAUSAL = AttentionPattern()


def attention_mask(pattern: AttentionPattern, q_start: int, t_q: int, t_k: int, device: torch.device,
                   dtype: torch.dtype, heads: slice | None = None) -> torch.Tensor:
    """What `scaled_dot_product_attention` takes as `attn_mask` for queries at positions
    [q_start, q_start + t_q) over keys at [0, t_k): a boolean [t_q, t_k] (True: attended), or
    with ALiBi the additive [1, h, t_q, t_k] bias in `dtype` for heads `heads` (default all; 4-D,
    which the fused CPU kernel takes: a 3-D bias sends SDPA to its math path, which keeps the
    [B, h, T, T] attention weights)."""
    distance = torch.arange(q_start, q_start + t_q, device=device)[:, None] - torch.arange(t_k, device=device)
    allowed = distance >= 0
    if pattern.window is not None:
        allowed &= distance < pattern.window
    if pattern.slopes is None:
        return allowed
    slopes = torch.tensor(pattern.slopes[heads or slice(None)], dtype=dtype, device=device)
    return (-slopes[:, None, None] * distance).masked_fill(~allowed, float("-inf"))[None]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: AttentionPattern = FULL_CAUSAL,
                     q_start: int = 0, heads: slice | None = None) -> torch.Tensor:
    """Queries [B, H, t_q, D] at positions [q_start, q_start + t_q) attend to keys and values
    [B, H_kv, t_k, D] at [0, t_k) under `pattern`, query head h reading K/V head h // (H / H_kv).
    `heads`: which of the model's heads q holds (tensor parallel holds some), for ALiBi's slopes."""
    # the fused kernel groups the heads itself, so K and V are never repeated in memory
    gqa = k.shape[1] != q.shape[1]
    if pattern.plain and q_start == 0 and q.shape[-2] == k.shape[-2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    mask = attention_mask(pattern, q_start, q.shape[-2], k.shape[-2], q.device, q.dtype, heads)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionPattern], torch.Tensor]


def make_norm(cfg: ModelConfig, dim: int, device: Device = None, own_backward: bool = True) -> nn.Module:
    """`cfg.norm` over the last `dim` features: RMSNorm, or LayerNorm without a bias. `own_backward`
    False keeps torch's RMSNorm backward, for norms tensor parallelism makes DTensors of (the
    QK-norms): one process then computes them exactly as a TP rank does."""
    if cfg.norm == "rmsnorm":
        norm = RMSNorm if own_backward else nn.RMSNorm
        return norm(dim, eps=cfg.norm_eps, device=device)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=False, device=device)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, pattern: AttentionPattern = FULL_CAUSAL, device: Device = None) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.rope = cfg.position == "rope"
        self.pattern = pattern
        # separate projections, not one fused [q; k; v] matmul: tensor parallel then splits each
        # by heads with a plain column split, which checkpoints reshard (measured no slower on CPU)
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False, device=device)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_dim, bias=False, device=device)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_dim, bias=False, device=device)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False, device=device)
        # per head: one gain over head_dim shared by the heads; over the projection: d (and kv) gains
        self.qk_norm_per_head = cfg.qk_norm_scope == "head"
        q_dim, k_dim = (cfg.head_dim, cfg.head_dim) if self.qk_norm_per_head else (cfg.d_model, cfg.kv_dim)
        self.q_norm = make_norm(cfg, q_dim, device, own_backward=False) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, k_dim, device, own_backward=False) if cfg.qk_norm else None
        # swappable so parallelism can change how attention runs (context parallel gathers
        # keys and values across ranks) without the model knowing
        self.attention: AttentionFn = causal_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.q_norm is not None and self.k_norm is not None and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = (w.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2) for w in (k, v))
        if self.q_norm is not None and self.k_norm is not None and self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        y = self.attention(q, k, v, self.pattern)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig, device: Device = None) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False, device=device)
        self.up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False, device=device)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GeluMLP(nn.Module):
    """GPT-2's MLP without biases: up, exact (erf) GELU, down."""

    def __init__(self, cfg: ModelConfig, device: Device = None) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False, device=device)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def block_pattern(cfg: ModelConfig, layer: int) -> AttentionPattern:
    """The attention pattern of block `layer`: its window (`cfg.window`) and ALiBi's slopes."""
    return AttentionPattern(cfg.window(layer), alibi_slopes(cfg.n_heads) if cfg.position == "alibi" else None)


class Block(nn.Module):
    """Attention and MLP with residual connections, normalised where `cfg.norm_placement` says:
    pre: x + f(norm(x)); post: norm(x + f(x)); reordered (OLMo 2): x + norm(f(x))."""

    def __init__(self, cfg: ModelConfig, pattern: AttentionPattern = FULL_CAUSAL, device: Device = None) -> None:
        super().__init__()
        self.placement = cfg.norm_placement
        self.attn_norm = make_norm(cfg, cfg.d_model, device)
        self.attn = Attention(cfg, pattern, device)
        self.mlp_norm = make_norm(cfg, cfg.d_model, device)
        self.mlp = SwiGLU(cfg, device) if cfg.mlp == "swiglu" else GeluMLP(cfg, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        if self.placement == "pre":
            x = x + self.attn(self.attn_norm(x), cos, sin)
            return x + self.mlp(self.mlp_norm(x))
        if self.placement == "post":
            x = self.attn_norm(x + self.attn(x, cos, sin))
            return self.mlp_norm(x + self.mlp(x))
        x = x + self.attn_norm(self.attn(x, cos, sin))
        return x + self.mlp_norm(self.mlp(x))


class Transformer(nn.Module):
    """Token ids [B, T] -> next-token logits [B, T, vocab_size], or with targets the training loss.

    Built uninitialised (with `device="meta"`: shapes only, no memory; elsewhere torch's default
    layer init): `build_model` gives an initialised one, and parallel training initialises each
    shard after sharding.
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, device: Device = None) -> None:
        super().__init__()
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.cfg = cfg = revalidated(cfg)
        self.vocab_size = vocab_size
        self.tok_emb = nn.Embedding(vocab_size, cfg.d_model, device=device)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model, device=device) if cfg.position == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg, block_pattern(cfg, i), device) for i in range(cfg.n_layers))
        # post-norm blocks end normalised: no final norm (the original Transformer, OPT-350m)
        self.norm = make_norm(cfg, cfg.d_model, device) if cfg.norm_placement != "post" else None
        self.lm_head = nn.Linear(cfg.d_model, vocab_size, bias=False, device=device)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # multi-token prediction: head k (1-based) is a full-context block and a norm over the
        # trunk's last hidden state, predicting the token k + 1 positions ahead
        full = AttentionPattern(slopes=alibi_slopes(cfg.n_heads) if cfg.position == "alibi" else None)
        self.mtp_blocks = nn.ModuleList(Block(cfg, full, device) for _ in range(cfg.mtp_heads))
        self.mtp_norms = nn.ModuleList(make_norm(cfg, cfg.d_model, device) for _ in range(cfg.mtp_heads)
                                       if cfg.norm_placement != "post")
        if cfg.position == "rope":
            cos, sin = rope_tables(cfg, device)
            # not persistent: derived from the config, so they stay out of checkpoints
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        else:
            self.rope_cos = self.rope_sin = None

    def forward(self, idx: torch.Tensor, start_pos: int = 0, targets: torch.Tensor | None = None,
                z_loss: float = 0.0, mtp_weight: float = 0.0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`idx` holds the tokens at positions [start_pos, start_pos + T) of their sequences.

        start_pos > 0 only shifts the positions; which keys a query sees is up to the attention
        callable (context parallel hands it the other ranks' keys). Without `targets`: the
        logits. With them (`idx`'s next tokens): (cross-entropy, what to differentiate), the
        latter adding z-loss and `mtp_weight` times the mean of the extra heads' losses.
        """
        t = idx.shape[1]
        if start_pos < 0 or start_pos + t > self.cfg.max_seq_len:
            raise ValueError(
                f"positions [{start_pos}, {start_pos + t}) exceed model.max_seq_len={self.cfg.max_seq_len}"
            )
        cos = sin = None
        if self.rope_cos is not None:
            cos, sin = self.rope_cos[start_pos : start_pos + t], self.rope_sin[start_pos : start_pos + t]
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb.weight[start_pos : start_pos + t]
        for block in self.blocks:
            x = block(x, cos, sin)
        final = self.norm(x) if self.norm is not None else x
        if targets is None:
            return self.lm_head(final)
        ce, total = self._loss(final, targets, z_loss)
        if self.mtp_blocks:
            extra = [self._loss(self._mtp_hidden(k, x, cos, sin)[:, :t - k - 1], targets[:, k + 1:], 0.0)[1]
                     for k in range(len(self.mtp_blocks))]
            total = total + mtp_weight * torch.stack(extra).mean()
        return ce, total

    def _loss(self, hidden: torch.Tensor, targets: torch.Tensor, z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(cross-entropy, what to differentiate) of the output projection of `hidden`. Eager, the
        fused loss (`linear_cross_entropy`); under torch.compile the logits and `objective`, which
        inductor fuses itself (measured on CPU: compiled, 0.91x the time of compiling the fused
        loss's chunk loop; eager, the fused loss is the faster)."""
        if torch.compiler.is_compiling():
            return objective(self.lm_head(hidden), targets, z_loss)
        return linear_cross_entropy(hidden, self.lm_head.weight, targets, z_loss)

    def _mtp_hidden(self, k: int, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        h = self.mtp_blocks[k](x, cos, sin)
        return self.mtp_norms[k](h) if self.mtp_norms else h

    def mtp_logits(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """Each extra head's logits [B, T, V] (extra head k, from 0, at position i predicts the token
        at position i + 2 + k): for tests and inspection; training goes through `forward` with targets."""
        t = idx.shape[1]
        cos = sin = None
        if self.rope_cos is not None:
            cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb.weight[:t]
        for block in self.blocks:
            x = block(x, cos, sin)
        return [self.lm_head(self._mtp_hidden(k, x, cos, sin)) for k in range(len(self.mtp_blocks))]


RESIDUAL_OUTPUTS = ("attn.proj.weight", "mlp.down.weight")


def initial_value(name: str, shape: torch.Size, cfg: ModelConfig, seed: int, device: torch.device) -> torch.Tensor:
    """The full initial value of the parameter called `name` (its name in `Transformer`), in fp32.

    Matrices (embeddings included) are N(0, 0.02), with GPT-2's scaling for each residual branch's
    output projection (std / sqrt(2 L), so the residual stream's variance does not grow with
    depth); RMSNorm gains are ones. The draw depends on (seed, name) only: its own generator.
    """
    if len(shape) < 2:
        return torch.ones(shape, device=device)
    std = INIT_STD / math.sqrt(2 * cfg.n_layers) if name.endswith(RESIDUAL_OUTPUTS) else INIT_STD
    generator = torch.Generator(device=device)
    generator.manual_seed(parameter_seed(seed, name))
    return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed for parameter `name` of a model seeded with `seed`."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def reset_rope(module: nn.Module, cfg: ModelConfig) -> None:
    """Recompute the RoPE tables of `module` and its submodules in place (they are garbage after `to_empty`)."""
    for sub in module.modules():
        if isinstance(getattr(sub, "rope_cos", None), torch.Tensor):
            cos, sin = rope_tables(cfg, sub.rope_cos.device)
            sub.rope_cos.copy_(cos)
            sub.rope_sin.copy_(sin)


def materialize(module: nn.Module, device: torch.device | str) -> None:
    """Allocate `module`'s meta parameters and buffers on `device` (values are garbage until
    initialised), keeping a tied output head tied: plain `to_empty` gives the head and the
    embedding separate tensors (FSDP2's keeps them one)."""
    module.to_empty(device=device)
    if isinstance(module, Transformer) and module.cfg.tie_embeddings:
        module.lm_head.weight = module.tok_emb.weight


# (a parameter's name in `Transformer`, the parameter) -> its full initial value
WeightSource = Callable[[str, torch.Tensor], torch.Tensor]


def seeded_weights(cfg: ModelConfig, seed: int) -> WeightSource:
    """Fresh weights: `initial_value` of each parameter for `seed`, drawn on the parameter's device."""
    return lambda name, param: initial_value(name, param.shape, cfg, seed, param.device)


def saved_weights(model_dir: Path) -> WeightSource:
    """The weights `save_model` wrote to model_dir, read lazily (memory-mapped: a rank that fills
    only its shard of each parameter never holds the whole model)."""
    state = torch.load(model_dir / MODEL_FILE, map_location="cpu", weights_only=True, mmap=True)
    return lambda name, param: state[name].to(param.device)


def fill_weights(module: nn.Module, cfg: ModelConfig, source: WeightSource,
                 place: Callable[[torch.Tensor, torch.Tensor], object] = torch.Tensor.copy_) -> None:
    """Give every parameter of `module` (a `Transformer` or a part of one that keeps its parameter
    names) its value from `source`, and recompute the RoPE tables. `place(param, full_value)`
    writes it: a plain copy here; a sharded parameter takes only its own slice
    (`tasks.train.parallel.place_shard`)."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            place(param, source(name, param))
        reset_rope(module, cfg)


def build_model(cfg: ModelConfig, vocab_size: int, seed: int | None = None) -> Transformer:
    """A freshly initialised model on CPU: `initial_value` of every parameter for `seed` (None: a
    seed drawn from torch's global RNG, so seed that for reproducibility)."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    model = Transformer(cfg, vocab_size, "meta")
    materialize(model, "cpu")
    fill_weights(model, model.cfg, seeded_weights(model.cfg, seed))
    return model


def block_parameters(cfg: ModelConfig) -> int:
    """Parameters of one block: attention (with its QK-norm gains), the MLP and two norm gains."""
    d = cfg.d_model
    qk_norm = 0
    if cfg.qk_norm:
        qk_norm = 2 * cfg.head_dim if cfg.qk_norm_scope == "head" else d + cfg.kv_dim
    attn = 2 * d * d + 2 * d * cfg.kv_dim + qk_norm
    mlp = (3 if cfg.mlp == "swiglu" else 2) * d * cfg.ffn_hidden
    return attn + mlp + 2 * d


def count_parameters(cfg: ModelConfig, vocab_size: int) -> int:
    """Trainable parameters of `build_model(cfg, vocab_size)`, computed from the config alone."""
    d = cfg.d_model
    embeddings = vocab_size * d * (1 if cfg.tie_embeddings else 2)
    positions = cfg.max_seq_len * d if cfg.position == "learned" else 0
    final_norm = d if cfg.norm_placement != "post" else 0
    mtp = cfg.mtp_heads * (block_parameters(cfg) + final_norm)
    return embeddings + positions + cfg.n_layers * block_parameters(cfg) + final_norm + mtp


def flops_per_token(cfg: ModelConfig, vocab_size: int, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), PaLM/nanoGPT style: 6N + 12 L d T.

    N counts parameters that take part in a matmul: the embedding lookups (tokens, learned
    positions) are free, but the output projection costs 2 d V per token whether or not it shares
    weights with the embedding. The attention term is the score and value matmuls over the full
    (unmasked) T x T matrix, for every layer: Kiln's kernels compute it whole under a sliding
    window too (a masked fused kernel skips no blocks). Each multi-token prediction head adds a
    block's matmuls and attention and the output projection once more (over T - k - 1 positions,
    counted as T).
    """
    d = cfg.d_model
    lookups = (vocab_size * d if not cfg.tie_embeddings else 0) + (cfg.max_seq_len * d if cfg.position == "learned" else 0)
    n_matmul = count_parameters(cfg, vocab_size) - lookups
    layers = cfg.n_layers + cfg.mtp_heads
    return 6 * n_matmul + 6 * cfg.mtp_heads * vocab_size * d + 12 * layers * d * seq_len


def save_model(model: Transformer, cfg: ModelConfig, vocab_size: int, model_dir: Path) -> None:
    """Write `model.pt` (state dict) and `model_config.json` into model_dir (created if needed)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save(state, model_dir / MODEL_FILE)
    meta = {"model": cfg.model_dump(mode="json"), "vocab_size": vocab_size}
    (model_dir / CONFIG_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def read_model_config(model_dir: Path) -> tuple[ModelConfig, int]:
    """The (config, vocab_size) that `save_model` wrote beside the weights."""
    meta = json.loads((model_dir / CONFIG_FILE).read_text())
    return ModelConfig.model_validate(meta["model"]), int(meta["vocab_size"])


def load_model(model_dir: Path) -> tuple[Transformer, ModelConfig]:
    """The model saved by `save_model`, on CPU and in eval mode, with its config."""
    cfg, vocab_size = read_model_config(model_dir)
    state = torch.load(model_dir / MODEL_FILE, map_location="cpu", weights_only=True)
    return model_from_state(cfg, vocab_size, state).eval(), cfg


def model_from_state(cfg: ModelConfig, vocab_size: int, state: dict[str, torch.Tensor]) -> Transformer:
    """A CPU `Transformer` whose parameters are the tensors of `state` (all of them, by name)."""
    model = Transformer(cfg, vocab_size, "meta")
    # assign: the given tensors become the parameters (nothing is allocated twice); strict, so a
    # missing or unexpected name is an error
    model.load_state_dict(state, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight  # assign replaced the embedding the head shared
    if cfg.position == "rope":
        model.rope_cos, model.rope_sin = rope_tables(cfg, "cpu")
    return model
