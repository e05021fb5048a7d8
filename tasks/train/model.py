"""The decoder-only transformer Kiln trains, with its analytic size and cost, and model IO.

Llama-style blocks: pre-RMSNorm, rotary position embeddings, causal scaled-dot-product attention
(optionally with QK-norm) and a SwiGLU MLP. No distributed code lives here: parallelism is applied
to the module from outside.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tasks.train.config import ModelConfig, revalidated

INIT_STD = 0.02
MODEL_FILE = "model.pt"
CONFIG_FILE = "model_config.json"


def _rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [max_seq_len, head_dim // 2]."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (first half, second half) pairs of x [B, H, T, D] by the position angles."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Each query attends to the keys at its own and earlier positions (q, k, v: [B, H, T, D])."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        # separate projections, not one fused [q; k; v] matmul: tensor parallel then splits each
        # by heads with a plain column split, which checkpoints reshard (measured no slower on CPU)
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        # swappable so parallelism can change how attention runs (context parallel gathers
        # keys and values across ranks) without the model knowing
        self.attention = causal_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        y = self.attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Token ids [B, T] -> next-token logits [B, T, vocab_size]."""

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.cfg = cfg = revalidated(cfg)
        self.vocab_size = vocab_size
        self.tok_emb = nn.Embedding(vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        cos, sin = _rope_tables(cfg)
        # not persistent: derived from the config, so they stay out of checkpoints
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 scaling: each residual branch's output projection is shrunk by 1/sqrt(2L) so the
        # residual stream's variance does not grow with depth
        residual_std = INIT_STD / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # RMSNorm gains keep their ones
            std = residual_std if name.endswith(("attn.proj.weight", "mlp.down.weight")) else INIT_STD
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        """`idx` holds the tokens at positions [start_pos, start_pos + T) of their sequences.

        start_pos > 0 only shifts the rotary positions; which keys a query sees is up to the
        attention callable (context parallel hands it the other ranks' keys).
        """
        t = idx.shape[1]
        if start_pos < 0 or start_pos + t > self.cfg.max_seq_len:
            raise ValueError(
                f"positions [{start_pos}, {start_pos + t}) exceed model.max_seq_len={self.cfg.max_seq_len}"
            )
        cos, sin = self.rope_cos[start_pos : start_pos + t], self.rope_sin[start_pos : start_pos + t]
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


def build_model(cfg: ModelConfig, vocab_size: int) -> Transformer:
    """A freshly initialised model (uses torch's global RNG: seed it first for reproducibility)."""
    return Transformer(cfg, vocab_size)


def count_parameters(cfg: ModelConfig, vocab_size: int) -> int:
    """Trainable parameters of `build_model(cfg, vocab_size)`, computed from the config alone."""
    d = cfg.d_model
    attn = 4 * d * d + (2 * cfg.head_dim if cfg.qk_norm else 0)
    mlp = 3 * d * cfg.ffn_hidden
    per_layer = attn + mlp + 2 * d  # + the two RMSNorm gains
    embeddings = vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return embeddings + cfg.n_layers * per_layer + d


def flops_per_token(cfg: ModelConfig, vocab_size: int, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), PaLM/nanoGPT style: 6N + 12 L d T.

    N counts parameters that take part in a matmul: the embedding lookup is free, but the output
    projection costs 2 d V per token whether or not it shares weights with the embedding. The
    attention term is the score and value matmuls over the full (unmasked) T x T matrix.
    """
    d = cfg.d_model
    input_embedding = vocab_size * d if not cfg.tie_embeddings else 0
    n_matmul = count_parameters(cfg, vocab_size) - input_embedding
    return 6 * n_matmul + 12 * cfg.n_layers * d * seq_len


def save_model(model: Transformer, cfg: ModelConfig, vocab_size: int, model_dir: Path) -> None:
    """Write `model.pt` (state dict) and `model_config.json` into model_dir (created if needed)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save(state, model_dir / MODEL_FILE)
    meta = {"model": cfg.model_dump(mode="json"), "vocab_size": vocab_size}
    (model_dir / CONFIG_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def load_model(model_dir: Path) -> tuple[Transformer, ModelConfig]:
    """The model saved by `save_model`, on CPU and in eval mode, with its config."""
    meta = json.loads((model_dir / CONFIG_FILE).read_text())
    cfg = ModelConfig.model_validate(meta["model"])
    model = Transformer(cfg, int(meta["vocab_size"]))
    state = torch.load(model_dir / MODEL_FILE, map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    return model.eval(), cfg
