"""Parallelism for the Kiln transformer, applied from outside the model in one place.

`parallelize(model, dims, mesh)` follows torchtitan's order: tensor parallel (TP) inside each
block, then activation checkpointing, then data parallel: FSDP2 (`fully_shard`, per block and
at the root) or DDP (composable `replicate`, which keeps the module and its state-dict keys
unchanged). The mesh is always 3-D, named ("pp", "dp", "tp"); a size-1 dimension is a no-op.
Pipeline parallel (pp > 1) instead cuts the model into stages of whole blocks
(`pipeline_stage`), which `distributed.py` runs under a GPipe schedule; it does not yet compose
with dp or tp, and it needs untied embeddings (the first and last stage would each hold a copy).

TP is Megatron-style over DTensor, with attention heads split across TP ranks:
- `attn.qkv` and `mlp.gate_up` are *fused* projections ([q; k; v] and [gate; up] stacked along
  the output dimension), so a plain column split would hand rank 0 all of q and half of k. They
  are sharded `_StridedShard(0, split_factor=n)` instead: each of the n stacked parts is split
  across ranks, so a rank holds [q_r; k_r; v_r] (its own heads) or [gate_r; up_r].
- `attn.proj` and `mlp.down` are row-wise (Shard(1)); their outputs are all-reduced.
- The attention and MLP inputs (and the RoPE tables) become replicated DTensors, so the model's
  own reshapes run on global shapes and DTensor keeps the head dimension sharded through them.
  CPU scaled-dot-product attention has no DTensor sharding rule in torch, so one is registered
  (heads or batch sharded, or all replicated); attention is independent per head.
- Embeddings, norms and the (possibly tied) output head stay plain, replicated tensors.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.experimental import register_sharding
from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from tasks.train.config import ParallelDims
from tasks.train.model import Transformer

_aten = torch.ops.aten


def check_divisible(dims: ParallelDims, model: Transformer, batch_size: int) -> None:
    """ValueError naming the setting when heads, widths or the batch do not split evenly."""
    cfg = model.cfg
    if cfg.n_heads % dims.tp:
        raise ValueError(f"model.n_heads={cfg.n_heads} is not divisible by parallel.tp={dims.tp}")
    if cfg.ffn_hidden % dims.tp:
        raise ValueError(f"SwiGLU width {cfg.ffn_hidden} is not divisible by parallel.tp={dims.tp}")
    if batch_size % dims.dp:
        raise ValueError(f"train.batch_size={batch_size} is not divisible by parallel.dp={dims.dp}")
    if dims.pp > 1 and cfg.tie_embeddings:
        raise ValueError(
            "parallel.pp > 1 needs model.tie_embeddings=false: the embedding and output head sit on different stages"
        )
    if cfg.n_layers < dims.pp:
        raise ValueError(f"model.n_layers={cfg.n_layers} is fewer than parallel.pp={dims.pp} stages")


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The ("pp", "dp", "tp") mesh over the already-initialised default process group."""
    return init_device_mesh(device_type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=("pp", "dp", "tp"))


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


def _fused_colwise(parts: int):
    """Partition fn sharding each of `parts` row blocks of a Linear weight across the mesh."""

    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, mesh, [_StridedShard(0, split_factor=parts)])
            module.register_parameter(pname, nn.Parameter(sharded, requires_grad=param.requires_grad))

    return partition


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
        distribute_module(block.attn.qkv, tp_mesh, _fused_colwise(3))
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
        distribute_module(block.mlp.gate_up, tp_mesh, _fused_colwise(2))
        parallelize_module(block.mlp.down, tp_mesh, RowwiseParallel())


def apply_activation_checkpointing(model: Transformer) -> None:
    """Recompute each block's activations in backward instead of keeping them."""
    for block in model.blocks:
        checkpoint(block)


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh) -> None:
    """FSDP2: one all-gather unit per block, the rest (embeddings, final norm, head) at the root."""
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def apply_ddp(model: Transformer, dp_mesh: DeviceMesh) -> None:
    replicate(model, device_mesh=dp_mesh)


def parallelize(model: Transformer, dims: ParallelDims, mesh: DeviceMesh) -> Transformer:
    """Apply TP -> activation checkpointing -> FSDP or DDP to `model` in place; returns it."""
    if mesh.mesh_dim_names != ("pp", "dp", "tp") or tuple(mesh.shape) != (dims.pp, dims.dp, dims.tp):
        raise ValueError(f"mesh {mesh} does not match parallel dims pp={dims.pp}, dp={dims.dp}, tp={dims.tp}")
    if dims.tp > 1:
        apply_tp(model, mesh["tp"])
    if dims.activation_checkpointing:
        apply_activation_checkpointing(model)
    if dims.dp > 1:
        if dims.dp_mode == "fsdp":
            apply_fsdp(model, mesh["dp"])
        else:
            apply_ddp(model, mesh["dp"])
    return model


class TransformerStage(nn.Module):
    """The slice of a Transformer one pipeline rank runs: ids or hidden states in, hidden states or logits out."""

    def __init__(self, model: Transformer, first: bool, last: bool, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.tok_emb = model.tok_emb if first else None
        self.blocks = nn.ModuleList(blocks)
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
        for block in self.blocks:
            h = block(h, cos, sin)
        if self.norm is not None and self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h


def pipeline_stage(model: Transformer, pp_rank: int, pp_size: int) -> TransformerStage:
    """Stage `pp_rank` of `pp_size`: contiguous blocks, the earlier stages taking any remainder."""
    per_stage, extra = divmod(len(model.blocks), pp_size)
    begin = pp_rank * per_stage + min(pp_rank, extra)
    end = begin + per_stage + (1 if pp_rank < extra else 0)
    return TransformerStage(model, pp_rank == 0, pp_rank == pp_size - 1, list(model.blocks[begin:end]))
