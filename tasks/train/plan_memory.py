"""The planner's memory model: the bytes one device holds at a training step's peak, for a layout.

It prices what Kiln's trainer allocates (`tasks.train.parallel`, `tasks.train.distributed`), term
by term, and `tasks.train.verify` measures the same layouts with torch's MemTracker:

- Model states, per rank: fp32 master weights, fp32 gradients and AdamW's two fp32 moments of the
  rank's shards. TP splits each block's seven matmul weights; norms, embeddings and the head stay
  replicated over tp. FSDP2 shards every tensor's first dimension over dp x cp, padded up to a
  multiple of it.
- Working copies: under bf16-mixed FSDP2 all-gathers bf16 weights. Outside a pipeline the root
  (embeddings, final norm, head) stays unsharded for the whole step, the block computing and the
  one prefetched are unsharded, and a block's backward holds its bf16 gradients and their fp32
  copy for the reduce-scatter; the head's gradient lives from the first backward op to the last.
  In a pipeline, torch's `PipelineStage` keeps a stage unsharded and unsynchronised until its
  last backward, accumulating fp32 gradients of the whole stage. fp32 FSDP gathers fp32 copies
  and needs no cast. One process under bf16-mixed runs autocast on its fp32 weights, whose bf16
  casts autograd keeps for every block it does not recompute.
- Activations, per token of a micro-batch, counted tensor by tensor as autograd saves them (the
  method of Korthikanti et al. 2022, applied to Kiln's block; `activation_bytes_per_layer`), times
  the layers and micro-batches in flight: one outside a pipeline; under a pipeline schedule as
  many as torch's schedule runs before it can run a backward (`in_flight`).
- The head: the final norm's saved tensors, the fp32 log-softmax, the token ids, and at the start
  of backward the fp32 gradient of the logits and its cast.

The peak is taken at the start of the last micro-batch's backward (everything saved is alive;
earlier micro-batches' gradients are already reduced into the shards), or at the end of the
step's backward when the gradients and the root's reduction outweigh the activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kiln.tasks.train.config import Checkpointing, ModelConfig, PipelineSchedule, Precision
from kiln.tasks.train.loss import chunk_rows

STAT_BYTES = 4  # RMSNorm's 1/rms and attention's log-sum-exp stay fp32 under bf16
TOKEN_ID_BYTES = 8  # int64 ids, kept by the embedding and the loss
Compute = Literal["fp32", "bf16", "autocast"]


@dataclass(frozen=True)
class CandidateLayout:
    """One point of the planner's search space: a parallel shape, a micro-batch, a recompute choice
    and, with pp > 1, a pipeline schedule.

    Not `tasks.train.distributed.Layout`, the running process's place in a live mesh: this is a
    description to score, and `ParallelDims` plus `run.batch_size` / `run.activation_checkpointing`
    are what a chosen one becomes in the config.
    """

    dp: int
    tp: int
    pp: int
    cp: int
    micro_batch: int  # sequences per forward pass per dp rank
    checkpointing: Checkpointing
    schedule: PipelineSchedule = "1f1b"
    stages_per_rank: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shard(self) -> int:
        """FSDP shards over dp and cp together: cp ranks hold the same weights."""
        return self.dp * self.cp

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def describe(self) -> str:
        pipeline = f" schedule={self.schedule}" if self.pp > 1 else ""
        if self.stages_per_rank > 1:
            pipeline += f"x{self.stages_per_rank}"
        return (f"dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp} micro-batch={self.micro_batch} "
                f"checkpointing={self.checkpointing}{pipeline}")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device holds at the step's peak (`rank`: the pipeline rank this is for)."""

    params: int  # fp32 master shards
    grads: int  # fp32 gradient shards alive at the peak
    optimizer: int  # AdamW's moments and step counters
    working: int  # unsharded or cast copies of weights and their gradients
    activations: int  # saved by the blocks, for every micro-batch in flight, plus a recompute's working set
    head: int  # saved by the final norm and the loss, and the logits' gradient
    reserved: int  # CUDA context, communication buffers, fragmentation: the cluster's reserve
    rank: int = 0

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.model_states + self.working + self.activations + self.head + self.reserved

    @property
    def tracked(self) -> int:
        """What torch's memory tracking sees: all but the reserve."""
        return self.total - self.reserved


def compute_path(layout: CandidateLayout, precision: Precision) -> Compute:
    """How the trainer computes: fp32 throughout; FSDP2's bf16 copies (bf16-mixed on more than
    one device, which always applies FSDP2); or autocast on fp32 weights (one device)."""
    if precision == "fp32":
        return "fp32"
    return "autocast" if layout.world_size == 1 else "bf16"


# ---- parameters -----------------------------------------------------------------------------


def block_tensors(cfg: ModelConfig, tp: int) -> list[tuple[int, int]]:
    """(rows, columns) of one block's parameters as a TP rank holds them (norms replicated)."""
    d, kv, f = cfg.d_model, cfg.kv_dim, cfg.ffn_hidden
    mlp = [(f // tp, d), (f // tp, d), (d, f // tp)] if cfg.mlp == "swiglu" else [(f // tp, d), (d, f // tp)]
    tensors = [(d // tp, d), (kv // tp, d), (kv // tp, d), (d, d // tp), *mlp, (d, 1), (d, 1)]  # + two norms
    if cfg.qk_norm:
        tensors += [(cfg.head_dim, 1)] * 2 if cfg.qk_norm_scope == "head" else [(d, 1), (kv, 1)]
    return tensors


def matmul_elements(cfg: ModelConfig, tp: int) -> int:
    """Elements of one block's matmul weights as a TP rank holds them (what autocast casts)."""
    return sum(rows * cols for rows, cols in block_tensors(cfg, tp) if cols > 1)


def stage_layers(cfg: ModelConfig, layout: CandidateLayout, pp_rank: int) -> list[int]:
    """The block counts of the pipeline stages rank `pp_rank` runs (contiguous splits, earlier
    stages taking the remainder: `tasks.train.parallel.stage_blocks`)."""
    per_stage, extra = divmod(cfg.n_layers, layout.num_stages)
    return [per_stage + (1 if s < extra else 0) for s in range(pp_rank, layout.num_stages, layout.pp)]


def stage_block_ids(cfg: ModelConfig, layout: CandidateLayout, pp_rank: int) -> list[range]:
    """The blocks of each pipeline stage rank `pp_rank` runs, as `stage_layers` counts them."""
    per_stage, extra = divmod(cfg.n_layers, layout.num_stages)
    out = []
    for s in range(pp_rank, layout.num_stages, layout.pp):
        begin = s * per_stage + min(s, extra)
        out.append(range(begin, begin + per_stage + (1 if s < extra else 0)))
    return out


def root_tensors(cfg: ModelConfig, vocab_size: int, layout: CandidateLayout, pp_rank: int) -> list[tuple[int, int]]:
    """The embeddings, final norm and head this rank holds: the first stage's embedding (and
    learned positions), the last stage's norm (none after post-norm blocks), head (a second V x d
    matrix unless tied on one stage) and multi-token prediction heads' norms."""
    tensors = []
    final_norm = [(cfg.d_model, 1)] if cfg.norm_placement != "post" else []
    if pp_rank == 0:
        tensors.append((vocab_size, cfg.d_model))
        if cfg.position == "learned":
            tensors.append((cfg.max_seq_len, cfg.d_model))
    if pp_rank == layout.pp - 1:
        tensors += final_norm
        if layout.pp > 1 or not cfg.tie_embeddings:
            tensors.append((vocab_size, cfg.d_model))
        tensors += final_norm * cfg.mtp_heads
    return tensors


def rank_blocks(cfg: ModelConfig, layout: CandidateLayout, pp_rank: int) -> int:
    """Blocks rank `pp_rank` holds: its stages' and, on the last, the multi-token prediction heads'."""
    return sum(stage_layers(cfg, layout, pp_rank)) + (cfg.mtp_heads if pp_rank == layout.pp - 1 else 0)


def rank_tensors(cfg: ModelConfig, vocab_size: int, layout: CandidateLayout, pp_rank: int) -> list[tuple[int, int]]:
    return root_tensors(cfg, vocab_size, layout, pp_rank) + block_tensors(cfg, layout.tp) * rank_blocks(cfg, layout,
                                                                                                           pp_rank)


def _sharded(tensors: list[tuple[int, int]], shard: int) -> int:
    """Elements a rank allocates for its FSDP shards: each first dimension padded to a multiple of `shard`."""
    return sum(-(-rows // shard) * cols for rows, cols in tensors)


def _elements(tensors: list[tuple[int, int]]) -> int:
    return sum(rows * cols for rows, cols in tensors)


def rank_parameters(cfg: ModelConfig, vocab_size: int, layout: CandidateLayout, pp_rank: int = 0) -> int:
    """Parameter elements pipeline rank `pp_rank` allocates (its TP slice, its FSDP shard)."""
    return _sharded(rank_tensors(cfg, vocab_size, layout, pp_rank), layout.shard)


# ---- activations ----------------------------------------------------------------------------


def activation_bytes_per_layer(cfg: ModelConfig, micro_batch: int, seq_len: int, tp: int = 1, cp: int = 1,
                               checkpointing: Checkpointing = "none", compute: Compute = "bf16", layer: int = 0) -> int:
    """Bytes block `layer` keeps for backward for one micro-batch, counted per saved tensor (measured
    exactly on CPU for every architecture option: tests/tasks/train/test_planner.py), with
    d = d_model, kv = K/V width, f = MLP width, h = query heads, per token, for Llama's block
    (pre-RMSNorm, RoPE, SwiGLU):
      none, fp32: 4(6d + (2d + 2kv + 4f) / tp) + 4(2 + h/tp): replicated over tp the block input,
            the two norms' normalised input and output, the residual; split by heads the rotated q
            and k, v, the attention output and its re-laid-out copy, gate, up, silu(gate) and its
            product with up; fp32 1/rms of both norms and attention's log-sum-exp per head.
      none, bf16 (FSDP2's copies): the same tensors in bf16, but each RMSNorm computes in fp32 and
            keeps two fp32 d-vectors: 2(2d + (2d + 2kv + 4f) / tp) + 16d + 4(2 + h/tp).
      none, autocast (fp32 weights, one device): fp32 residual stream and norms, bf16 matmul
            inputs cast per use: 2(7d + 2kv + 4f) + 16d + 4(2 + h).
      and per micro-batch, not per token, RoPE's full-width cos and sin tables for q and for k
            (`_apply_rope`): 4 [T, head_dim] in fp32 (FSDP2 casts the weights, not these buffers).
      selective: the block input (in the residual stream's dtype r) and the outputs of the saved
            ops in the compute dtype c: wq, wk, wv, attention (and its fp32 log-sum-exp), proj,
            gate, up, down, and under TP the two all-reduces:
            r d + c((2d + 2kv + 2f) / tp + 2d + [tp > 1] 2d) + 4h / tp.
      full: the block input only, r d.
    The options change it without recompute only (selective recomputes what they add, except a
    GELU MLP's missing gate: c f / tp less):
      a per-head QK-norm: q is kept a second time (the norm's input and its output), c d / tp more;
      no RoPE (nope, learned, alibi): no cos and sin tables;
      a GELU MLP: two of SwiGLU's four f-vectors, and under autocast one bf16 cast of its input fewer;
      LayerNorm: a norm keeps its input and mean and 1/std (fp32, autocast: 4d + 8; bf16: 2d + 8)
            where RMSNorm keeps two vectors and 1/rms; post and reordered placements keep the same
            tensors, but a reordered LayerNorm under autocast normalises a bf16 matmul output: 2d less;
      QK-norm over n features in r rows per token (per head: q has n = d, r = h; k n = kv, r = h_kv;
            over the projection r = 1, and under TP n is whole, its input gathered): RMSNorm 8n + 4r,
            LayerNorm 4n + 8r (fp32), 2n + 4r (bf16), 2n + 8r (autocast);
      a mask, per micro-batch, in the compute dtype: a sliding window's [T, T] and ALiBi's biases
            [h / tp, T, T] (a window with ALiBi: the biases alone).
    Context parallel splits the tokens cp ways, but without recompute each rank keeps the whole
    sequence's gathered K and V (2kv per token of the other chunks too) and attention's mask
    (its chunk's queries by the keys up to its end, the last rank's all seq_len, or ALiBi's per head).
    """
    d, kv, f, h = cfg.d_model, cfg.kv_dim, cfg.ffn_hidden, cfg.n_heads
    c = 4 if compute == "fp32" else 2
    r = 2 if compute == "bf16" else 4
    gelu = cfg.mlp == "gelu"
    tokens = micro_batch * seq_len // cp
    if checkpointing == "full":
        return tokens * r * d
    if checkpointing == "selective":
        mlp_outputs = f if gelu else 2 * f
        return tokens * (r * d + c * (-(-(2 * d + 2 * kv + mlp_outputs) // tp) + 2 * d + (2 * d if tp > 1 else 0))
                         + -(-STAT_BYTES * h // tp))
    # attention keeps the projection's q itself unless a per-head QK-norm makes q anew (RoPE's
    # rotation keeps no copy of its input: it saves only its tables)
    rotated = cfg.qk_norm and cfg.qk_norm_scope == "head"
    split = (3 if rotated else 2) * d + 2 * kv + (2 if gelu else 4) * f
    stats = STAT_BYTES * 2 + -(-STAT_BYTES * h // tp)
    per_token = {"fp32": 4 * (6 * d) + -(-4 * split // tp) + stats,
                 "bf16": 2 * (2 * d) + -(-2 * split // tp) + 16 * d + stats,
                 "autocast": 2 * ((8 if rotated else 7) * d + 2 * kv + (2 if gelu else 4) * f
                                  - (d if gelu else 0)) + 16 * d + stats}[compute]
    per_token += 2 * _norm_delta(cfg, compute) + _qk_norm_bytes(cfg, tp, compute)
    gathered_kv = -(-c * 2 * kv * (micro_batch * seq_len - tokens) // tp) if cp > 1 else 0
    # fp32 in every precision: FSDP2's mixed precision casts parameters, not buffers
    rope_tables = 4 * (seq_len // cp) * cfg.head_dim * 4 if cfg.position == "rope" else 0
    return tokens * per_token + gathered_kv + _mask_bytes(cfg, layer, seq_len, tp, cp, compute) + rope_tables


def _norm_delta(cfg: ModelConfig, compute: Compute) -> int:
    """Bytes per token one LayerNorm of the block keeps beyond what an RMSNorm keeps."""
    if cfg.norm == "rmsnorm":
        return 0
    d = cfg.d_model
    if compute == "bf16":
        return -6 * d
    return -4 * d + STAT_BYTES - (2 * d if compute == "autocast" and cfg.norm_placement == "reordered" else 0)


def _qk_norm_bytes(cfg: ModelConfig, tp: int, compute: Compute) -> int:
    """Bytes per token the QK-norms keep (see `activation_bytes_per_layer`)."""
    if not cfg.qk_norm:
        return 0
    if cfg.qk_norm_scope == "head":
        parts = [(-(-cfg.d_model // tp), -(-cfg.n_heads // tp)), (-(-cfg.kv_dim // tp), -(-cfg.kv_heads // tp))]
    else:
        parts = [(cfg.d_model, 1), (cfg.kv_dim, 1)]
    per_feature, per_row = (8, 4) if cfg.norm == "rmsnorm" else {"fp32": (4, 8), "bf16": (2, 4), "autocast": (2, 8)}[compute]
    return sum(per_feature * n + per_row * rows for n, rows in parts)


def _mask_bytes(cfg: ModelConfig, layer: int, seq_len: int, tp: int, cp: int, compute: Compute) -> int:
    """The attention mask block `layer` keeps per micro-batch: none for full causal attention from
    position 0 (the fused kernel's own causal path); [queries, keys] for a window or a context-parallel
    chunk, per head for ALiBi (the last cp rank's: its queries see every key)."""
    window, alibi = cfg.window(layer), cfg.position == "alibi"
    if window is None and not alibi and cp == 1:
        return 0
    heads = -(-cfg.n_heads // tp) if alibi else 1
    return (4 if compute == "fp32" else 2) * heads * (seq_len // cp) * seq_len


def blocks_activation_bytes(cfg: ModelConfig, layers: range, micro_batch: int, seq_len: int, tp: int = 1,
                            cp: int = 1, checkpointing: Checkpointing = "none", compute: Compute = "bf16") -> int:
    """`activation_bytes_per_layer` summed over the blocks `layers` (local and global ones differ)."""
    per_layer = {cfg.window(i): activation_bytes_per_layer(cfg, micro_batch, seq_len, tp, cp, checkpointing, compute, i)
                 for i in layers}
    return sum(per_layer[cfg.window(i)] for i in layers)


def mtp_activation_bytes(cfg: ModelConfig, vocab_size: int, micro_batch: int, seq_len: int, tp: int = 1,
                         checkpointing: Checkpointing = "none", compute: Compute = "bf16") -> int:
    """Bytes the multi-token prediction heads keep for one micro-batch (measured exactly on CPU):
    each a full-attention block over the trunk's output (kept already, as the final norm's input;
    the block's own output takes its place in the count), its norm over every position, the
    fused loss over the T - k - 1 positions it scores, and its loss scalar. Two departures, as
    torch keeps them: after post-norm blocks the head's output feeds the loss directly and is not
    kept (except under autocast without recompute, whose cast keeps it); an RMSNorm after a
    recomputed block keeps 2d less in bf16, and after a reordered one (not recomputed) 2d less in
    bf16 and 4d more under autocast."""
    if not cfg.mtp_heads:
        return 0
    r = 2 if compute == "bf16" else 4
    full = cfg.model_copy(update={"sliding_window": None, "global_every": None})
    tokens = micro_batch * seq_len
    block = activation_bytes_per_layer(full, micro_batch, seq_len, tp, 1, checkpointing, compute)
    if cfg.norm_placement == "post" and not (compute == "autocast" and checkpointing == "none"):
        block -= tokens * r * cfg.d_model
    norm = _head_norm_bytes(cfg, compute)
    if compute == "bf16" and cfg.norm == "rmsnorm" and cfg.norm_placement != "post" and checkpointing != "none":
        norm -= 2 * cfg.d_model
    if cfg.norm_placement == "reordered" and cfg.norm == "rmsnorm" and checkpointing == "none":
        # the block ends in a norm's output added to the stream: measured 2d less in bf16, 4d more under autocast
        norm += {"fp32": 0, "bf16": -2 * cfg.d_model, "autocast": 4 * cfg.d_model}[compute]
    return sum(block + tokens * norm + fused_loss_bytes(cfg, vocab_size, micro_batch * (seq_len - k - 1), compute)
               + STAT_BYTES for k in range(cfg.mtp_heads))


def _head_norm_bytes(cfg: ModelConfig, compute: Compute) -> int:
    """Per token, what a head's final norm keeps beyond its input, statistics included."""
    if cfg.norm_placement == "post":
        return 0
    d = cfg.d_model
    if cfg.norm == "rmsnorm":
        return {"fp32": 4 * d, "bf16": 8 * d, "autocast": 4 * d}[compute] + STAT_BYTES
    return {"fp32": 2 * STAT_BYTES, "bf16": STAT_BYTES, "autocast": 2 * STAT_BYTES}[compute]


def fused_loss_bytes(cfg: ModelConfig, vocab_size: int, tokens: int, compute: Compute) -> int:
    """What `tasks.train.loss.linear_cross_entropy` keeps over `tokens` positions: the gradient of
    the hidden states (in the compute dtype) and of the output projection (fp32 on fp32 weights,
    bf16 on FSDP2's copies and under autocast)."""
    c = 4 if compute == "fp32" else 2
    return c * tokens * cfg.d_model + c * vocab_size * cfg.d_model


def head_activation_bytes(cfg: ModelConfig, vocab_size: int, micro_batch: int, seq_len: int, cp: int = 1,
                          compute: Compute = "bf16", fused: bool = True) -> int:
    """Bytes the final norm and the loss keep for one micro-batch (the head is replicated over tp):
    the norm's input (the residual stream), what the norm keeps beyond it (RMSNorm: 4d and 1/rms in
    fp32 and under autocast, two fp32 d-vectors in bf16; LayerNorm its mean and 1/std; nothing
    after post-norm blocks, which have no final norm), the token ids, and the loss's: the fused
    loss's gradients (`fused_loss_bytes`) and its two scalars, or on a pipeline's last stage,
    which computes logits, the norm's output kept by the output projection and the fp32
    log-softmax (4V)."""
    d = cfg.d_model
    tokens = micro_batch * seq_len // cp
    r = 2 if compute == "bf16" else 4
    kept = tokens * (r * d + _head_norm_bytes(cfg, compute) + TOKEN_ID_BYTES)
    if fused:
        return kept + fused_loss_bytes(cfg, vocab_size, tokens, compute) + 2 * STAT_BYTES
    # the projection keeps its input: the norm's output, or after post-norm blocks the stream
    # itself (counted), but for autocast's bf16 cast of it
    output = (4 if compute == "fp32" else 2) * d if cfg.norm_placement != "post" else (2 * d if compute == "autocast" else 0)
    return kept + tokens * (output + 4 * vocab_size)


def head_gradient_bytes(vocab_size: int, micro_batch: int, seq_len: int, cp: int = 1, fused: bool = True) -> int:
    """The first backward op's transient: the log-softmax's fp32 output gradient and input gradient
    (none for the fused loss, whose gradients exist since forward: see `fused_loss_transient`)."""
    return 0 if fused else micro_batch * seq_len // cp * vocab_size * 8


def fused_loss_transient(cfg: ModelConfig, vocab_size: int, tokens: int, compute: Compute) -> int:
    """What the fused loss holds for a moment in forward beyond what it keeps, measured with
    MemTracker at three shapes: a chunk of `tasks.train.loss.chunk_rows` rows' logits and fp32
    log-softmax (8 bytes per logit in fp32; 10 from bf16 logits, whose log-softmax is computed
    from an fp32 copy), on bf16 weights half of the fp32 sum of the projection's gradient beyond
    its bf16 copy (2Vd), and under autocast the bf16 casts of the hidden states and the weight."""
    rows, d = min(chunk_rows(vocab_size), tokens), cfg.d_model
    if compute == "fp32":
        return 8 * rows * vocab_size
    casts = 2 * (tokens + vocab_size) * d if compute == "autocast" else 0
    return 10 * rows * vocab_size + 2 * vocab_size * d + casts


def in_flight(layout: CandidateLayout, num_microbatches: int, pp_rank: int) -> int:
    """Micro-batch x stage activations pipeline rank `pp_rank` holds at most, as torch's schedule
    runs it (checked against the schedules' own `pipeline_order` in tests): every micro-batch
    under GPipe; pp - rank under 1F1B (its warm-up forwards, plus the one before its first
    backward); under interleaved 1F1B, one more than its warm-up of (v - 1) rounds of
    micro-batches plus 2 (pp - 1 - rank), in units of one virtual stage."""
    if layout.pp == 1:
        return 1
    if layout.schedule == "gpipe":
        return num_microbatches
    if layout.schedule == "1f1b":
        return min(layout.pp - pp_rank, num_microbatches)
    v = layout.stages_per_rank
    per_round = num_microbatches // max(1, num_microbatches // layout.pp)
    warmup = min((v - 1) * per_round + 2 * (layout.pp - 1 - pp_rank), num_microbatches * v)
    return min(warmup + 1, num_microbatches * v)


# ---- the estimate ---------------------------------------------------------------------------


def estimate_memory(cfg: ModelConfig, vocab_size: int, seq_len: int, layout: CandidateLayout, num_microbatches: int,
                    reserved_bytes: int, precision: Precision = "bf16-mixed") -> MemoryEstimate:
    """Peak bytes per device for `layout`: the larger of the first and the last pipeline rank
    (the first holds the embedding and the most micro-batches in flight, the last the head)."""
    ranks = {0, layout.pp - 1}
    estimates = [rank_memory(cfg, vocab_size, seq_len, layout, num_microbatches, reserved_bytes, precision, r)
                 for r in sorted(ranks)]
    return max(estimates, key=lambda e: e.total)


def rank_memory(cfg: ModelConfig, vocab_size: int, seq_len: int, layout: CandidateLayout, num_microbatches: int,
                reserved_bytes: int, precision: Precision, pp_rank: int) -> MemoryEstimate:
    """Peak bytes of pipeline rank `pp_rank`: the largest of three moments (see the module
    docstring for what each term holds): the loss's backward (everything saved is alive, plus the
    logits' gradient), a block's backward (the head freed, the block's working copies and, with
    recompute, its recomputed activations), and the end of backward (every gradient shard)."""
    lo, compute = layout, compute_path(layout, precision)
    tensors = rank_tensors(cfg, vocab_size, lo, pp_rank)
    params = _sharded(tensors, lo.shard)
    fsdp = compute == "bf16" or lo.shard > 1  # FSDP2 is applied (bf16-mixed applies it on any mesh)
    a = 4 if compute == "fp32" else 2
    cast = 4 if a == 2 else 0  # bf16 gradients are reduced in fp32
    block = _elements(block_tensors(cfg, lo.tp))
    root = _elements(root_tensors(cfg, vocab_size, lo, pp_rank))
    stages = stage_block_ids(cfg, lo, pp_rank)
    blocks = rank_blocks(cfg, lo, pp_rank)
    last_stage = pp_rank == lo.pp - 1
    head_weight = vocab_size * cfg.d_model if last_stage else 0
    matmuls = matmul_elements(cfg, lo.tp)

    flying = in_flight(lo, num_microbatches, pp_rank)
    # a rank's virtual stages take turns: its in-flight units are its stages (the largest one);
    # local and global blocks keep different masks, so each stage is summed block by block
    stage_bytes = [blocks_activation_bytes(cfg, ids, lo.micro_batch, seq_len, lo.tp, lo.cp, lo.checkpointing, compute)
                   for ids in stages]
    per_unit = max(stage_bytes) if lo.stages_per_rank > 1 else sum(stage_bytes)
    recompute = max(activation_bytes_per_layer(cfg, lo.micro_batch, seq_len, lo.tp, lo.cp, "none", compute, i)
                    for ids in stages for i in ids) if lo.checkpointing != "none" else 0
    # the last stage runs each micro-batch's backward right after its forward, except under GPipe
    head_flying = num_microbatches if lo.pp > 1 and lo.schedule == "gpipe" else 1
    # outside a pipeline the model computes its loss fused with the output projection
    fused = lo.pp == 1
    head_act = 0
    if last_stage:
        head_act = head_activation_bytes(cfg, vocab_size, lo.micro_batch, seq_len, lo.cp, compute, fused) \
            + mtp_activation_bytes(cfg, vocab_size, lo.micro_batch, seq_len, lo.tp, lo.checkpointing, compute)
    head_grad = 0
    if last_stage:
        head_grad = fused_loss_transient(cfg, vocab_size, lo.micro_batch * seq_len // lo.cp, compute) if fused \
            else head_gradient_bytes(vocab_size, lo.micro_batch, seq_len, lo.cp, fused=False)
    # the largest number in flight recurs after a backward (with gradients) unless every forward precedes it
    steady = flying < num_microbatches * lo.stages_per_rank

    optimizer = 8 * params + STAT_BYTES * len(tensors)
    grads_before = 4 * params if (num_microbatches > 1 and (not fsdp or lo.pp == 1) and (steady or lo.pp == 1)) else 0
    if compute == "autocast":  # bf16 casts of the weights, kept for each block not recomputed
        kept_casts = 2 * (matmuls * (blocks if lo.checkpointing == "none" else 0) + head_weight)
        head_working, block_working = kept_casts, kept_casts + (2 * matmuls if recompute else 0)
    elif not fsdp:
        head_working = block_working = 0
    elif lo.pp > 1:  # unsharded and unsynchronised until its last backward: fp32 gradients accumulate
        stage = root + block * blocks
        accumulated = 4 * stage if steady else 0
        head_working = a * stage + accumulated
        # a backward's fresh gradients before they join the fp32 sums: a block's, or the embedding's or head's
        block_working = a * stage + 4 * stage + a * max(block, root)
    else:  # the root unsharded all step; in a block's backward its params (and the next's, prefetched),
        # its bf16 gradients and their fp32 copy, and the head's gradient
        head_working = a * root
        block_working = a * (root + head_weight) + 2 * a * block + (a + cast) * block

    def moment(grads: int, working: int, activations: int, head: int) -> MemoryEstimate:
        return MemoryEstimate(4 * params, grads, optimizer, working, activations, head, reserved_bytes, pp_rank)

    at_head = moment(grads_before, head_working, flying * per_unit, head_flying * head_act + head_grad)
    at_blocks = moment(grads_before, block_working, flying * per_unit + recompute, (head_flying - 1) * head_act)
    if lo.pp > 1 and not steady and fsdp:  # GPipe: after the first backward, gradients and one micro-batch fewer
        at_blocks = moment(0, block_working, (flying - 1) * per_unit + recompute, (head_flying - 1) * head_act)
    at_end = moment(4 * params, (a + cast) * root if fsdp and lo.pp == 1 else 0, 0, 0)
    return max(at_head, at_blocks, at_end, key=lambda e: e.total)
