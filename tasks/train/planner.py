"""The parallelism planner: pick dp x tp x pp x cp, pipeline schedule, micro-batch and activation
checkpointing for a run.

Given a model shape, a global batch and a cluster (`ClusterSpec`, owned by `tasks.launch.cluster`),
every legal `CandidateLayout` is scored by a memory model of Kiln's own trainer
(`tasks.train.plan_memory`: per device, worst pipeline rank, checked against torch's memory
tracking by `tasks.train.verify` and `kiln plan --verify`) and a step-time model (compute at an
assumed MFU plus the communication each parallelism adds); layouts that do not fit are rejected
with the reason, the rest are ranked by step time, and `render_plan_report` explains the choice.

What the step-time model assumes is what the trainer does (`tasks.train.parallel`): FSDP2 shards
the fp32 master weights, gradients and AdamW moments over dp x cp, all-gathers each block in the
compute dtype for forward and again for backward and reduce-scatters its fp32 gradients, every
micro-batch; a pipeline stage instead stays unsharded for the whole step (torch's PipelineStage),
so it gathers and reduces once. Tensor parallelism splits heads and the SwiGLU width and
all-reduces the block's two outputs (no sequence parallelism); context parallelism all-gathers
each chunk's K/V. Pipelines run torch's GPipe, 1F1B or interleaved 1F1B, whose bubble is
(pp - 1) / (micro-batches x stages per rank) of the compute. Selective recomputation keeps every
matmul and attention output, so it recomputes no FLOPs (only elementwise ops, which the FLOP
model does not price). The rank mesh is [pp, dp, cp, tp] with tp innermost, which decides
whether a group talks over the intra-node or the inter-node link.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import ValidationError

from kiln.tasks.bundled import shipped
from kiln.tasks.configbase import Section, read_yaml
from kiln.tasks.errors import ConfigError
from kiln.tasks.launch.cluster import ClusterSpec
from kiln.tasks.train.config import (
    Checkpointing,
    ModelConfig,
    ParallelDims,
    PipelineSchedule,
    Precision,
    TrainRunConfig,
    schedule_problem,
)
from kiln.tasks.train.model import count_parameters, flops_per_token
from kiln.tasks.train.plan_memory import (
    CandidateLayout,
    MemoryEstimate,
    estimate_memory,
    rank_tensors,
    stage_layers,
)

CHECKPOINTING: tuple[Checkpointing, ...] = ("none", "selective", "full")
# (schedule, stages per rank) a pipeline is tried with; interleaving gives each rank 2 layer slices
SCHEDULES: tuple[tuple[PipelineSchedule, int], ...] = (("1f1b", 1), ("interleaved-1f1b", 2), ("gpipe", 1))
GIB = 2**30
STATE_BYTES_PER_PARAM = 16  # fp32 weights (the master copy) + fp32 grads + Adam m and v
ACT_BYTES = {"bf16-mixed": 2, "fp32": 4}
MAX_MICRO_BATCH = 64
RANK_RESOLUTION = 0.01  # step times closer than this are a tie: the model is not that precise
SHOWN_SHAPES = 10


S = TypeVar("S", bound=Section)
PRESETS_DIR = shipped("configs")
PRESET_FOLDERS = {"ModelConfig": "models", "ClusterSpec": "clusters"}


PRESET_VOCAB = "vocab_size"  # a model preset may name its tokenizer's size: not a ModelConfig field
DEFAULT_VOCAB = 32000  # `kiln plan`'s vocabulary for a model file that names none
DEFAULT_BATCH_TOKENS = 4 * 2**20  # `kiln plan`'s global batch unless given: Llama 3's first 4M-token batches


def preset_path(name_or_path: str, cls: type[Section]) -> Path:
    """The file of a preset named `name_or_path` (`7b` -> configs/models/7b.yaml, `h100-1node` ->
    configs/clusters/h100-1node.yaml), or the path itself."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        return path
    folder = PRESETS_DIR / PRESET_FOLDERS[cls.__name__]
    path = folder / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
        raise ConfigError(f"no {cls.__name__} preset named {name_or_path!r}: use one of {known}, or a .yaml path")
    return path


def load_preset(name_or_path: str, cls: type[S]) -> S:
    """A preset by name or by path (see `preset_path`)."""
    return load_section_file(preset_path(name_or_path, cls), cls)


def preset_vocab_size(name_or_path: str) -> int:
    """The vocabulary a model preset was published with (its `vocab_size`), or DEFAULT_VOCAB."""
    return int(_read_mapping(preset_path(name_or_path, ModelConfig), ModelConfig).get(PRESET_VOCAB, DEFAULT_VOCAB))


def load_section_file(path: Path, cls: type[S]) -> S:
    """A `cls` read from a YAML mapping (a `configs/models/*.yaml` or `configs/clusters/*.yaml`;
    a model file may also give the `vocab_size` its shape was published with)."""
    data = _read_mapping(path, cls)
    if cls is ModelConfig:
        data.pop(PRESET_VOCAB, None)
    try:
        return cls.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise ConfigError(f"{path}: invalid {cls.__name__}: {problems}") from None


def _read_mapping(path: Path, cls: type[Section]) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path} does not exist (presets live in configs/models/ and configs/clusters/)")
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of {cls.__name__} fields, got {type(data).__name__}")
    return data


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
    # a pipeline runs at the pace of its largest stage (stages differ by a block when pp does not divide the layers)
    imbalance = max(sum(stage_layers(cfg, lo, r)) for r in range(lo.pp)) * lo.pp / cfg.n_layers
    compute = flops_per_token(cfg, vocab_size, seq_len) * tokens / rate * (imbalance if lo.pp > 1 else 1.0)
    attention_forward = 4 * (cfg.n_layers + cfg.mtp_heads) * cfg.d_model * seq_len  # per token: QK^T and AV
    matmul_forward = (flops_per_token(cfg, vocab_size, seq_len) - 3 * attention_forward) / 3
    recompute_per_token = {"none": 0, "selective": 0, "full": matmul_forward + attention_forward}[lo.checkpointing]
    recompute = recompute_per_token * tokens / rate
    attention = (3 * attention_forward + (attention_forward if lo.checkpointing == "full" else 0)) * tokens / rate
    m = global_batch_seqs // (lo.dp * lo.micro_batch)
    bubble = (compute + recompute) * (lo.pp - 1) / (m * lo.stages_per_rank)

    layers = max(sum(stage_layers(cfg, lo, r)) for r in range(lo.pp))
    local_tokens = lo.micro_batch * seq_len // lo.cp
    # TP without sequence parallelism: the attention and MLP outputs are all-reduced forward, their
    # inputs' gradients backward (4 all-reduces = 8 ring passes of the [tokens, d] activation),
    # and again forward when the whole block is recomputed (selective keeps the all-reduces)
    tp_collectives = 8 + (4 if lo.checkpointing == "full" else 0)
    tp_comm = m * layers * tp_collectives * _ring(lo.tp, local_tokens * cfg.d_model * a, intra)
    # one activation forward and one gradient backward across each stage boundary, per micro-batch and virtual stage
    pp_bytes = local_tokens * cfg.d_model * a
    pp_comm = 2 * m * lo.stages_per_rank * pp_bytes / link(lo.world_size) if lo.pp > 1 else 0.0
    # FSDP: all-gather weights for forward and backward and reduce-scatter fp32 grads, per
    # micro-batch; a pipeline stage gathers and reduces once per step (it stays unsharded)
    held = max(sum(rows * cols for rows, cols in rank_tensors(cfg, vocab_size, lo, r)) for r in {0, lo.pp - 1})
    fsdp_link = link(lo.tp * lo.cp * lo.dp)
    rounds = m if lo.pp == 1 else 1
    fsdp_comm = rounds * (2 * _ring(lo.shard, held * a, fsdp_link) + _ring(lo.shard, held * 4, fsdp_link))
    # all-gather context parallel: each rank receives the other cp-1 chunks' K and V in forward
    # and sends their gradients back (reduce-scatter) in backward
    kv_bytes = 2 * local_tokens * cfg.kv_dim // lo.tp * a
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

    def layout_dims(self) -> ParallelDims:
        """The plan's layout as the trainer's config takes it (`train.parallel`)."""
        lo = self.layout
        return ParallelDims(pp=lo.pp, dp=lo.dp, cp=lo.cp, tp=lo.tp, pp_schedule=lo.schedule,
                            stages_per_rank=lo.stages_per_rank)

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

    tp divides the query and the K/V heads and stays inside a node; the pipeline's stages (pp, or
    2 pp interleaved) are no more than the layers; cp splits the sequence into cp equal chunks;
    dp x tp x pp x cp is the world size; the global batch splits evenly into dp x micro-batch; the
    schedule can run that many micro-batches (1F1B needs at least pp); `ParallelDims` accepts
    the combination (pipeline parallel composes with FSDP but not with tp or cp); and multi-token
    prediction heads train without pipeline or context parallelism (`tasks.train.parallel.check_divisible`).
    """
    world = cluster.world_size
    layouts = []
    for tp in _divisors(world):
        if cfg.n_heads % tp or cfg.kv_heads % tp or cfg.ffn_hidden % tp or tp > cluster.gpus_per_node:
            continue
        for pp in _divisors(world // tp):
            if pp > cfg.n_layers or (cfg.mtp_heads and pp > 1):
                continue
            for cp in _divisors(world // (tp * pp)):
                dp = world // (tp * pp * cp)
                if seq_len % cp or global_batch_seqs % dp or (cfg.mtp_heads and cp > 1):
                    continue
                for schedule, per_rank in SCHEDULES if pp > 1 else (("1f1b", 1),):
                    if pp * per_rank > cfg.n_layers or not _runnable(pp, dp, cp, tp, schedule, per_rank):
                        continue
                    for mb in _divisors(global_batch_seqs // dp):
                        if mb > MAX_MICRO_BATCH:
                            break
                        if schedule_problem(pp, schedule, global_batch_seqs // (dp * mb)):
                            continue
                        layouts.extend(CandidateLayout(dp, tp, pp, cp, mb, ac, schedule, per_rank)
                                       for ac in CHECKPOINTING)
    return layouts


def _runnable(pp: int, dp: int, cp: int, tp: int, schedule: PipelineSchedule, stages_per_rank: int) -> bool:
    try:
        ParallelDims(pp=pp, dp=dp, cp=cp, tp=tp, pp_schedule=schedule, stages_per_rank=stages_per_rank)
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
    reserved = int(cluster.reserved_gb * GIB)
    fitting, rejected = [], []
    for lo in layouts:
        m = seqs // (lo.dp * lo.micro_batch)
        mem = estimate_memory(cfg, vocab_size, seq_len, lo, m, reserved, precision)
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


def plan_presets(model: str, cluster: str, vocab_size: int | None = None, seq_len: int | None = None,
                 global_batch_seqs: int | None = None, global_batch_tokens: int | None = None,
                 precision: Precision = "bf16-mixed") -> PlanSearch:
    """`plan_parallelism` for a model and a cluster given as preset names or YAML paths (`kiln plan`).

    Unless given: the vocabulary the model preset was published with, sequences of the model's
    whole context, and a global batch of DEFAULT_BATCH_TOKENS tokens."""
    cfg = load_preset(model, ModelConfig)
    if global_batch_seqs is None and global_batch_tokens is None:
        global_batch_tokens = DEFAULT_BATCH_TOKENS
    return plan_parallelism(cfg, vocab_size or preset_vocab_size(model), seq_len or cfg.max_seq_len,
                            load_preset(cluster, ClusterSpec), global_batch_seqs, global_batch_tokens, precision)


def _rank_key(plans: list[Plan]) -> Any:
    """Fastest first, but within 1% (the model's resolution) prefer the simpler plan.

    Simpler: fewer model-parallel ranks (tp x pp x cp), then less recompute, then the simpler
    schedule (1F1B, interleaved, GPipe), then less memory.
    """
    fastest = min((p.time.total for p in plans), default=1.0)
    schedules = [name for name, _ in SCHEDULES]

    def key(p: Plan) -> tuple[int, int, int, int, int, float]:
        bucket = math.floor(math.log(p.time.total / fastest) / math.log(1 + RANK_RESOLUTION))
        lo = p.layout
        return (bucket, lo.tp * lo.pp * lo.cp, CHECKPOINTING.index(lo.checkpointing), schedules.index(lo.schedule),
                p.memory.total, p.time.total)

    return key


def _largest_part(mem: MemoryEstimate) -> str:
    parts = {"model states": mem.model_states, "activations": mem.activations + mem.head,
             "working copies": mem.working}
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
        f"  memory per device at the step's peak: {_gib(mem.total)} of {c.memory_gb:g} GiB (model states "
        f"{_gib(mem.model_states)}, working copies {_gib(mem.working)}, activations {_gib(mem.activations)}, "
        f"head {_gib(mem.head)}, reserved {_gib(mem.reserved)}; pipeline rank {mem.rank})",
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
                      if p.layout == CandidateLayout(lo.dp, lo.tp, lo.pp, lo.cp, lo.micro_batch, "none", lo.schedule,
                                                     lo.stages_per_rank)), None)
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


@dataclass(frozen=True)
class PhasePlan:
    """A data phase at another sequence length than the run's (a long-context extension), priced: the run's
    chosen layout at the phase's length (`as_planned`, None when it cannot split the sequence), and when
    that does not fit, the planner's best layout at that length (`suggested`) and its best with cp = 1
    (`unsplit`: None means no rank can hold a sequence whole)."""

    name: str
    seq_len: int
    global_batch_seqs: int
    as_planned: Plan | None
    suggested: Plan | None
    unsplit: Plan | None

    @property
    def single_rank_fits(self) -> bool:
        return self.fits or self.unsplit is not None

    @property
    def fits(self) -> bool:
        return self.as_planned is not None and self.as_planned.fits

    def message(self, layout: CandidateLayout) -> str:
        """What `kiln plan` says of the phase: it fits, or what to run it with (context parallelism when a
        rank cannot hold its sequences)."""
        head = (f"phase {self.name!r}: {self.global_batch_seqs} sequences of {self.seq_len:,} tokens "
                f"({self.global_batch_seqs * self.seq_len:,} tokens per step)")
        planned = self.as_planned
        if planned is not None and planned.fits:
            return f"{head}: the chosen layout holds it, {_gib(planned.memory.total)} GiB per device, " \
                   f"{planned.time.total:.2f} s per step"
        why = (f"the chosen layout {planned.rejected}" if planned is not None else
               f"the chosen layout's cp={layout.cp} does not divide {self.seq_len}")
        best = self.suggested
        if best is None:
            return (f"{head}: {why}, and no layout of this cluster holds it: add nodes, shorten the phase's "
                    "seq_len or use a smaller model")
        dims = best.layout_dims().model_dump(exclude_defaults=True)
        run_as = (f"resume the phase under train.parallel={dims} with train.run.grad_accum="
                  f"{best.num_microbatches} and activation_checkpointing={best.layout.checkpointing} (the layout "
                  "is runtime: a run resumes from its checkpoints under another)")
        found = f"{best.layout.describe()}, {_gib(best.memory.total)} GiB per device, {best.time.total:.2f} s per step"
        if self.unsplit is None:
            return (f"{head}: {why}. A rank cannot hold one {self.seq_len:,}-token sequence (no layout with cp=1 "
                    f"fits): use context parallelism, cp={best.layout.cp}: {found}; {run_as}")
        if best.layout.cp > 1:
            u = self.unsplit
            return (f"{head}: {why}. Context parallelism is the fastest that fits: cp={best.layout.cp}: {found} "
                    f"(unsplit, at best {u.layout.describe()}, {u.time.total:.2f} s per step); {run_as}")
        return f"{head}: {why}. Best at this length: {found}; {run_as}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "seq_len": self.seq_len, "fits": self.fits,
                "single_rank_fits": self.single_rank_fits,
                **{k: None if p is None else p.to_dict() for k, p in (("as_planned", self.as_planned),
                                                                       ("suggested", self.suggested),
                                                                       ("unsplit", self.unsplit))}}


def plan_phases(search: PlanSearch, phases: list[tuple[str, int]]) -> list[PhasePlan]:
    """Each data phase (name, seq_len) whose length differs from the run's `search.seq_len`, priced with the
    run's chosen layout (the same global batch in sequences, as the phase trains it) and, when that does not
    fit, searched again at its length. The model must hold the longest phase (`model.max_seq_len`)."""
    best = search.require_best()
    lo, out = best.layout, []
    usable, reserved = int(search.cluster.memory_gb * GIB), int(search.cluster.reserved_gb * GIB)
    for name, seq_len in phases:
        if seq_len == search.seq_len:
            continue
        planned = None
        if seq_len % lo.cp == 0:
            mem = estimate_memory(search.model, search.vocab_size, seq_len, lo, best.num_microbatches, reserved,
                                  search.precision)
            reason = (f"needs {mem.total / GIB:.1f} GiB per device > {search.cluster.memory_gb:g} GiB "
                      f"({_largest_part(mem)})") if mem.total > usable else None
            time = estimate_step_time(search.model, search.vocab_size, seq_len, search.global_batch_seqs, lo,
                                      search.cluster, search.precision)
            planned = Plan(lo, best.num_microbatches, mem, time, search.global_batch_seqs * seq_len, usable, reason)
        suggested = unsplit = None
        if planned is None or not planned.fits:
            again = plan_parallelism(search.model, search.vocab_size, seq_len, search.cluster,
                                     global_batch_seqs=search.global_batch_seqs, precision=search.precision)
            suggested = again.best
            unsplit = next((p for p in again.ranked if p.layout.cp == 1), None)
        out.append(PhasePlan(name, seq_len, search.global_batch_seqs, planned, suggested, unsplit))
    return out


def render_phase_plans(search: PlanSearch, plans: list[PhasePlan]) -> str:
    """The report's section on the data phases at other lengths (nothing when there are none)."""
    if not plans or search.best is None:
        return ""
    return "\nData phases at another sequence length:\n" + "".join(
        f"  {p.message(search.best.layout)}\n" for p in plans)


def resolve_parallel(parallel: ParallelDims | Literal["auto"], model: ModelConfig, run: TrainRunConfig,
                     vocab_size: int, cluster: ClusterSpec) -> tuple[ParallelDims, TrainRunConfig]:
    """The layout a training stage runs with, and its run settings with the layout's runtime fields.

    A given `ParallelDims` is used as is. `auto` on accelerators takes the planner's best layout for
    the run's global batch (`run.batch_size` sequences) and precision on `cluster`, with its
    pipeline schedule, micro-batch (as `grad_accum`) and activation checkpointing; on CPUs
    (`run.device: cpu` or no GPUs) it is plain data parallelism, one process per node. Neither
    choice enters the key: the batch does.
    """
    if parallel != "auto":
        return parallel, run
    if run.device == "cpu" or cluster.gpus_per_node == 0:
        return ParallelDims(dp=cluster.nodes), run
    best = plan_parallelism(model, vocab_size, run.seq_len, cluster, global_batch_seqs=run.batch_size,
                            precision=run.resolved_precision).require_best()
    return best.layout_dims(), run.model_copy(update={"grad_accum": best.num_microbatches,
                                                      "activation_checkpointing": best.layout.checkpointing})


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
                             run.activation_checkpointing, dims.pp_schedule, dims.stages_per_rank)
    step = estimate_step_time(model, vocab_size, run.seq_len, run.batch_size, layout, cluster, run.resolved_precision)
    return TrainingForecast(cluster.accelerator, layout, step.total, run.steps)


def forecast_record(model: ModelConfig, vocab_size: int, run: TrainRunConfig,
                    parallel: ParallelDims | Literal["auto"], cluster: ClusterSpec) -> dict[str, Any]:
    """`forecast_training` as a training stage records it: the forecast, or why there is none (a
    training run on CPUs still trains; it just has no accelerator time to forecast)."""
    try:
        return forecast_training(model, vocab_size, run, parallel, cluster).to_dict()
    except ConfigError as error:
        return {"skipped": str(error)}
