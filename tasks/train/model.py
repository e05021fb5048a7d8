"""The decoder-only transformer Kiln trains, its initialisation, its analytic size and cost, and model IO.

Llama-style blocks: pre-RMSNorm, rotary position embeddings, causal scaled-dot-product attention
with grouped-query heads (optionally with QK-norm) and a SwiGLU MLP. No distributed code lives
here: parallelism is applied to the module from outside.

Construction allocates but does not initialise (torchtitan's split): a model is built on the
meta device, parallelised, materialised with `to_empty` and then initialised shard by shard
(`tasks.train.parallel.init_weights`). Initialisation is layout-independent by construction:
each parameter's full value is drawn from a generator seeded by (seed, parameter name)
(`initial_value`), so a rank computes exactly the slice of it that it holds, and one seed gives
the same weights on one process, under FSDP, TP or a pipeline.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kiln.tasks.train.config import ModelConfig, revalidated

Device = torch.device | str | None
INIT_STD = 0.02
MODEL_FILE = "model.pt"
CONFIG_FILE = "model_config.json"


def rope_tables(cfg: ModelConfig, device: Device = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [max_seq_len, head_dim // 2] (on `device`, or torch's default one)."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64, device=device) / half))
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64, device=device), inv_freq)
    return angles.cos().float(), angles.sin().float()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (first half, second half) pairs of x [B, H, T, D] by the position angles."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Each query attends to the keys at its own and earlier positions (q: [B, H, T, D]; k, v:
    [B, H_kv, T, D], query head h reading K/V head h // (H / H_kv))."""
    # the fused kernel groups the heads itself, so K and V are never repeated in memory
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, device: Device = None) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        # separate projections, not one fused [q; k; v] matmul: tensor parallel then splits each
        # by heads with a plain column split, which checkpoints reshard (measured no slower on CPU)
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False, device=device)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_dim, bias=False, device=device)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_dim, bias=False, device=device)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False, device=device)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps, device=device) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps, device=device) if cfg.qk_norm else None
        # swappable so parallelism can change how attention runs (context parallel gathers
        # keys and values across ranks) without the model knowing
        self.attention = causal_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = (w(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2) for w in (self.wk, self.wv))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        y = self.attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig, device: Device = None) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False, device=device)
        self.up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False, device=device)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, device: Device = None) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps, device=device)
        self.attn = Attention(cfg, device)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps, device=device)
        self.mlp = SwiGLU(cfg, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Token ids [B, T] -> next-token logits [B, T, vocab_size].

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
        self.blocks = nn.ModuleList(Block(cfg, device) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps, device=device)
        self.lm_head = nn.Linear(cfg.d_model, vocab_size, bias=False, device=device)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        cos, sin = rope_tables(cfg, device)
        # not persistent: derived from the config, so they stay out of checkpoints
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

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


def count_parameters(cfg: ModelConfig, vocab_size: int) -> int:
    """Trainable parameters of `build_model(cfg, vocab_size)`, computed from the config alone."""
    d = cfg.d_model
    attn = 2 * d * d + 2 * d * cfg.kv_dim + (2 * cfg.head_dim if cfg.qk_norm else 0)
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
    model.rope_cos, model.rope_sin = rope_tables(cfg, "cpu")
    return model
