"""Parallelism for the Kiln transformer, applied from outside the model in one place.

`parallelize(model, dims, mesh)` follows torchtitan's order: tensor parallel (TP) inside each
block, then activation checkpointing, then data parallel: FSDP2 (`fully_shard`, per block and
at the root) or DDP (composable `replicate`, which keeps the module and its state-dict keys
unchanged). The mesh is always 4-D, named ("pp", "dp", "cp", "tp"); a size-1 dimension is a no-op.
Pipeline parallel (pp > 1) cuts the model into stages of whole blocks (`pipeline_stage`), which
`distributed.py` runs under a GPipe schedule; `parallelize` then applies activation checkpointing
and FSDP over each stage's dp group to the stage, as torchtitan does for pp x fsdp. It does not
compose with tp, cp or DDP here, and it needs untied embeddings (the first and last stage would
each hold a copy). Stages keep the model's parameter names, so checkpoints move between layouts.

Context parallel (CP, Llama-3 style) splits every sequence into cp contiguous chunks: cp rank c
holds positions [c T/cp, (c+1) T/cp) (`context_chunk`), runs the model on them with
`start_pos = c T/cp` (rotary positions stay global), and its attention all-gathers the keys and
values of the whole sequence over the cp group, then attends its queries to them under a causal
mask offset by the chunk start. Each cp rank's loss is the mean over its own chunk and the chunks
are equal, so the global loss is the mean over the dp x cp ranks: gradients are averaged (FSDP or
DDP) over the flattened "dp_cp" mesh (`dp_cp_mesh`), also when dp = 1. With tp > 1 each rank
runs this on its own heads. CP does not compose with pp. There is no load balancing: under the
causal mask later chunks attend to more keys, so the last cp rank does the most attention work
(zigzag chunk orders would even it out).

TP is Megatron-style over DTensor, with attention heads split across TP ranks:
- `attn.wq`, `attn.wk`, `attn.wv`, `mlp.gate` and `mlp.up` are column-wise (Shard(0)), so a rank
  holds the rows of its own heads and of its slice of the SwiGLU width. The model keeps these
  projections separate rather than fused ([q; k; v] in one weight would need a strided split,
  which DCP in torch 2.13 cannot save: it sees overlapping chunks); plain Shard(0) weights save
  and reshard into any other layout.
- `attn.proj` and `mlp.down` are row-wise (Shard(1)); their outputs are all-reduced.
- The attention and MLP inputs (and the RoPE tables) become replicated DTensors, so the model's
  own reshapes run on global shapes and DTensor keeps the head dimension sharded through them.
  CPU scaled-dot-product attention has no DTensor sharding rule in torch, so one is registered
  (heads or batch sharded, or all replicated); attention is independent per head.
- Embeddings, norms and the (possibly tied) output head stay plain, replicated tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.experimental import register_sharding
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from tasks.train.config import ParallelDims
from tasks.train.model import Transformer

_aten = torch.ops.aten


def check_divisible(dims: ParallelDims, model: Transformer) -> None:
    """ValueError naming the setting when heads or widths do not split evenly (the batch: see
    `ParallelDims.check_holds_batch`)."""
    cfg = model.cfg
    if cfg.n_heads % dims.tp:
        raise ValueError(f"model.n_heads={cfg.n_heads} is not divisible by parallel.tp={dims.tp}")
    if cfg.ffn_hidden % dims.tp:
        raise ValueError(f"SwiGLU width {cfg.ffn_hidden} is not divisible by parallel.tp={dims.tp}")
    if dims.pp > 1 and cfg.tie_embeddings:
        raise ValueError(
            "parallel.pp > 1 needs model.tie_embeddings=false: the embedding and output head sit on different stages"
        )
    if cfg.n_layers < dims.pp:
        raise ValueError(f"model.n_layers={cfg.n_layers} is fewer than parallel.pp={dims.pp} stages")


def check_context_split(dims: ParallelDims, seq_len: int) -> None:
    """ValueError when sequences of seq_len tokens do not split into parallel.cp equal chunks."""
    if seq_len % dims.cp:
        raise ValueError(
            f"train.seq_len={seq_len} is not divisible by parallel.cp={dims.cp}: context parallel gives "
            "each cp rank an equal chunk of every sequence"
        )


MESH_DIMS = ("pp", "dp", "cp", "tp")


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The ("pp", "dp", "cp", "tp") mesh over the already-initialised default process group.

    With cp > 1 it also holds the flattened "dp_cp" dimension (creating its process group is
    collective, so it happens here, on every rank): see `dp_cp_mesh`.
    """
    mesh = init_device_mesh(device_type, (dims.pp, dims.dp, dims.cp, dims.tp), mesh_dim_names=MESH_DIMS)
    if dims.cp > 1:
        mesh["dp", "cp"]._flatten("dp_cp")
    return mesh


def dp_cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that split a step's tokens (dp x cp): gradients and the loss are averaged over it."""
    return mesh["dp_cp"] if mesh["cp"].size() > 1 else mesh["dp"]


def _sdpa_strategies(num_tensor_args: int, num_outputs: int) -> list:
    # dims 0 and 1 of q/k/v [B, H, T, D] are batch and heads: attention never mixes them
    return [
        ([p] * num_outputs, [p] * num_tensor_args)
        for p in (Shard(1), Shard(0), Replicate())
    ]


@register_sharding(_aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_cpu_sharding(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    strategies = _sdpa_strategies(3, 2)
    # the non-tensor positional args (dropout_p, is_causal) get None
    return [(outs, ins + [None, None]) for outs, ins in strategies]


@register_sharding(_aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _sdpa_cpu_backward_sharding(
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None
):
    strategies = _sdpa_strategies(6, 3)
    return [(outs, ins + [None, None]) for outs, ins in strategies]


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Split every block's attention heads and SwiGLU width across `tp_mesh`, in place."""
    for block in model.blocks:
        # x and the RoPE tables enter as replicated DTensors; outputs leave as plain tensors
        parallelize_module(
            block.attn,
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(),) * 3, desired_input_layouts=(Replicate(),) * 3, use_local_output=False
            ),
        )
        # outputs stay DTensors sharded on the head (or width) dimension through the reshapes
        for linear in (block.attn.wq, block.attn.wk, block.attn.wv):
            parallelize_module(linear, tp_mesh, ColwiseParallel(use_local_output=False))
        parallelize_module(block.attn.proj, tp_mesh, RowwiseParallel())
        if block.attn.q_norm is not None and block.attn.k_norm is not None:
            # per-head RMSNorm gains act on the head dimension, which is never split
            distribute_module(block.attn.q_norm, tp_mesh)
            distribute_module(block.attn.k_norm, tp_mesh)
        parallelize_module(
            block.mlp,
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
            ),
        )
        for linear in (block.mlp.gate, block.mlp.up):
            parallelize_module(linear, tp_mesh, ColwiseParallel(use_local_output=False))
        parallelize_module(block.mlp.down, tp_mesh, RowwiseParallel())


class _GatherSequence(torch.autograd.Function):
    """All-gather the cp ranks' chunks of x [..., t, D] into the whole sequence [..., cp t, D].

    Backward: every rank's queries attended to every rank's keys, so the whole-sequence gradient
    is a partial sum on each rank; reduce-scatter sums it over the group and hands each rank its
    own chunk's slice (gloo has reduce_scatter in torch 2.13).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        cp = dist.get_world_size(group)
        gathered = x.new_empty((cp, *x.shape))
        # gloo takes the chunks concatenated along dim 0, not stacked: write through a flat view
        dist.all_gather_single(gathered.flatten(0, 1), x.contiguous(), group=group)
        return gathered.movedim(0, -3).flatten(-3, -2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        cp = dist.get_world_size(ctx.group)
        chunks = grad.unflatten(-2, (cp, grad.shape[-2] // cp)).movedim(-3, 0).contiguous()
        local = grad.new_empty(chunks.shape[1:])
        dist.reduce_scatter_single(local, chunks.flatten(0, 1), group=ctx.group)
        return local, None


def offset_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention for queries at positions [start, start + t) over keys at [0, k's length).

    The query at position p sees the keys at 0..p; with start = 0 and equal lengths this is
    `causal_attention`.
    """
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(diagonal=start)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class ContextParallelAttention:
    """The attention callable a block runs under CP: this rank's queries against the whole sequence's keys."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        self.group = cp_mesh.get_group()
        self.cp_rank = cp_mesh.get_local_rank()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if isinstance(q, DTensor):
            # under TP this rank holds some heads of its chunk; heads never mix, so CP runs on them alone
            assert q.placements == k.placements == v.placements == (Shard(1),), q.placements
            y = self(q.to_local(), k.to_local(), v.to_local())
            return DTensor.from_local(y, q.device_mesh, q.placements)
        t = q.shape[-2]
        start = self.cp_rank * t
        # one collective for both; keys past this chunk's end are masked for all its queries, so
        # they are dropped before attending
        kv = _GatherSequence.apply(torch.stack((k, v)), self.group)[..., : start + t, :]
        return offset_causal_attention(q, kv[0], kv[1], start)


def apply_context_parallel(model: Transformer, cp_mesh: DeviceMesh) -> None:
    """Make every block attend across the cp ranks' chunks; feed it `context_chunk`'s tokens."""
    attention = ContextParallelAttention(cp_mesh)
    for block in model.blocks:
        block.attn.attention = attention


def context_chunk(
    x: torch.Tensor, y: torch.Tensor, cp_rank: int, cp: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(inputs, targets, start_pos) of cp rank `cp_rank`'s contiguous chunk of every row of x, y [B, T]."""
    seq_len = x.shape[1]
    if seq_len % cp:
        raise ValueError(f"sequence length {seq_len} is not divisible by parallel.cp={cp}")
    assert 0 <= cp_rank < cp and y.shape == x.shape, (cp_rank, cp, x.shape, y.shape)
    t = seq_len // cp
    start = cp_rank * t
    return x[:, start : start + t], y[:, start : start + t], start


def apply_activation_checkpointing(model: Transformer | TransformerStage) -> None:
    """Recompute each block's activations in backward instead of keeping them."""
    # children(): the blocks of a model (a ModuleList) and of a pipeline stage (a ModuleDict)
    for block in model.blocks.children():
        checkpoint(block)


def apply_fsdp(model: Transformer | TransformerStage, dp_mesh: DeviceMesh) -> None:
    """FSDP2: one all-gather unit per block, the rest (embeddings, final norm, head) at the root."""
    for block in model.blocks.children():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def apply_ddp(model: Transformer, dp_mesh: DeviceMesh) -> None:
    replicate(model, device_mesh=dp_mesh)


def parallelize(
    model: Transformer | TransformerStage, dims: ParallelDims, mesh: DeviceMesh, activation_checkpointing: bool = False
) -> Transformer | TransformerStage:
    """Apply TP -> CP -> activation checkpointing (when asked) -> FSDP or DDP (over dp x cp) to `model`
    in place; returns it.

    With pp > 1 `model` is this rank's `pipeline_stage` (`ParallelDims` allows only FSDP with it).
    """
    shape = (dims.pp, dims.dp, dims.cp, dims.tp)
    if mesh.mesh_dim_names != MESH_DIMS or tuple(mesh.shape) != shape:
        raise ValueError(f"mesh {mesh} does not match parallel dims (pp, dp, cp, tp) = {shape}")
    if dims.tp > 1:
        apply_tp(model, mesh["tp"])
    if dims.cp > 1:
        apply_context_parallel(model, mesh["cp"])
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if dims.dp * dims.cp > 1:
        # cp ranks hold the same weights but different tokens: their gradients are averaged too
        if dims.dp_mode == "fsdp":
            apply_fsdp(model, dp_cp_mesh(mesh))
        else:
            apply_ddp(model, dp_cp_mesh(mesh))
    return model


class TransformerStage(nn.Module):
    """The slice of a Transformer one pipeline rank runs: ids or hidden states in, hidden states or logits out.

    Its parameters keep the whole model's names: blocks are keyed by their index in the model
    (stage 1 of a 4-block model holds `blocks.2` and `blocks.3`), so the stages' checkpoints hold
    disjoint keys and load into any other layout, and back.
    """

    def __init__(self, model: Transformer, first: bool, last: bool, block_ids: range) -> None:
        super().__init__()
        self.tok_emb = model.tok_emb if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in block_ids})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # the same computation as Transformer.forward, restricted to this stage's modules
        if self.tok_emb is not None:
            h = self.tok_emb(h)
        t = h.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for block in self.blocks.values():
            h = block(h, cos, sin)
        if self.norm is not None and self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h


def pipeline_stage(model: Transformer, pp_rank: int, pp_size: int) -> TransformerStage:
    """Stage `pp_rank` of `pp_size`: contiguous blocks, the earlier stages taking any remainder."""
    per_stage, extra = divmod(len(model.blocks), pp_size)
    begin = pp_rank * per_stage + min(pp_rank, extra)
    end = begin + per_stage + (1 if pp_rank < extra else 0)
    return TransformerStage(model, pp_rank == 0, pp_rank == pp_size - 1, range(begin, end))
