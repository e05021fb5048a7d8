"""Parallelism for the Kiln transformer, applied from outside the model in one place.

`build_parallel` follows torchtitan's order: the model is built on the meta device, cut into
this rank's pipeline stages, and `parallelize` applies tensor parallel (TP) inside each block,
context parallel, activation checkpointing, then data parallel: FSDP2 (`fully_shard`, per block
and at the root, with a `MixedPrecisionPolicy` under bf16-mixed, which is why bf16-mixed applies
it even with one dp rank) or DDP (composable `replicate`, which keeps the module and its
state-dict keys unchanged). Only then are the parameters allocated (`materialize`) and each shard
initialised (`init_weights`: a rank computes only its own slice of each parameter's full value,
so every layout starts from the same weights and no rank ever holds the whole model). The mesh is
always 4-D, named ("pp", "dp", "cp", "tp"); a size-1 dimension is a no-op.

Pipeline parallel (pp > 1) cuts the model into `dims.num_stages` stages of whole blocks; rank r
runs stages r, r + pp, ... (`pipeline_parts`: one stage, or `stages_per_rank` of them under the
interleaved schedule), which `distributed.py` drives with the configured torch schedule.
`parallelize` applies activation checkpointing and FSDP over each stage's dp group to each
stage, as torchtitan does for pp x fsdp. It does not compose with tp, cp or DDP here, and it
needs untied embeddings (the first and last stage would each hold a copy). Stages keep the
model's parameter names, so checkpoints move between layouts.

Activation checkpointing (`apply_activation_checkpointing`) recomputes in backward either whole
blocks ("full": a block keeps only its input) or, "selective", everything but the outputs of the
matmuls, of attention and of TP's all-reduces (torchtitan's op-level policy: the expensive or
communicating ops are saved, the cheap elementwise ones recomputed).

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
  holds the rows of its own query heads, of its own K/V heads (under grouped-query attention the
  K/V heads are split too, so tp must divide n_kv_heads: rank r's query heads read exactly rank
  r's K/V heads) and of its slice of the SwiGLU width. The model keeps these
  projections separate rather than fused ([q; k; v] in one weight would need a strided split,
  which DCP in torch 2.13 cannot save: it sees overlapping chunks); plain Shard(0) weights save
  and reshard into any other layout.
- `attn.proj` and `mlp.down` are row-wise (Shard(1)); their outputs are all-reduced.
- The attention and MLP inputs (and the RoPE tables) become replicated DTensors, so the model's
  own reshapes run on global shapes and DTensor keeps the head dimension sharded through them.
  CPU scaled-dot-product attention has no DTensor sharding rule in torch, so one is registered
  (heads or batch sharded, or all replicated); attention is independent per head.
- Embeddings, norms and the (possibly tied) output head stay plain, replicated tensors; so do the
  activations outside attention and the MLP (no sequence parallelism): the planner prices that.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.experimental import register_sharding
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from kiln.tasks.train.config import Checkpointing, ModelConfig, ParallelDims, Precision
from kiln.tasks.train.model import (
    AttentionFn,
    AttentionPattern,
    Transformer,
    WeightSource,
    causal_attention,
    fill_weights,
    materialize,
)

_aten = torch.ops.aten


def check_divisible(dims: ParallelDims, cfg: ModelConfig) -> None:
    """ValueError naming the setting when heads, widths or layers do not split evenly (the batch:
    see `ParallelDims.check_holds_batch`)."""
    if cfg.n_heads % dims.tp:
        raise ValueError(f"model.n_heads={cfg.n_heads} is not divisible by parallel.tp={dims.tp}")
    if cfg.kv_heads % dims.tp:
        raise ValueError(
            f"parallel.tp={dims.tp} does not divide the model's {cfg.kv_heads} K/V heads (model.n_kv_heads): tensor "
            "parallel gives each rank whole K/V heads, the ones its query heads read, so a K/V head cannot be "
            f"split across ranks; use a tp that divides {cfg.kv_heads}"
        )
    if cfg.ffn_hidden % dims.tp:
        raise ValueError(f"SwiGLU width {cfg.ffn_hidden} is not divisible by parallel.tp={dims.tp}")
    if dims.pp > 1 and cfg.tie_embeddings:
        raise ValueError(
            "parallel.pp > 1 needs model.tie_embeddings=false: the embedding and output head sit on different stages"
        )
    if cfg.n_layers < dims.num_stages:
        raise ValueError(f"model.n_layers={cfg.n_layers} is fewer than the {dims.num_stages} pipeline stages "
                         f"(parallel.pp={dims.pp} x stages_per_rank={dims.stages_per_rank})")
    if cfg.mtp_heads and dims.pp > 1:
        raise ValueError(f"model.mtp_heads={cfg.mtp_heads} with parallel.pp={dims.pp}: the extra heads' losses are "
                         "computed with the next-token loss inside the model, which a pipeline's last stage does not "
                         "run; train multi-token prediction with dp, tp or cp, or set mtp_heads: 0")
    if cfg.mtp_heads and dims.cp > 1:
        raise ValueError(f"model.mtp_heads={cfg.mtp_heads} with parallel.cp={dims.cp}: head k predicts the token "
                         "k + 1 positions ahead, which for a chunk's last positions lies in the next cp rank's chunk; "
                         "train multi-token prediction with dp or tp, or set mtp_heads: 0")


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


def all_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of a model or a pipeline stage (a ModuleList or a ModuleDict), then its
    multi-token prediction blocks: what TP, recompute and FSDP apply to one by one."""
    return [*model.blocks.children(), *getattr(model, "mtp_blocks", ())]


def local_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, slice | None]:
    """q, k, v as this rank's plain tensors and which of the model's heads q holds: under TP the
    heads are split in order, rank r holding the r-th slice (None: not split, all of them)."""
    if not isinstance(q, DTensor):
        return q, k, v, None
    # under TP this rank holds some heads; attention never mixes heads, so it runs on them alone
    assert q.placements == k.placements == v.placements == (Shard(1),), q.placements
    local = q.to_local()
    first = q.device_mesh.get_local_rank() * local.shape[1]
    return local, k.to_local(), v.to_local(), slice(first, first + local.shape[1])


def tensor_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              pattern: AttentionPattern) -> torch.Tensor:
    """A masked or biased attention pattern on this rank's heads: torch has no sharding rule for
    scaled-dot-product attention with a mask, and ALiBi's slopes are per head."""
    q_local, k_local, v_local, heads = local_heads(q, k, v)
    y = causal_attention(q_local, k_local, v_local, pattern, 0, heads)
    return DTensor.from_local(y, q.device_mesh, q.placements) if heads is not None else y


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split every block's attention heads and MLP width across `tp_mesh`, in place."""
    for block in all_blocks(model):
        # x and the RoPE tables enter as replicated DTensors; outputs leave as plain tensors
        tables = Replicate() if block.attn.rope else None
        parallelize_module(
            block.attn,
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(), tables, tables), desired_input_layouts=(Replicate(), tables, tables),
                use_local_output=False,
            ),
        )
        # outputs stay DTensors sharded on the head (or width) dimension through the reshapes
        for linear in (block.attn.wq, block.attn.wk, block.attn.wv):
            parallelize_module(linear, tp_mesh, ColwiseParallel(use_local_output=False))
        parallelize_module(block.attn.proj, tp_mesh, RowwiseParallel())
        for norm in (block.attn.q_norm, block.attn.k_norm):
            if norm is None:
                continue
            # per-head gains act on the head dimension, which is never split; a norm over the
            # whole projection needs every head: its input is all-gathered and its output split again
            distribute_module(norm, tp_mesh)
            if not block.attn.qk_norm_per_head:
                parallelize_module(norm, tp_mesh, PrepareModuleInputOutput(
                    input_layouts=(Shard(-1),), desired_input_layouts=(Replicate(),), use_local_input=False,
                    output_layouts=(Replicate(),), desired_output_layouts=(Shard(-1),), use_local_output=False))
        if not block.attn.pattern.plain:
            block.attn.attention = tensor_parallel_attention
        parallelize_module(
            block.mlp,
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
            ),
        )
        columns = (block.mlp.gate, block.mlp.up) if hasattr(block.mlp, "gate") else (block.mlp.up,)
        for linear in columns:
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


class ContextParallelAttention:
    """The attention callable a block runs under CP: this rank's queries against the whole sequence's keys."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        self.group = cp_mesh.get_group()
        self.cp_rank = cp_mesh.get_local_rank()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: AttentionPattern) -> torch.Tensor:
        q_local, k_local, v_local, heads = local_heads(q, k, v)
        t = q_local.shape[-2]
        start = self.cp_rank * t
        # one collective for both; keys past this chunk's end are masked for all its queries, so
        # they are dropped before attending (a sliding window masks the earlier ones too)
        kv = _GatherSequence.apply(torch.stack((k_local, v_local)), self.group)[..., : start + t, :]
        y = causal_attention(q_local, kv[0], kv[1], pattern, start, heads)
        return DTensor.from_local(y, q.device_mesh, q.placements) if heads is not None else y


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Make every block attend across the cp ranks' chunks; feed it `context_chunk`'s tokens."""
    attention: AttentionFn = ContextParallelAttention(cp_mesh)
    for block in all_blocks(model):
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


# outputs that selective checkpointing keeps: matmuls, fused attention (CPU and CUDA kernels) and
# TP's all-reduces (recomputing those would communicate again in backward)
SAVED_OPS = frozenset({
    _aten.mm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.all_reduce.default,
})


def _save_matmuls_and_attention(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, mode: Checkpointing = "full") -> None:
    """Recompute each block's activations in backward: all of them ("full"), all but `SAVED_OPS`'
    outputs ("selective"), or none."""
    if mode == "none":
        return
    context = {"selective": {"context_fn": partial(create_selective_checkpoint_contexts,
                                                   _save_matmuls_and_attention)}, "full": {}}[mode]
    for block in all_blocks(model):
        checkpoint(block, **context)


def mixed_precision(precision: Precision, cast_forward_inputs: bool = True) -> MixedPrecisionPolicy:
    """FSDP2's policy: bf16-mixed all-gathers bf16 weights for compute and reduce-scatters fp32
    gradients onto the fp32 master shards (the optimizer steps in fp32); fp32 is fp32 throughout."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                    cast_forward_inputs=cast_forward_inputs)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, precision: Precision = "fp32") -> None:
    """FSDP2: one all-gather unit per block, the rest (embeddings, final norm, head) at the root.

    Blocks do not cast their inputs: the hidden states arrive in bf16 from the bf16 embedding,
    and the RoPE tables stay fp32 (each rotation is computed in fp32, then cast). Casting would
    also break selective recomputation: FSDP's pre-forward hook runs before the checkpoint's in
    forward but inside its recompute, where the cast's profiler op is missing from SAC's cache."""
    for block in all_blocks(model):
        fully_shard(block, mesh=dp_mesh, mp_policy=mixed_precision(precision, cast_forward_inputs=False))
    fully_shard(model, mesh=dp_mesh, mp_policy=mixed_precision(precision))


def apply_ddp(model: Transformer, dp_mesh: DeviceMesh) -> None:
    replicate(model, device_mesh=dp_mesh)


def uses_fsdp(dims: ParallelDims, precision: Precision) -> bool:
    """Whether `parallelize` applies FSDP2: to shard over dp x cp, and under bf16-mixed also over a
    single dp rank, for its mixed-precision policy (bf16 compute copies of the fp32 weights, fp32
    gradients). Elsewhere bf16-mixed is autocast: one process, or DDP (`distributed.py`)."""
    return dims.dp_mode == "fsdp" and (dims.dp * dims.cp > 1 or precision == "bf16-mixed")


def parallelize(
    model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, checkpointing: Checkpointing = "none",
    precision: Precision = "fp32",
) -> nn.Module:
    """Apply TP -> CP -> activation checkpointing -> FSDP (with `precision`'s policy) or DDP (over
    dp x cp) to `model` in place; returns it. `model` may be on the meta device.

    With pp > 1 `model` is one of this rank's pipeline stages (`ParallelDims` allows only FSDP with it).
    """
    shape = (dims.pp, dims.dp, dims.cp, dims.tp)
    if mesh.mesh_dim_names != MESH_DIMS or tuple(mesh.shape) != shape:
        raise ValueError(f"mesh {mesh} does not match parallel dims (pp, dp, cp, tp) = {shape}")
    if dims.tp > 1:
        apply_tp(model, mesh["tp"])
    if dims.cp > 1:
        apply_context_parallel(model, mesh["cp"])
    apply_activation_checkpointing(model, checkpointing)
    # cp ranks hold the same weights but different tokens: their gradients are averaged too
    if uses_fsdp(dims, precision):
        apply_fsdp(model, dp_cp_mesh(mesh), precision)
    elif dims.dp * dims.cp > 1:
        apply_ddp(model, dp_cp_mesh(mesh))
    return model


def place_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's part of `full` (a parameter's whole value) into `param`: all of it for a
    plain tensor, its own slice for a DTensor (the slice is taken locally: no communication)."""
    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def init_weights(modules: Iterable[nn.Module], cfg: ModelConfig, source: WeightSource) -> None:
    """Fill the parallelised, materialised `modules` (a model, or a rank's pipeline stages) from
    `source`, each rank only its shards: the same full weights whatever the layout."""
    for module in modules:
        fill_weights(module, cfg, source, place_shard)


def build_parallel(cfg: ModelConfig, vocab_size: int, dims: ParallelDims, mesh: DeviceMesh, device: torch.device,
                   source: WeightSource | None, checkpointing: Checkpointing = "none",
                   precision: Precision = "fp32") -> tuple[nn.Module, list[TransformerStage]]:
    """This rank's part of the model in the `dims` layout, built on the meta device, parallelised,
    materialised on `device` and initialised from `source`; with `source=None` it stays on the
    meta device for the caller to materialise (`tasks.train.verify` does, on fake tensors).

    Returns (the module holding every parameter this rank trains, under the model's names: what
    the optimizer steps and checkpoints save; the pipeline stages this rank runs, [] without pp).
    """
    check_divisible(dims, cfg)
    model = Transformer(cfg, vocab_size, "meta")
    held, stages = pipeline_parts(model, mesh["pp"].get_local_rank(), dims) if dims.pp > 1 else (model, [model])
    for module in stages:
        parallelize(module, dims, mesh, checkpointing, precision)
        if source is not None:
            materialize(module, device)
    if source is not None:
        init_weights(stages, cfg, source)
    return held, stages if dims.pp > 1 else []


class TransformerStage(nn.Module):
    """The slice of a Transformer one pipeline stage runs: ids or hidden states in, hidden states or logits out.

    Its parameters keep the whole model's names: blocks are keyed by their index in the model
    (stage 1 of a 4-block model holds `blocks.2` and `blocks.3`), so the stages' checkpoints hold
    disjoint keys and load into any other layout, and back.
    """

    def __init__(self, model: Transformer, first: bool, last: bool, block_ids: Iterable[int]) -> None:
        super().__init__()
        self.tok_emb = model.tok_emb if first else None
        self.pos_emb = model.pos_emb if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in block_ids})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # the same computation as Transformer.forward without targets, restricted to this stage's modules
        t = h.shape[1]
        if self.tok_emb is not None:
            h = self.tok_emb(h)
            if self.pos_emb is not None:
                h = h + self.pos_emb.weight[:t]
        cos = sin = None
        if self.rope_cos is not None:
            cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for block in self.blocks.values():
            h = block(h, cos, sin)
        if self.lm_head is not None:
            h = self.lm_head(self.norm(h) if self.norm is not None else h)
        return h


class RankModules(nn.Module):
    """Every module a pipeline rank holds, under the whole model's names: what its optimizer
    steps, its checkpoints save and the final model gathers. Under the interleaved schedule a
    rank runs several non-adjacent stages (`TransformerStage`s over these same modules); this is
    not a stage itself and has no forward."""

    def __init__(self, stages: list[TransformerStage]) -> None:
        super().__init__()
        self.tok_emb = next((s.tok_emb for s in stages if s.tok_emb is not None), None)
        self.pos_emb = next((s.pos_emb for s in stages if s.pos_emb is not None), None)
        self.blocks = nn.ModuleDict({i: block for s in stages for i, block in s.blocks.items()})
        self.norm = next((s.norm for s in stages if s.norm is not None), None)
        self.lm_head = next((s.lm_head for s in stages if s.lm_head is not None), None)


def stage_blocks(n_layers: int, num_stages: int, stage: int) -> range:
    """The blocks of pipeline stage `stage` of `num_stages`: contiguous, the earlier stages taking any remainder."""
    per_stage, extra = divmod(n_layers, num_stages)
    begin = stage * per_stage + min(stage, extra)
    return range(begin, begin + per_stage + (1 if stage < extra else 0))


def pipeline_parts(model: Transformer, pp_rank: int, dims: ParallelDims) -> tuple[nn.Module, list[TransformerStage]]:
    """(what pp rank `pp_rank` holds, the stages it runs): stages pp_rank, pp_rank + pp, ... of
    `dims.num_stages` (torch's interleaved schedules place stage s on rank s mod pp)."""
    total = dims.num_stages
    ids = range(pp_rank, total, dims.pp)
    stages = [TransformerStage(model, s == 0, s == total - 1, stage_blocks(len(model.blocks), total, s)) for s in ids]
    return (stages[0] if len(stages) == 1 else RankModules(stages)), stages

