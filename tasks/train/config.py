"""Config sections for training: the model's shape and architecture options, the optimizer and
objective, the schedule, and one run's budget.

`vocab_size` is deliberately absent from `ModelConfig`: it belongs to the tokenizer, so it is
read from the mixture manifest and passed to `build_model` alongside the config.

Every architecture and objective option is a plain field, so a sweep, a research variant or a
config override sets it like any other. Options added after keys were published are
`added_field`s: at their defaults (today's Llama-style model) they stay out of the identity, so
existing keys and checkpoints remain valid.
"""

from __future__ import annotations

import math
from typing import Literal, TypeVar

from pydantic import Field, model_validator

from kiln.tasks.configbase import Reference, Section, added_field, runtime_field

FFN_MULTIPLE = 32  # the MLP's hidden width is rounded up to this, for matmul-friendly shapes

Position = Literal["rope", "alibi", "nope", "learned"]
Norm = Literal["rmsnorm", "layernorm"]
NormPlacement = Literal["pre", "post", "reordered"]
Mlp = Literal["swiglu", "gelu"]
QKNormScope = Literal["head", "projection"]
Checkpointing = Literal["none", "selective", "full"]
Precision = Literal["bf16-mixed", "fp32"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]

S = TypeVar("S", bound=Section)


def revalidated(section: S) -> S:
    """`section` checked again: `model_copy(update=...)` (how sweeps vary a setting) skips validation."""
    return type(section).model_validate(section.model_dump())


class RopeScaling(Section):
    """Rotary frequencies stretched to run past the context they were trained at (context extension).

    - `linear` (position interpolation, Chen et al. 2023): every position is divided by `factor`.
    - `ntk` (NTK-aware, bloc97 2023): the base becomes theta * factor^(d / (d - 2)) (d: head size),
      so the slowest frequency is interpolated by `factor` and the fastest barely moves.
    - `yarn` (Peng et al. 2023): frequencies that turn fewer than `beta_slow` times over
      `original_max_seq_len` are interpolated, those turning more than `beta_fast` times are kept,
      with a linear ramp between; cos and sin are scaled by 0.1 ln(factor) + 1. Computed as
      transformers computes `rope_type: yarn`, so an exported model matches it.
    """

    kind: Literal["linear", "ntk", "yarn"]
    factor: float = Field(gt=1, description="how many times the original context the positions stretch to")
    original_max_seq_len: int = Field(gt=0, description="the context the model was trained at before extension")
    beta_fast: float = Field(32.0, gt=0, description="yarn: rotations over the original context above which a "
                                                      "frequency is kept")
    beta_slow: float = Field(1.0, gt=0, description="yarn: rotations below which a frequency is interpolated")

    @model_validator(mode="after")
    def _check_betas(self) -> RopeScaling:
        if self.beta_slow >= self.beta_fast:
            raise ValueError(f"model.rope_scaling.beta_slow={self.beta_slow} must be below beta_fast={self.beta_fast}")
        return self


class ModelConfig(Section):
    """A decoder-only transformer's shape and architecture. The defaults are Llama's: pre-RMSNorm,
    RoPE, SwiGLU, full causal attention, grouped-query heads when `n_kv_heads` is set.

    A planned shape (d_model, n_layers, n_heads, n_kv_heads, MLP width d_ff, and the vocabulary,
    which is the tokenizer's) is `ModelConfig(d_model=..., n_layers=..., n_heads=..., n_kv_heads=...,
    ffn_multiplier=d_ff / d_model)`: `ffn_hidden` gives d_ff back whenever it is a multiple of 32.

    The architecture options (see `tasks.train.model` for what each computes):
    - `position`: `rope` (rotary, `rope_theta`, optionally `rope_scaling`), `alibi` (linear
      attention biases, Press et al. 2022), `nope` (none: causal attention alone orders tokens) or
      `learned` (an absolute position embedding, GPT-2).
    - `norm`: `rmsnorm` or `layernorm` (without bias); `norm_placement`: `pre` (before each
      sublayer, with a final norm), `post` (after each residual add, as the original Transformer,
      no final norm) or `reordered` (OLMo 2: on each sublayer's output before the residual add,
      with a final norm). `qk_norm` normalises queries and keys before RoPE, per head
      (`qk_norm_scope: head`, Qwen 3) or over the whole projection (`projection`, OLMo 2).
    - Attention: full causal, or `sliding_window` tokens (a query sees itself and the window - 1
      before it); with `global_every: k`, every k-th layer (the k-th, 2k-th, ...) attends to the
      whole context and the others to the window (Gemma 2 at k = 2, Gemma 3 at k = 6).
    - `mlp`: `swiglu` (three matrices) or `gelu` (two: at the same parameters, d_ff = 1.5x
      SwiGLU's, so `ffn_multiplier: 4` matches SwiGLU's 8/3).
    - `mtp_heads`: multi-token prediction (Gloeckle et al. 2024): this many extra heads, each a
      transformer block over the trunk's last hidden state and its own norm, predict tokens
      t + 2, t + 3, ... through the shared output projection. The next-token path (trunk and head)
      is computed exactly as without them; the extra heads only add training loss terms
      (`optim.mtp_weight`) and are left out of inference and export.
    """

    d_model: int = Field(128, gt=0)
    n_layers: int = Field(4, gt=0)
    n_heads: int = Field(4, gt=0)
    # grouped-query attention (Llama 2 70B, Llama 3): query heads share K/V heads in groups of
    # n_heads // n_kv_heads; None is multi-head attention (one K/V head per query head)
    n_kv_heads: int | None = Field(None, gt=0)
    ffn_multiplier: float = Field(8 / 3, gt=0)
    max_seq_len: int = Field(256, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    tie_embeddings: bool = True
    qk_norm: bool = False
    norm_eps: float = Field(1e-5, gt=0)
    position: Position = added_field("rope")
    rope_scaling: RopeScaling | None = added_field(None)
    norm: Norm = added_field("rmsnorm")
    norm_placement: NormPlacement = added_field("pre")
    qk_norm_scope: QKNormScope = added_field("head")
    sliding_window: int | None = added_field(None, gt=0)
    global_every: int | None = added_field(None, gt=1)
    mlp: Mlp = added_field("swiglu")
    mtp_heads: int = added_field(0, ge=0)

    @model_validator(mode="after")
    def _check_options(self) -> ModelConfig:
        if self.rope_scaling is not None and self.position != "rope":
            raise ValueError(f"model.rope_scaling scales rotary positions, but model.position={self.position!r}: "
                             "remove rope_scaling or use position: rope")
        if self.qk_norm_scope != "head" and not self.qk_norm:
            raise ValueError(f"model.qk_norm_scope={self.qk_norm_scope!r} without model.qk_norm: set qk_norm: true "
                             "or leave qk_norm_scope out")
        if self.global_every is not None and self.sliding_window is None:
            raise ValueError(f"model.global_every={self.global_every} makes every {self.global_every}th layer global "
                             "among local ones, but model.sliding_window is not set: give the local layers' window")
        if self.global_every is not None and self.global_every > self.n_layers:
            raise ValueError(f"model.global_every={self.global_every} exceeds model.n_layers={self.n_layers}: no layer "
                             "would be global; lower it or drop global_every for all-local layers")
        return self

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}: "
                "choose n_heads that divides d_model (each head gets d_model // n_heads dims)"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"model.n_kv_heads={self.n_kv_heads} does not divide model.n_heads={self.n_heads}: each K/V "
                "head serves an equal group of query heads; choose a divisor of n_heads"
            )
        if self.head_dim % 2 and self.position == "rope":
            raise ValueError(
                f"model.d_model // model.n_heads = {self.head_dim} is odd: RoPE rotates dimension "
                "pairs, so pick d_model and n_heads giving an even head size"
            )
        return self

    def identity(self) -> dict:
        identity = super().identity()
        if self.kv_heads == self.n_heads:
            # the same model as before n_kv_heads existed: its keys (and checkpoints) stay valid
            del identity["n_kv_heads"]
        return identity

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """K/V heads: n_kv_heads, or n_heads without grouped-query attention."""
        return self.n_kv_heads or self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the K and V projections."""
        return self.kv_heads * self.head_dim

    def is_global(self, layer: int) -> bool:
        """Whether block `layer` (0-based) attends to the whole context rather than a sliding window."""
        if self.sliding_window is None:
            return True
        return self.global_every is not None and (layer + 1) % self.global_every == 0

    def window(self, layer: int) -> int | None:
        """The sliding window of block `layer`, None for full causal attention."""
        return None if self.is_global(layer) else self.sliding_window

    @property
    def ffn_hidden(self) -> int:
        """The MLP's hidden width: ffn_multiplier * d_model rounded up to a multiple of 32."""
        # round() first so float noise (8/3 * 96 = 255.99999...) cannot bump a whole multiple
        raw = round(self.ffn_multiplier * self.d_model, 6)
        return max(FFN_MULTIPLE, math.ceil(raw / FFN_MULTIPLE) * FFN_MULTIPLE)


class OptimConfig(Section):
    """AdamW and the learning-rate schedule (see `tasks.train.schedule`)."""

    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0)  # 0 disables clipping (the norm is still reported)
    schedule: Literal["cosine", "wsd", "linear", "1-sqrt", "constant"] = "cosine"
    warmup_steps: int = Field(10, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    decay_fraction: float = Field(0.2, ge=0, le=1)  # wsd: last fraction of steps decays to min_lr
    # PaLM's auxiliary loss z_loss * log(Z)^2 (Z: the softmax normaliser) keeps logits from drifting
    z_loss: float = Field(0.0, ge=0)
    # multi-token prediction: what is differentiated is the next-token loss plus mtp_weight times
    # the mean of the model's extra heads' losses (model.mtp_heads; DeepSeek-V3 used 0.3, then 0.1)
    mtp_weight: float = added_field(0.3, ge=0)


class HealthConfig(Section):
    """Loss-spike and non-finite-loss detection, and how the loop recovers (see `tasks.train.health`).

    A step's loss is a spike when its robust z-score against the trend of the previous
    `spike_window` step losses (a Theil–Sen line in log(step), and the MAD of its residuals)
    exceeds `spike_zscore`. The loop then rolls back to the newest checkpoint before the bad step,
    replaces the data of the steps it re-runs, optionally with a lowered learning rate, and gives
    up with `TrainingDivergedError` after `max_rollbacks`.
    """

    enabled: bool = True
    spike_zscore: float = Field(6.0, gt=0)
    spike_window: int = Field(50, ge=3)
    min_steps_before_check: int = Field(20, ge=0)  # early losses fall too fast for a stable baseline
    max_rollbacks: int = Field(3, ge=0)
    rollback_lr_factor: float = Field(1.0, gt=0, le=1)  # 1.0: re-run at the scheduled LR
    rollback_lr_steps: int = Field(0, ge=0)  # steps after a rollback that use the lowered LR


class TrainRunConfig(Section):
    """One training run's budget and runtime settings.

    `batch_size` is the global batch: the sequences (of `seq_len` tokens) one optimizer step sees,
    whatever the layout. It is science, part of the key. How the step's rows are split is runtime:
    each of the layout's dp ranks takes `batch_size / dp` rows and runs them as `grad_accum`
    micro-batches of `batch_size / (dp * grad_accum)` rows, so a run can change its layout or its
    micro-batch (to fit memory, or after losing a node) and resume under the same key.
    """

    steps: int = Field(200, gt=0)
    batch_size: int = Field(16, gt=0)
    seq_len: int = Field(128, gt=0)
    grad_accum: int = runtime_field(1, gt=0)
    seed: int = Field(0, ge=0)
    eval_batches: int = Field(8, gt=0)  # fixed validation windows per domain
    checkpoint_every: int = runtime_field(100, gt=0)
    keep_checkpoints: int = runtime_field(2, gt=0)
    keep_every: int | None = runtime_field(None, gt=0)  # checkpoints at multiples of this are never pruned
    log_every: int = runtime_field(10, gt=0)
    device: str = runtime_field("cpu")
    num_threads: int | None = runtime_field(None, gt=0)
    # recompute in backward: "full" every block's activations, "selective" all but the matmul and
    # attention outputs (torchtitan's op-level policy, `tasks.train.parallel`), "none" nothing
    activation_checkpointing: Checkpointing = runtime_field("none")
    # "bf16-mixed": bf16 compute on fp32 master weights and optimizer (FSDP2's MixedPrecisionPolicy
    # with fp32 gradient reduction where FSDP shards, autocast elsewhere); "auto": bf16-mixed on
    # CUDA, fp32 on CPU (bit-reproducible)
    precision: Literal["auto", "bf16-mixed", "fp32"] = runtime_field("auto")
    compile: bool = runtime_field(False)  # torch.compile the model's forward
    peak_tflops: float | None = runtime_field(None, gt=0)  # the device's peak, for MFU; None: no MFU
    # a runtime setting: a clean run is bit-identical whatever it says; it only decides how a
    # run that hits a fault (bad data, a flipped bit) recovers, like a retry policy would
    health: HealthConfig = runtime_field(HealthConfig())

    @model_validator(mode="after")
    def _check_compile_with_checkpointing(self) -> TrainRunConfig:
        if self.activation_checkpointing != "none" and self.compile:
            # torch 2.13: the recomputed activations of a compiled model differ in metadata
            # ("CheckpointError: Recomputed values ... have different metadata") in the first backward.
            raise ValueError(f"run.activation_checkpointing={self.activation_checkpointing!r} cannot be combined with "
                             "run.compile yet (torch 2.13 fails in the first backward): set one of them off")
        return self

    @property
    def resolved_precision(self) -> Precision:
        """The precision this run trains in (`precision`, with "auto" decided by the device)."""
        if self.precision != "auto":
            return self.precision
        return "bf16-mixed" if self.device.startswith("cuda") else "fp32"

    def check_fits(self, model: ModelConfig) -> None:
        """Raise ValueError when this run's sequences are longer than the model supports."""
        if self.seq_len > model.max_seq_len:
            raise ValueError(
                f"train.seq_len={self.seq_len} exceeds model.max_seq_len={model.max_seq_len}: "
                "lower seq_len or raise max_seq_len"
            )


class LongDocuments(Section):
    """A length-aware selection (a long-context phase's data): every train document of at least
    `min_tokens` tokens (its end-of-document token included) is read `upweight` times in the phase's
    stream, so its windows are drawn `upweight` times as often as a shorter document's tokens."""

    min_tokens: int = Field(gt=0, description="a document this long or longer counts as long")
    upweight: int = Field(4, ge=2, description="how many times each long document is in the phase's stream")


class DataPhase(Section):
    """One phase of the train stage's data schedule (`train.phases`, see `tasks.train.data_schedule`).

    A phase ends after step `until_step`, or once the run has trained `until_tokens` of its token
    budget (run.steps x batch x seq_len); the last phase runs to the end and names neither. It draws
    from `mixture` (domain -> weight, normalised; None: the mix stage's weights), in `order`:
    `random` windows, or `quality` (a curriculum: each domain's documents in ascending quality score,
    unscored first, walked through once over the phase), at `seq_len` tokens (None: run.seq_len).

    A long-context extension is a phase with a longer `seq_len` and new rotary positions:
    `rope_theta` (a new base) and/or `rope_scaling` (linear, NTK-aware or YaRN, the model's own
    options), applied to the model when the phase starts and kept by every later phase that sets
    none (the model is built with `max_seq_len` of the longest phase). `long_documents` upweights
    long documents in the phase's data.
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="names the phase in metrics, stats and files")
    until_step: int | None = Field(None, gt=0, description="the phase's last step")
    until_tokens: float | None = Field(None, gt=0, le=1, description="the share of the run's token budget "
                                                                      "trained when the phase ends")
    mixture: dict[str, float] | None = Field(None, description="domain -> weight; None: the mix stage's mixture")
    order: Literal["random", "quality"] = "random"
    seq_len: int | None = Field(None, gt=0, description="the phase's sequence length; None: run.seq_len")
    rope_theta: float | None = added_field(None, gt=0, description="the rotary base from this phase on; None: "
                                                                   "the previous phase's (at first model.rope_theta)")
    rope_scaling: RopeScaling | None = added_field(None, description="rotary scaling from this phase on; None: the "
                                                                     "previous phase's (at first model.rope_scaling)")
    long_documents: LongDocuments | None = added_field(None, description="upweight long documents in this phase")

    @property
    def changes_rope(self) -> bool:
        return self.rope_theta is not None or self.rope_scaling is not None

    @model_validator(mode="after")
    def _one_bound(self) -> DataPhase:
        if self.until_step is not None and self.until_tokens is not None:
            raise ValueError(f"phase {self.name!r} sets until_step and until_tokens: keep one")
        if self.mixture is not None and (any(w < 0 for w in self.mixture.values()) or sum(self.mixture.values()) <= 0):
            raise ValueError(f"phase {self.name!r}: mixture weights must be >= 0 and sum to more than 0")
        if self.long_documents is not None and self.order == "quality":
            raise ValueError(f"phase {self.name!r}: order quality walks each document once, so long_documents "
                             "cannot upweight any: keep one of them")
        return self

    def names_used(self) -> list[Reference]:
        return super().names_used() + ([Reference("mixture", "domain", tuple(self.mixture), keyed=True)]
                                       if self.mixture else [])


def check_phases(phases: list[DataPhase]) -> None:
    """ValueError unless every phase but the last ends (until_step / until_tokens), the last does not,
    the bounds grow and the names differ."""
    if not phases:
        return
    names = [p.name for p in phases]
    if len(set(names)) < len(names):
        raise ValueError(f"train.phases: names {names} repeat; give each phase its own")
    for p in phases[:-1]:
        if p.until_step is None and p.until_tokens is None:
            raise ValueError(f"train.phases: phase {p.name!r} is not the last, so it needs until_step or until_tokens")
    last = phases[-1]
    if last.until_step is not None or last.until_tokens is not None:
        raise ValueError(f"train.phases: the last phase {last.name!r} runs to the end of the run: remove its "
                         "until_step / until_tokens (or add a phase after it)")
    for kind in ("until_step", "until_tokens"):
        bounds = [getattr(p, kind) for p in phases if getattr(p, kind) is not None]
        if bounds != sorted(set(bounds)):
            raise ValueError(f"train.phases: {kind} must grow from phase to phase, got {bounds}")


def check_phases_fit(phases: list[DataPhase], model: ModelConfig, where: str = "train.phases") -> None:
    """ValueError when a phase changes rotary positions of a model without them (`model.position` not rope)."""
    for i, phase in enumerate(phases):
        if phase.changes_rope and model.position != "rope":
            raise ValueError(f"{where}[{i}] ({phase.name!r}) sets rope_theta / rope_scaling, but model.position="
                             f"{model.position!r} has no rotary positions: use position: rope, or drop them")


def phase_model(model: ModelConfig, phases: list[DataPhase], max_seq_len: int | None = None) -> ModelConfig:
    """`model` as it trains after `phases` (the phases started so far, in order): the rotary base and scaling
    of the last phase that set them; `max_seq_len` if given."""
    update: dict = {} if max_seq_len is None else {"max_seq_len": max_seq_len}
    for phase in phases:
        if phase.rope_theta is not None:
            update["rope_theta"] = phase.rope_theta
        if phase.rope_scaling is not None:
            update["rope_scaling"] = phase.rope_scaling
    return revalidated(model.model_copy(update=update)) if update else model


class ParallelDims(Section):
    """How many ways to split the layers (pp), the data (dp), each sequence (cp) and each layer (tp);
    their product is the world size. train.seq_len must be divisible by cp (checked where it is
    known: `tasks.train.parallel.check_context_split`). Activation checkpointing is not a split:
    it is `run.activation_checkpointing`, for one process and many alike.

    With pp > 1, `pp_schedule` orders the micro-batches (torch.distributed.pipelining): "gpipe"
    runs every forward before any backward (each stage holds all micro-batches' activations),
    "1f1b" alternates once the pipeline is full (stage s holds at most pp - s), and
    "interleaved-1f1b" gives each rank `stages_per_rank` non-adjacent slices of the layers
    (virtual stages), cutting the bubble by that factor.
    """

    pp: int = Field(1, gt=0)
    dp: int = Field(1, gt=0)
    cp: int = Field(1, gt=0)
    tp: int = Field(1, gt=0)
    dp_mode: Literal["fsdp", "ddp"] = "fsdp"
    pp_schedule: PipelineSchedule = "1f1b"
    stages_per_rank: int = Field(1, gt=0)  # virtual pipeline stages per rank: > 1 only for interleaved-1f1b

    @model_validator(mode="after")
    def _check_combinations(self) -> ParallelDims:
        if self.dp_mode == "ddp" and self.tp > 1:
            raise ValueError(
                f"parallel.dp_mode='ddp' cannot be combined with parallel.tp={self.tp}: "
                "DDP does not handle DTensor parameters; use dp_mode='fsdp' for dp x tp"
            )
        if self.pp > 1 and self.tp > 1:
            raise ValueError(
                f"parallel.pp={self.pp} with tp={self.tp}: pipeline parallel does not compose with tensor "
                "parallel here yet; use pp with dp (dp_mode='fsdp') only, or set tp=1"
            )
        if self.pp > 1 and self.dp > 1 and self.dp_mode == "ddp":
            raise ValueError(
                f"parallel.pp={self.pp} with dp={self.dp} and dp_mode='ddp': pipeline stages are data-parallel "
                "with FSDP only (each stage sharded over its dp group); set dp_mode='fsdp'"
            )
        return self

    @model_validator(mode="after")
    def _check_context_parallel(self) -> ParallelDims:
        if self.cp > 1 and self.pp > 1:
            raise ValueError(
                f"parallel.cp={self.cp} with pp={self.pp}: context parallel does not compose with pipeline "
                "parallel here; use cp with dp and tp only, or set cp=1"
            )
        return self

    @model_validator(mode="after")
    def _check_schedule(self) -> ParallelDims:
        if self.pp_schedule == "interleaved-1f1b" and self.stages_per_rank < 2:
            raise ValueError("parallel.pp_schedule='interleaved-1f1b' needs parallel.stages_per_rank >= 2 "
                             "(the layer slices each rank holds); with one, use '1f1b'")
        if self.pp_schedule != "interleaved-1f1b" and self.stages_per_rank > 1:
            raise ValueError(f"parallel.stages_per_rank={self.stages_per_rank} needs "
                             "parallel.pp_schedule='interleaved-1f1b': gpipe and 1f1b run one stage per rank")
        return self

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all: pp ranks times the virtual stages each holds."""
        return self.pp * self.stages_per_rank

    def check_holds_batch(self, run: TrainRunConfig) -> None:
        """ValueError saying why, when this layout cannot split `run`'s global batch evenly."""
        if run.batch_size % self.dp:
            raise ValueError(
                f"train.run.batch_size={run.batch_size} (the global batch, sequences per step) does not split "
                f"over parallel.dp={self.dp} data-parallel ranks: choose a dp that divides it"
            )
        per_rank = run.batch_size // self.dp
        if per_rank % run.grad_accum:
            raise ValueError(
                f"each of parallel.dp={self.dp} ranks gets {per_rank} of the {run.batch_size} sequences per step, "
                f"which do not split into train.run.grad_accum={run.grad_accum} equal micro-batches: choose a "
                f"grad_accum that divides {per_rank}"
            )
        problem = schedule_problem(self.pp, self.pp_schedule, run.grad_accum)
        if problem:
            raise ValueError(problem)


def schedule_problem(pp: int, schedule: PipelineSchedule, microbatches: int) -> str | None:
    """Why torch's `schedule` cannot run `microbatches` (train.run.grad_accum) per step on pp ranks; None if it can."""
    if pp > 1 and schedule == "1f1b" and microbatches < pp:
        return (f"parallel.pp_schedule='1f1b' needs at least parallel.pp={pp} micro-batches per step, got "
                f"train.run.grad_accum={microbatches}: raise grad_accum or use 'gpipe'")
    rounds = max(1, microbatches // pp)
    if pp > 1 and schedule == "interleaved-1f1b" and microbatches % rounds:
        return (f"parallel.pp_schedule='interleaved-1f1b' runs micro-batches in rounds of pp={pp}: "
                f"train.run.grad_accum={microbatches} is not a multiple of its {rounds} rounds; use a multiple of pp")
    return None
