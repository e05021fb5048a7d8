"""The parallelism planner: pick dp x tp x pp x cp, micro-batch and activation checkpointing for a run.

Given a model shape, a global batch and a cluster (`ClusterSpec`, owned by `tasks.launch.cluster`),
every legal `CandidateLayout` is scored by an analytic memory model (per device, worst pipeline
stage) and a step-time model (compute at an assumed MFU plus the communication each parallelism
adds); layouts that do not fit are rejected with the reason, the rest are ranked by step time, and
`render_plan_report` explains the choice.

Conventions the formulas assume (those of torchtitan): FSDP2 / ZeRO-3 shards the fp32 master
weights, fp32 gradients and both Adam moments (16 bytes per parameter) over the dp x cp ranks and
all-gathers one layer at a time in the compute dtype; tensor parallelism uses sequence parallelism,
so every activation is split tp ways; context parallelism splits the sequence cp ways and passes
K/V around a ring; pipelines run 1F1B, so the first stage holds `min(pp, micro-batches)`
micro-batches in flight. The rank mesh is [pp, dp, cp, tp] with tp innermost, which decides
whether a group talks over the intra-node or the inter-node link.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import ValidationError

from tasks.configbase import Section, read_yaml
from tasks.errors import ConfigError
from tasks.launch.cluster import ClusterSpec
from tasks.train.config import ModelConfig, ParallelDims, TrainRunConfig
from tasks.train.model import count_parameters, flops_per_token

Checkpointing = Literal["none", "selective", "full"]
Precision = Literal["bf16-mixed", "fp32"]

CHECKPOINTING: tuple[Checkpointing, ...] = ("none", "selective", "full")
GIB = 2**30
STATE_BYTES_PER_PARAM = 16  # fp32 weights (the master copy) + fp32 grads + Adam m and v
ACT_BYTES = {"bf16-mixed": 2, "fp32": 4}
STAT_BYTES = 4  # RMSNorm's 1/rms and attention's log-sum-exp stay fp32 under autocast
TOKEN_ID_BYTES = 8  # int64 ids, kept by the embedding and the loss
MAX_MICRO_BATCH = 64
RANK_RESOLUTION = 0.01  # step times closer than this are a tie: the model is not that precise
SHOWN_SHAPES = 10


S = TypeVar("S", bound=Section)
PRESETS_DIR = Path(__file__).resolve().parents[2] / "configs"
PRESET_FOLDERS = {"ModelConfig": "models", "ClusterSpec": "clusters"}


def load_preset(name_or_path: str, cls: type[S]) -> S:
    """A preset by name (`7b` -> configs/models/7b.yaml, `h100-1node` -> configs/clusters/...) or by path."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        folder = PRESETS_DIR / PRESET_FOLDERS[cls.__name__]
        path = folder / f"{name_or_path}.yaml"
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
            raise ConfigError(f"no {cls.__name__} preset named {name_or_path!r}: use one of {known}, or a .yaml path")
    return load_section_file(path, cls)


def load_section_file(path: Path, cls: type[S]) -> S:
    """A `cls` read from a YAML mapping (a `configs/models/*.yaml` or `configs/clusters/*.yaml`)."""
    if not path.is_file():
        raise ConfigError(f"{path} does not exist (presets live in configs/models/ and configs/clusters/)")
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of {cls.__name__} fields, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise ConfigError(f"{path}: invalid {cls.__name__}: {problems}") from None


# ----------------------------------------------------------------------------------------------
# Memory model


def layer_parameters(cfg: ModelConfig) -> int:
    """Parameters of one transformer block (attention, SwiGLU, two RMSNorm gains)."""
    return (count_parameters(cfg, 1) - cfg.d_model * (1 if cfg.tie_embeddings else 2) - cfg.d_model) // cfg.n_layers


def stage_parameters(cfg: ModelConfig, vocab_size: int, tp: int = 1, pp: int = 1) -> int:
    """Parameters held by one tp rank of the largest pipeline stage.

    With pp > 1 the first stage holds the embedding and the last the output head (each its own copy
    when tied); both are V x d, so either is the largest.
    """
    if pp == 1:
        held = count_parameters(cfg, vocab_size)
    else:
        held = cfg.n_layers // pp * layer_parameters(cfg) + vocab_size * cfg.d_model + cfg.d_model
    return -(-held // tp)


def model_state_bytes(cfg: ModelConfig, vocab_size: int, shard: int = 1, tp: int = 1, pp: int = 1) -> int:
    """fp32 weights, grads and Adam moments per device, sharded over `shard` (dp x cp) ranks."""
    return STATE_BYTES_PER_PARAM * -(-stage_parameters(cfg, vocab_size, tp, pp) // shard)


def gathered_param_bytes(cfg: ModelConfig, shard: int = 1, tp: int = 1, precision: Precision = "bf16-mixed") -> int:
    """FSDP's unsharded working set: the layer computing, the one prefetched, and one layer's grads.

    A pure-fp32 run on one rank computes on its master weights directly, so it needs none.
    """
    if precision == "fp32" and shard == 1:
        return 0
    return 3 * ACT_BYTES[precision] * -(-layer_parameters(cfg) // tp)


def activation_bytes_per_layer(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    tp: int = 1,
    cp: int = 1,
    checkpointing: Checkpointing = "none",
    precision: Precision = "bf16-mixed",
) -> int:
    """Bytes one block keeps for backward for one micro-batch (Korthikanti et al. 2022 accounting).

    Korthikanti's method (count every tensor autograd saves) applied to Kiln's block rather than
    GPT-3's, per token, with d = d_model, f = SwiGLU hidden, h = heads, a = activation bytes:
      none: a(11d + 4f) + 4(2 + h): block input, normed x and its product with the gain, rotated q
            and k, v, attention output and its re-laid-out copy, the residual, the second norm's two,
            gate and up outputs (2f), silu(gate) (f), silu*up (f), plus two fp32 1/rms and the fp32
            log-sum-exp per head (RoPE multiplies by constant tables, so the unrotated q and k are not
            kept). Fused attention keeps no T x T scores, so Korthikanti's 5as/h term is absent.
      selective: the attention core (RoPE + attention) is recomputed: it keeps the unrotated q and
            k instead of the rotated ones and drops the attention output and log-sum-exp: a(10d + 4f) + 8.
      full: only the block input, a d; the block is recomputed in backward.
    Sequence parallelism splits all of it tp ways, context parallelism splits tokens cp ways, but
    Kiln's all-gather context parallel also keeps the other cp - 1 chunks' keys and values (2d per
    token of theirs) for backward, unless the block is recomputed.
    """
    d, f, h, a = cfg.d_model, cfg.ffn_hidden, cfg.n_heads, ACT_BYTES[precision]
    per_token = {
        "none": a * (11 * d + 4 * f) + STAT_BYTES * (2 + h),
        "selective": a * (10 * d + 4 * f) + STAT_BYTES * 2,
        "full": a * d,
    }[checkpointing]
    tokens = micro_batch * seq_len // cp
    gathered_kv = a * 2 * d * (micro_batch * seq_len - tokens) if checkpointing != "full" else 0
    return -(-(tokens * per_token + gathered_kv) // tp)


def head_activation_bytes(
    cfg: ModelConfig, vocab_size: int, micro_batch: int, seq_len: int, tp: int = 1, cp: int = 1,
    precision: Precision = "bf16-mixed",
) -> int:
    """Bytes kept outside the blocks: final norm (3 d-vectors and 1/rms), fp32 log-softmax, token ids."""
    a = ACT_BYTES[precision]
    tokens = micro_batch * seq_len // cp
    return tokens * (-(-(a * 3 * cfg.d_model + 4 * vocab_size) // tp) + STAT_BYTES + TOKEN_ID_BYTES)


@dataclass(frozen=True)
class CandidateLayout:
    """One point of the planner's search space: a parallel shape, a micro-batch and a recompute choice.

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

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shard(self) -> int:
        """FSDP shards over dp and cp together: cp ranks hold the same weights."""
        return self.dp * self.cp

    def describe(self) -> str:
        return (f"dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp} micro-batch={self.micro_batch} "
                f"checkpointing={self.checkpointing}")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device on the worst pipeline stage."""

    model_states: int
    gathered_params: int
    activations: int  # blocks, times the micro-batches in flight, plus the recompute working set
    head_activations: int
    reserved: int

    @property
    def total(self) -> int:
        return self.model_states + self.gathered_params + self.activations + self.head_activations + self.reserved


def estimate_memory(
    cfg: ModelConfig, vocab_size: int, seq_len: int, layout: CandidateLayout, num_microbatches: int,
    cluster: ClusterSpec, precision: Precision = "bf16-mixed",
) -> MemoryEstimate:
    """Peak bytes per device for `layout` on the worst pipeline stage."""
    lo = layout
    layers = cfg.n_layers // lo.pp
    in_flight = min(lo.pp, num_microbatches)
    per_layer = activation_bytes_per_layer(cfg, lo.micro_batch, seq_len, lo.tp, lo.cp, lo.checkpointing, precision)
    blocks = in_flight * layers * per_layer
    if lo.checkpointing != "none":
        # backward re-runs one block at a time, holding its full activations while it does
        blocks += activation_bytes_per_layer(cfg, lo.micro_batch, seq_len, lo.tp, lo.cp, "none", precision)
    return MemoryEstimate(
        model_states=model_state_bytes(cfg, vocab_size, lo.shard, lo.tp, lo.pp),
        gathered_params=gathered_param_bytes(cfg, lo.shard, lo.tp, precision),
        activations=blocks,
        head_activations=head_activation_bytes(cfg, vocab_size, lo.micro_batch, seq_len, lo.tp, lo.cp, precision),
        reserved=int(cluster.reserved_gb * GIB),
    )


# ----------------------------------------------------------------------------------------------
# Step-time model


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step.

    FSDP traffic is prefetched, so it hides behind all compute; ring-attention (CP) traffic hides
    only behind the attention it feeds; TP and PP traffic sits on the critical path.
    """

    compute: float
    attention: float  # the part of compute + recompute spent in the attention core
    recompute: float
    bubble: float
    tp_comm: float
    pp_comm: float
    fsdp_comm: float
    cp_comm: float

    @property
    def exposed_overlap_comm(self) -> float:
        exposed_fsdp = max(0.0, self.fsdp_comm - self.compute - self.recompute)
        return exposed_fsdp + max(0.0, self.cp_comm - self.attention)

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.bubble + self.tp_comm + self.pp_comm
                + self.exposed_overlap_comm)


def _ring(group: int, nbytes: float, bandwidth: float) -> float:
    """Seconds for a ring all-gather or reduce-scatter of `nbytes` (the full tensor) over `group`."""
    return (group - 1) / group * nbytes / bandwidth if group > 1 else 0.0


def estimate_step_time(
    cfg: ModelConfig, vocab_size: int, seq_len: int, global_batch_seqs: int, layout: CandidateLayout,
    cluster: ClusterSpec, precision: Precision = "bf16-mixed",
) -> StepTime:
    """Seconds per optimizer step for `layout`: compute at the cluster's assumed MFU plus the
    traffic each parallelism adds (ring collectives: each rank moves (g-1)/g of the tensor)."""
    lo = layout
    a = ACT_BYTES[precision]
    gpn = cluster.gpus_per_node
    intra, inter = cluster.intra_node_gbps * 1e9, cluster.inter_node_gbps * 1e9

    def link(span: int) -> float:
        """A group whose ranks fit in `span` consecutive ranks stays inside one node if span <= gpn."""
        return intra if span <= gpn else inter

    tokens = global_batch_seqs * seq_len
    rate = lo.world_size * cluster.peak_tflops * 1e12 * cluster.mfu
    compute = flops_per_token(cfg, vocab_size, seq_len) * tokens / rate
    attention_forward = 4 * cfg.n_layers * cfg.d_model * seq_len  # per token: QK^T and AV
    matmul_forward = (flops_per_token(cfg, vocab_size, seq_len) - 3 * attention_forward) / 3
    recompute_per_token = {"none": 0, "selective": attention_forward,
                           "full": matmul_forward + attention_forward}[lo.checkpointing]
    recompute = recompute_per_token * tokens / rate
    attention = (3 * attention_forward + (attention_forward if lo.checkpointing != "none" else 0)) * tokens / rate
    m = global_batch_seqs // (lo.dp * lo.micro_batch)
    bubble = (compute + recompute) * (lo.pp - 1) / m

    layers = cfg.n_layers // lo.pp
    local_tokens = lo.micro_batch * seq_len // lo.cp
    # sequence-parallel TP: 2 all-gathers + 2 reduce-scatters forward, as many backward (and once
    # more forward when the block is recomputed); each moves the full [tokens, d] activation
    tp_collectives = 8 + (4 if lo.checkpointing == "full" else 0)
    tp_comm = m * layers * tp_collectives * _ring(lo.tp, local_tokens * cfg.d_model * a, intra)
    # one activation forward and one gradient backward across each stage boundary, per micro-batch
    pp_bytes = local_tokens * cfg.d_model // lo.tp * a
    pp_comm = 2 * m * pp_bytes / link(lo.world_size) if lo.pp > 1 else 0.0
    # FSDP: all-gather weights for forward and backward, reduce-scatter fp32 grads, per micro-batch
    stage_params = stage_parameters(cfg, vocab_size, lo.tp, lo.pp)
    fsdp_link = link(lo.tp * lo.cp * lo.dp)
    fsdp_comm = m * (2 * _ring(lo.shard, stage_params * a, fsdp_link) + _ring(lo.shard, stage_params * 4, fsdp_link))
    # all-gather context parallel: each rank receives the other cp-1 chunks' K and V in forward
    # and sends their gradients back (reduce-scatter) in backward; the gathered K, V are kept
    kv_bytes = 2 * local_tokens * cfg.d_model // lo.tp * a
    cp_comm = m * layers * 2 * (lo.cp - 1) * kv_bytes / link(lo.tp * lo.cp) if lo.cp > 1 else 0.0
    return StepTime(compute, attention, recompute, bubble, tp_comm, pp_comm, fsdp_comm, cp_comm)


# ----------------------------------------------------------------------------------------------
# Search


@dataclass(frozen=True)
class Plan:
    layout: CandidateLayout
    num_microbatches: int  # per pipeline per optimizer step (gradient accumulation)
    memory: MemoryEstimate
    time: StepTime
    tokens_per_step: int
    usable_bytes: int
    rejected: str | None = None  # why it does not fit; None when it does

    @property
    def fits(self) -> bool:
        return self.rejected is None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.time.total

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["memory"]["total"] = self.memory.total
        out["time"]["total"] = self.time.total
        out["tokens_per_s"] = self.tokens_per_s
        return out


@dataclass(frozen=True)
class PlanSearch:
    """Every legal layout, scored: `ranked` fit (fastest first), `rejected` do not (with reasons)."""

    model: ModelConfig
    vocab_size: int
    seq_len: int
    global_batch_seqs: int
    cluster: ClusterSpec
    precision: Precision
    ranked: list[Plan] = field(default_factory=list)
    rejected: list[Plan] = field(default_factory=list)

    @property
    def best(self) -> Plan | None:
        return self.ranked[0] if self.ranked else None

    def require_best(self) -> Plan:
        """The chosen plan, or a ConfigError saying why nothing fits and what to change."""
        if self.best is None:
            raise ConfigError(_nothing_fits(self))
        return self.best

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.model_dump(mode="json"),
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "global_batch_seqs": self.global_batch_seqs,
            "cluster": self.cluster.model_dump(mode="json"),
            "precision": self.precision,
            "best": self.best.to_dict() if self.best else None,
            "num_fitting": len(self.ranked),
            "num_rejected": len(self.rejected),
        }


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def global_batch_in_sequences(seq_len: int, global_batch_seqs: int | None, global_batch_tokens: int | None) -> int:
    if (global_batch_seqs is None) == (global_batch_tokens is None):
        raise ConfigError("give the global batch either in sequences or in tokens, not both and not neither")
    if global_batch_tokens is not None:
        if global_batch_tokens % seq_len:
            raise ConfigError(
                f"global batch of {global_batch_tokens} tokens is not a whole number of {seq_len}-token "
                f"sequences: use a multiple of {seq_len}"
            )
        return global_batch_tokens // seq_len
    assert global_batch_seqs is not None
    if global_batch_seqs <= 0:
        raise ConfigError(f"global batch must be positive, got {global_batch_seqs} sequences")
    return global_batch_seqs


def legal_layouts(cfg: ModelConfig, seq_len: int, global_batch_seqs: int, cluster: ClusterSpec) -> list[CandidateLayout]:
    """Every layout meeting the structural constraints that Kiln's trainer can run (memory is judged later).

    tp divides the heads and stays inside a node; pp divides the layers; cp splits the sequence
    into cp equal chunks; dp x tp x pp x cp is the world size; the global batch splits evenly into
    dp x micro-batch; and `ParallelDims` accepts the combination (pipeline parallel composes with
    FSDP but not with tp or cp).
    """
    world = cluster.world_size
    layouts = []
    for tp in _divisors(world):
        if cfg.n_heads % tp or tp > cluster.gpus_per_node:
            continue
        for pp in _divisors(world // tp):
            if cfg.n_layers % pp:
                continue
            for cp in _divisors(world // (tp * pp)):
                dp = world // (tp * pp * cp)
                if seq_len % cp or global_batch_seqs % dp or not _runnable(pp, dp, cp, tp):
                    continue
                for mb in _divisors(global_batch_seqs // dp):
                    if mb > MAX_MICRO_BATCH:
                        break
                    layouts.extend(CandidateLayout(dp, tp, pp, cp, mb, ac) for ac in CHECKPOINTING)
    return layouts


def _runnable(pp: int, dp: int, cp: int, tp: int) -> bool:
    try:
        ParallelDims(pp=pp, dp=dp, cp=cp, tp=tp)
    except ValidationError:
        return False
    return True


def plan_parallelism(
    cfg: ModelConfig,
    vocab_size: int,
    seq_len: int,
    cluster: ClusterSpec,
    global_batch_seqs: int | None = None,
    global_batch_tokens: int | None = None,
    precision: Precision = "bf16-mixed",
) -> PlanSearch:
    """Score every legal layout; the fitting ones ranked by step time (ties: less recompute, less memory)."""
    if cluster.gpus_per_node < 1:
        raise ConfigError(
            "cluster.gpus_per_node is 0: the planner sizes accelerator runs; describe the hardware "
            "(e.g. a configs/clusters/*.yaml file) with gpus_per_node >= 1"
        )
    if seq_len > cfg.max_seq_len:
        raise ConfigError(f"seq_len={seq_len} exceeds model.max_seq_len={cfg.max_seq_len}: lower one or raise the other")
    seqs = global_batch_in_sequences(seq_len, global_batch_seqs, global_batch_tokens)
    layouts = legal_layouts(cfg, seq_len, seqs, cluster)
    if not layouts:
        raise ConfigError(
            f"no layout of {cluster.world_size} devices splits a global batch of {seqs} sequences "
            f"(n_heads={cfg.n_heads}, n_layers={cfg.n_layers}): make the batch a multiple of the device count"
        )
    usable = int(cluster.memory_gb * GIB)  # the reserve is one of the estimate's parts
    fitting, rejected = [], []
    for lo in layouts:
        m = seqs // (lo.dp * lo.micro_batch)
        mem = estimate_memory(cfg, vocab_size, seq_len, lo, m, cluster, precision)
        time = estimate_step_time(cfg, vocab_size, seq_len, seqs, lo, cluster, precision)
        reason = None
        if mem.total > usable:
            reason = (f"needs {mem.total / GIB:.1f} GiB per device > {cluster.memory_gb:g} GiB "
                      f"({_largest_part(mem)})")
        plan = Plan(lo, m, mem, time, seqs * seq_len, usable, reason)
        (fitting if plan.fits else rejected).append(plan)
    fitting.sort(key=_rank_key(fitting))
    rejected.sort(key=lambda p: p.memory.total)
    return PlanSearch(cfg, vocab_size, seq_len, seqs, cluster, precision, fitting, rejected)


def plan_presets(model: str, cluster: str, vocab_size: int, seq_len: int, global_batch_seqs: int | None = None,
                 global_batch_tokens: int | None = None, precision: Precision = "bf16-mixed") -> PlanSearch:
    """`plan_parallelism` for a model and a cluster given as preset names or YAML paths (`kiln plan`)."""
    return plan_parallelism(load_preset(model, ModelConfig), vocab_size, seq_len, load_preset(cluster, ClusterSpec),
                            global_batch_seqs, global_batch_tokens, precision)


def _rank_key(plans: list[Plan]) -> Any:
    """Fastest first, but within 1% (the model's resolution) prefer the simpler plan.

    Simpler: fewer model-parallel ranks (tp x pp x cp), then less recompute, then less memory.
    """
    fastest = min((p.time.total for p in plans), default=1.0)

    def key(p: Plan) -> tuple[int, int, int, int, float]:
        bucket = math.floor(math.log(p.time.total / fastest) / math.log(1 + RANK_RESOLUTION))
        lo = p.layout
        return bucket, lo.tp * lo.pp * lo.cp, CHECKPOINTING.index(lo.checkpointing), p.memory.total, p.time.total

    return key


def _largest_part(mem: MemoryEstimate) -> str:
    parts = {"model states": mem.model_states, "activations": mem.activations + mem.head_activations,
             "gathered params": mem.gathered_params}
    name, size = max(parts.items(), key=lambda kv: kv[1])
    return f"{name} alone take {size / GIB:.1f} GiB"


def _nothing_fits(search: PlanSearch) -> str:
    c = search.cluster
    lightest = search.rejected[0]
    states_floor = STATE_BYTES_PER_PARAM * count_parameters(search.model, search.vocab_size)
    return (
        f"no layout fits on {c.nodes} x {c.gpus_per_node} {c.accelerator} ({c.memory_gb:g} GiB): the "
        f"lightest, {lightest.layout.describe()}, {lightest.rejected}. Weights, grads and Adam states "
        f"alone need {states_floor / GIB:.0f} GiB in total across devices; add nodes, shorten seq_len "
        "or use a smaller model"
    )


# ----------------------------------------------------------------------------------------------
# Report


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def _shape(lo: CandidateLayout) -> tuple[int, int, int, int]:
    return lo.dp, lo.tp, lo.pp, lo.cp


def render_plan_report(search: PlanSearch, alternatives: int = 5) -> str:
    """A plain-text explanation of the choice: the plan, its budget, the runners-up, and why not the others."""
    c, cfg = search.cluster, search.model
    n = count_parameters(cfg, search.vocab_size)
    lines = [
        f"Model: {n / 1e9:.2f}B parameters (d_model={cfg.d_model}, n_layers={cfg.n_layers}, "
        f"n_heads={cfg.n_heads}, vocab={search.vocab_size}), seq_len={search.seq_len}, "
        f"global batch {search.global_batch_seqs} sequences = {search.global_batch_seqs * search.seq_len:,} tokens, "
        f"{search.precision}",
        f"Cluster: {c.nodes} node(s) x {c.gpus_per_node} {c.accelerator} ({c.memory_gb:g} GiB, "
        f"{c.peak_tflops:g} TFLOP/s peak, MFU assumed {c.mfu:.0%}), {c.intra_node_gbps:g} GB/s in a node, "
        f"{c.inter_node_gbps:g} GB/s between nodes, {c.reserved_gb:g} GiB reserved per device",
        f"Searched {len(search.ranked) + len(search.rejected)} layouts: {len(search.ranked)} fit, "
        f"{len(search.rejected)} do not.",
        "",
    ]
    best = search.best
    if best is None:
        lines.append("NO PLAN FITS: " + _nothing_fits(search))
        return "\n".join(lines) + "\n"
    mem, t = best.memory, best.time
    mfu = flops_per_token(cfg, search.vocab_size, search.seq_len) * best.tokens_per_s / (
        c.world_size * c.peak_tflops * 1e12)
    lines += [
        f"Chosen: {best.layout.describe()}, {best.num_microbatches} micro-batch(es) per step",
        f"  memory per device: {_gib(mem.total)} of {c.memory_gb:g} GiB (model states {_gib(mem.model_states)}, "
        f"gathered params {_gib(mem.gathered_params)}, activations {_gib(mem.activations)}, "
        f"head {_gib(mem.head_activations)}, reserved {_gib(mem.reserved)})",
        f"  step time: {t.total:.2f} s (compute {t.compute:.2f}, recompute {t.recompute:.2f}, "
        f"pipeline bubble {t.bubble:.2f}, TP comm {t.tp_comm:.2f}, PP comm {t.pp_comm:.2f}, "
        f"FSDP+CP comm {t.fsdp_comm + t.cp_comm:.2f} of which {t.exposed_overlap_comm:.2f} not hidden by compute)",
        f"  throughput: {best.tokens_per_s:,.0f} tokens/s, {mfu:.1%} MFU after communication",
        f"  why: the fastest of {len(search.ranked)} fitting layouts; {_why(search)}",
        "",
        "Runners-up:",
    ]
    for plan in search.ranked[1:1 + alternatives]:
        lines.append(f"  {plan.time.total:8.2f} s  {_gib(plan.memory.total):>6} GiB  {plan.layout.describe()}")
    lines += ["", "Best of each (dp, tp, pp, cp) shape:"]
    shapes: dict[tuple[int, int, int, int], str] = {}
    for plan in search.ranked:
        shapes.setdefault(_shape(plan.layout), f"{plan.time.total:.2f} s with micro-batch "
                          f"{plan.layout.micro_batch}, checkpointing={plan.layout.checkpointing}")
    for plan in search.rejected:  # lightest first, so this is the closest the shape came to fitting
        shapes.setdefault(_shape(plan.layout), f"does not fit even at micro-batch {plan.layout.micro_batch}, "
                          f"checkpointing={plan.layout.checkpointing}: {plan.rejected}")
    fitting_shapes = [s for s in shapes.items() if not s[1].startswith("does not fit")]
    failing_shapes = [s for s in shapes.items() if s[1].startswith("does not fit")]
    for group in (fitting_shapes, failing_shapes):
        for (dp, tp, pp, cp), text in group[:SHOWN_SHAPES]:
            lines.append(f"  dp={dp} tp={tp} pp={pp} cp={cp}: {text}")
        if len(group) > SHOWN_SHAPES:
            lines.append(f"  ... and {len(group) - SHOWN_SHAPES} more shapes like these")
    return "\n".join(lines) + "\n"


def _why(search: PlanSearch) -> str:
    """What the choice trades against: memory headroom and the simpler layouts it beat."""
    best = search.best
    assert best is not None
    lo = best.layout
    notes = [f"{_gib(best.usable_bytes - best.memory.total)} GiB headroom"]
    if lo.checkpointing != "none":
        plain = next((p for p in search.rejected + search.ranked
                      if p.layout == CandidateLayout(lo.dp, lo.tp, lo.pp, lo.cp, lo.micro_batch, "none")), None)
        if plain is not None and not plain.fits:
            notes.append(f"without checkpointing it {plain.rejected}")
        else:
            notes.append("recomputing is cheaper than the smaller micro-batch that would avoid it")
    pure = [p for p in search.ranked + search.rejected if p.layout.tp == p.layout.pp == p.layout.cp == 1]
    if lo.tp == lo.pp == lo.cp == 1:
        notes.append("pure FSDP needs no per-layer TP traffic and no pipeline bubble")
    elif pure and pure[0].fits:
        notes.append(f"pure FSDP fits but is slower ({pure[0].time.total:.2f} s)")
    elif pure:
        notes.append(f"pure FSDP does not fit: at best it {pure[0].rejected}")
    return "; ".join(notes)


def resolve_parallel(parallel: ParallelDims | Literal["auto"], model: ModelConfig, run: TrainRunConfig,
                     vocab_size: int, cluster: ClusterSpec) -> tuple[ParallelDims, TrainRunConfig]:
    """The layout a training stage runs with, and its run settings with the layout's runtime fields.

    A given `ParallelDims` is used as is. `auto` on accelerators takes the planner's best layout for
    the run's global batch (`run.batch_size` sequences) on `cluster`, with its micro-batch (as
    `grad_accum`) and activation checkpointing; on CPUs (`run.device: cpu` or no GPUs) it is plain
    data parallelism, one process per node. Neither choice enters the key: the batch does.
    """
    if parallel != "auto":
        return parallel, run
    if run.device == "cpu" or cluster.gpus_per_node == 0:
        return ParallelDims(dp=cluster.nodes), run
    best = plan_parallelism(model, vocab_size, run.seq_len, cluster, global_batch_seqs=run.batch_size).require_best()
    lo = best.layout
    dims = ParallelDims(pp=lo.pp, dp=lo.dp, cp=lo.cp, tp=lo.tp)
    return dims, run.model_copy(update={"grad_accum": best.num_microbatches,
                                        "activation_checkpointing": lo.checkpointing != "none"})


def checked_layout(parallel: ParallelDims | Literal["auto"], model: ModelConfig, run: TrainRunConfig,
                   vocab_size: int, cluster: ClusterSpec) -> tuple[ParallelDims, TrainRunConfig]:
    """`resolve_parallel`, checked against the global batch: a layout that cannot hold it is a
    ConfigError that says why."""
    dims, run = resolve_parallel(parallel, model, run, vocab_size, cluster)
    try:
        dims.check_holds_batch(run)
    except ValueError as error:
        raise ConfigError(f"train.parallel={dims.model_dump(exclude_defaults=True)}: {error}") from None
    return dims, run


# ----------------------------------------------------------------------------------------------
# Forecast


@dataclass(frozen=True)
class TrainingForecast:
    """What the step-time model expects a training run to cost on `accelerator`: step time x steps,
    on every device of the layout (the planner's figure, set beside the measured cost)."""

    accelerator: str
    layout: CandidateLayout
    step_s: float
    steps: int

    @property
    def wall_s(self) -> float:
        return self.step_s * self.steps

    @property
    def accelerator_s(self) -> float:
        return self.wall_s * self.layout.world_size

    def to_dict(self) -> dict[str, Any]:
        return {"accelerator": self.accelerator, "layout": self.layout.describe(), "devices": self.layout.world_size,
                "step_s": self.step_s, "steps": self.steps, "wall_s": self.wall_s,
                "accelerator_s": self.accelerator_s, "device_hours": self.accelerator_s / 3600}


def forecast_training(model: ModelConfig, vocab_size: int, run: TrainRunConfig,
                      parallel: ParallelDims | Literal["auto"], cluster: ClusterSpec) -> TrainingForecast:
    """The planner's forecast of `run` on `cluster`'s accelerators (bf16-mixed): the layout it runs
    there (`parallel`, or the planner's choice for `auto`, as `kiln plan CONFIG` shows), its
    micro-batch and recompute, priced by `estimate_step_time`. A ConfigError when the cluster
    describes no accelerators or the layout cannot hold the batch."""
    if cluster.gpus_per_node < 1:
        raise ConfigError("cluster.gpus_per_node is 0: the forecast prices accelerator time; describe the GPUs "
                          "(a configs/clusters/*.yaml preset) to get one")
    dims, run = checked_layout(parallel, model, run.model_copy(update={"device": "cuda"}), vocab_size, cluster)
    layout = CandidateLayout(dims.dp, dims.tp, dims.pp, dims.cp, run.batch_size // (dims.dp * run.grad_accum),
                             "full" if run.activation_checkpointing else "none")  # the trainer recomputes whole blocks
    step = estimate_step_time(model, vocab_size, run.seq_len, run.batch_size, layout, cluster)
    return TrainingForecast(cluster.accelerator, layout, step.total, run.steps)


def forecast_record(model: ModelConfig, vocab_size: int, run: TrainRunConfig,
                    parallel: ParallelDims | Literal["auto"], cluster: ClusterSpec) -> dict[str, Any]:
    """`forecast_training` as a training stage records it: the forecast, or why there is none (a
    training run on CPUs still trains; it just has no accelerator time to forecast)."""
    try:
        return forecast_training(model, vocab_size, run, parallel, cluster).to_dict()
    except ConfigError as error:
        return {"skipped": str(error)}
