"""The parallelism planner: its memory model against memory measured on a real model, its
constraints, its step-time terms, and the verdicts it must reach on published configurations.
(The whole estimate against torch's memory tracking on fake process groups: test_verify.py.)"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from kiln.tasks.errors import ConfigError
from kiln.tasks.launch.cluster import ClusterSpec
from kiln.tasks.train.config import ModelConfig, ParallelDims, TrainRunConfig
from kiln.tasks.train.distributed import make_optimizer
from kiln.tasks.train.loss import linear_cross_entropy, objective
from kiln.tasks.train.model import build_model, count_parameters, flops_per_token
from kiln.tasks.train.parallel import apply_activation_checkpointing
from kiln.tasks.train.plan_memory import (
    activation_bytes_per_layer,
    head_activation_bytes,
    matmul_elements,
    mtp_activation_bytes,
    rank_memory,
    rank_parameters,
)
from kiln.tasks.train.planner import (
    CandidateLayout,
    checked_layout,
    estimate_memory,
    estimate_step_time,
    forecast_record,
    forecast_training,
    legal_layouts,
    load_preset,
    load_section_file,
    plan_parallelism,
    plan_phases,
    preset_vocab_size,
    render_phase_plans,
    render_plan_report,
    resolve_parallel,
)

ROOT = Path(__file__).resolve().parents[3]
V = 97
H100 = ClusterSpec(gpus_per_node=8)  # the defaults describe an H100 SXM node
RESERVED = int(H100.reserved_gb * 2**30)


def preset(name: str) -> ModelConfig:
    return load_section_file(ROOT / "configs" / "models" / f"{name}.yaml", ModelConfig)


SMALL = [
    ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=64),
    ModelConfig(d_model=96, n_layers=3, n_heads=6, n_kv_heads=2, max_seq_len=64, tie_embeddings=False),
]
ONE_DEVICE = CandidateLayout(1, 1, 1, 1, 2, "none")


# ---- memory model vs. measured ------------------------------------------------------------------


@pytest.mark.parametrize("cfg", SMALL)
def test_model_states_match_a_real_adamw_step(cfg: ModelConfig) -> None:
    model = build_model(cfg, V, seed=0)
    opt = make_optimizer(model, __import__("kiln.tasks.train.config", fromlist=["OptimConfig"]).OptimConfig(),
                         torch.device("cpu"))
    idx = torch.randint(0, V, (2, 16))
    model(idx, targets=idx)[1].backward()
    opt.step()
    params = list(model.parameters())  # tied weights appear once
    assert sum(nbytes(p) for p in params) == 4 * rank_parameters(cfg, V, ONE_DEVICE) == 4 * count_parameters(cfg, V)
    assert sum(nbytes(p.grad) for p in params) == 4 * count_parameters(cfg, V)
    # AdamW's two moments and its per-tensor fp32 `step` counter
    states = sum(nbytes(v) for s in opt.state.values() for v in s.values())
    est = rank_memory(cfg, V, 16, ONE_DEVICE, 1, 0, "fp32", 0)
    assert states == est.optimizer == 8 * count_parameters(cfg, V) + 4 * len(params)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _alive_after_forward(cfg: ModelConfig, batch: int, seq: int, checkpointing: str, compute: str) -> dict[str, int]:
    """Bytes alive once the loss is computed, as MemTracker counts them (weights excluded), for
    one block alone (inputs: its input; keeps: what it saved, and its output), for the head alone
    as the model computes its loss (its input, the final norm's, the fused loss's), as a
    pipeline's last stage does (logits, then `objective`), and for the multi-token prediction
    heads alone (their input, the trunk's output, and what they keep)."""
    model = build_model(cfg, V, seed=0)
    apply_activation_checkpointing(model, checkpointing)
    if compute == "bf16":  # what FSDP2's bf16 all-gathered weights compute with (buffers stay fp32)
        model = model.to(torch.bfloat16)
        if model.rope_cos is not None:
            model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    idx = torch.randint(0, V, (batch, seq))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if compute == "autocast" else contextlib.nullcontext()
    rope = (model.rope_cos[:seq], model.rope_sin[:seq]) if model.rope_cos is not None else (None, None)
    out = {}
    for part in ("block", "head", "logits_head", "mtp"):
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            with autocast:
                x = model.tok_emb(idx)
                if part == "block":
                    x = model.blocks[0](x, *rope)
                elif part == "head":  # Transformer.forward's loss: no local keeps the norm's output
                    loss = linear_cross_entropy(model.norm(x) if model.norm is not None else x, model.lm_head.weight,
                                                idx)
                elif part == "logits_head":
                    h = x.detach().requires_grad_()
                    loss = objective(model.lm_head(model.norm(h) if model.norm is not None else h), idx, 0.0)
                else:
                    loss = [linear_cross_entropy(model._mtp_hidden(k, x, *rope)[:, :seq - k - 1], model.lm_head.weight,
                                                 idx[:, k + 1:])[1] for k in range(cfg.mtp_heads)]
            out[part] = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"] - tracker_weights(model)
        del x
        if part != "block":
            del loss
    return out


def tracker_weights(model: torch.nn.Module) -> int:
    return sum(nbytes(t) for t in [*model.parameters(), *model.buffers()])


# every architecture option, in combinations (the first two are today's Llama blocks, MHA and GQA)
OPTION_MODELS = [
    *SMALL,
    ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=64, position="alibi", sliding_window=8, norm="layernorm",
                norm_placement="post", mlp="gelu", mtp_heads=1),
    ModelConfig(d_model=96, n_layers=3, n_heads=6, n_kv_heads=2, max_seq_len=64, position="learned",
                norm_placement="reordered", qk_norm=True, qk_norm_scope="projection", mtp_heads=2),
    ModelConfig(d_model=96, n_layers=3, n_heads=6, n_kv_heads=2, max_seq_len=64, position="nope", norm="layernorm",
                qk_norm=True, sliding_window=8, global_every=2),
    ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=64, norm="layernorm", norm_placement="reordered",
                qk_norm=True, qk_norm_scope="projection", position="alibi",
                rope_scaling=None),
]


@pytest.mark.parametrize("cfg", OPTION_MODELS, ids=["llama", "llama-gqa", "alibi-window-ln-post-gelu-mtp",
                                                   "learned-reordered-qkproj-mtp2", "nope-ln-qkhead-local-global",
                                                   "alibi-ln-reordered-qkproj"])
@pytest.mark.parametrize("compute", ["fp32", "bf16", "autocast"])
@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
def test_activation_formulas_match_what_a_real_forward_keeps(cfg: ModelConfig, compute: str, checkpointing: str) -> None:
    """Exact to the byte, per block, for the head (fused loss and a pipeline's logits) and for the
    multi-token prediction heads, in every precision path and recompute mode, for every
    architecture option. Autocast's bf16 weight casts are working copies, not activations: the
    planner counts them apart (kept by the blocks it does not recompute)."""
    batch, seq = 2, 32
    tokens = batch * seq
    alive = _alive_after_forward(cfg, batch, seq, checkpointing, compute)
    residual = 2 if compute == "bf16" else 4  # the block's output, the next block's input
    casts = 2 * matmul_elements(cfg, 1) if compute == "autocast" and checkpointing == "none" else 0
    per_layer = activation_bytes_per_layer(cfg, batch, seq, checkpointing=checkpointing, compute=compute)
    assert alive["block"] == per_layer + residual * cfg.d_model * tokens + casts
    assert alive["head"] == head_activation_bytes(cfg, V, batch, seq, compute=compute)
    head_casts = 2 * V * cfg.d_model if compute == "autocast" else 0  # autocast's cached cast of the head's weight
    loss_scalars = 8  # the cross-entropy and what `objective` differentiates
    assert alive["logits_head"] == head_activation_bytes(cfg, V, batch, seq, compute=compute, fused=False) \
        + head_casts + loss_scalars
    trunk_output = tokens * (residual * cfg.d_model + 8)  # and the token ids: the head counts both
    mtp_casts = cfg.mtp_heads * casts
    if cfg.mtp_heads:
        assert alive["mtp"] == mtp_activation_bytes(cfg, V, batch, seq, checkpointing=checkpointing, compute=compute) \
            + trunk_output + mtp_casts


def test_activation_exact_numbers_and_sharding() -> None:
    cfg = SMALL[0]  # d 64, f 192, 4 heads
    # none, fp32: 64 tokens x (4 x (8 x 64 + 2 x 64 + 4 x 192) + 4 x (2 + 4)) = 64 x 5656, and
    # RoPE's 4 fp32 tables of 32 positions x head_dim 16
    assert activation_bytes_per_layer(cfg, 2, 32, compute="fp32") == 64 * 5656 + 4 * 32 * 16 * 4
    assert activation_bytes_per_layer(cfg, 2, 32, checkpointing="full", compute="bf16") == 64 * 2 * 64
    # TP splits what is split by heads and leaves the replicated stream (and its norms) whole
    whole, half = activation_bytes_per_layer(cfg, 2, 32), activation_bytes_per_layer(cfg, 2, 32, tp=2)
    assert whole / 2 < half < whole
    # CP splits the tokens but keeps the other chunk's gathered K and V: 32 tokens x 2 x 64 dims x
    # 2 bytes (bf16), and the causal mask of its 16 queries per sequence over 32 keys (bf16 too)
    assert activation_bytes_per_layer(cfg, 2, 32, cp=2) == whole // 2 + 32 * 2 * 64 * 2 + 2 * 16 * 32
    assert activation_bytes_per_layer(cfg, 2, 32, checkpointing="selective") < whole


def test_pipeline_ranks_hold_the_schedules_micro_batches_in_flight() -> None:
    """The first stage holds every micro-batch under GPipe, pp of them under 1F1B (torch's own
    schedules are checked against `in_flight` in test_verify.py)."""
    cfg = preset("7b")
    per_layer = activation_bytes_per_layer(cfg, 1, 4096, compute="bf16")
    ofb = estimate_memory(cfg, 32000, 4096, CandidateLayout(1, 1, 4, 1, 1, "none"), 8, RESERVED)
    gpipe = estimate_memory(cfg, 32000, 4096, CandidateLayout(1, 1, 4, 1, 1, "none", "gpipe"), 8, RESERVED)
    # 1F1B: the first stage is the heavier, its 4 micro-batches of 8 blocks (the whole model's worth)
    # outweigh the last stage's head
    assert ofb.rank == 0 and ofb.activations == 4 * 8 * per_layer
    # GPipe: every stage holds all 8 micro-batches, so the last one, with the head, is the heavier
    assert gpipe.rank == 3 and gpipe.activations == 8 * 8 * per_layer
    # weights: 8 of 32 blocks plus one V x d matrix, instead of everything
    assert ofb.params < 4 * count_parameters(cfg, 32000) / 3


def test_legal_layouts_respect_the_constraints() -> None:
    cfg = ModelConfig(d_model=768, n_layers=12, n_heads=12, max_seq_len=2048)
    cluster = ClusterSpec(gpus_per_node=8, nodes=2)
    layouts = legal_layouts(cfg, 2048, 96, cluster)
    assert {lo.tp for lo in layouts} == {1, 2, 4}  # 8 does not divide 12 heads; 16 leaves the node
    assert {lo.pp for lo in layouts} == {1, 2, 4, 8}  # 16 stages would be more than the 12 blocks
    assert {lo.pp for lo in layouts if lo.schedule == "interleaved-1f1b"} == {2, 4}  # 2 pp stages <= 12 blocks
    for lo in layouts:
        assert lo.world_size == 16
        assert 96 % (lo.dp * lo.micro_batch) == 0
        if lo.schedule == "1f1b" and lo.pp > 1:
            assert 96 // (lo.dp * lo.micro_batch) >= lo.pp  # torch's 1F1B needs a micro-batch per stage
    assert {lo.checkpointing for lo in layouts} == {"none", "selective", "full"}
    assert {lo.schedule for lo in layouts if lo.pp > 1} == {"gpipe", "1f1b", "interleaved-1f1b"}
    # grouped-query attention: tp must split the 2 K/V heads into whole heads too
    gqa = cfg.model_copy(update={"n_kv_heads": 2})
    assert {lo.tp for lo in legal_layouts(gqa, 2048, 96, cluster)} == {1, 2}


def test_step_time_terms() -> None:
    cfg = preset("7b")
    pure = estimate_step_time(cfg, 32000, 4096, 256, CandidateLayout(8, 1, 1, 1, 1, "none"), H100)
    assert pure.tp_comm == pure.pp_comm == pure.cp_comm == pure.bubble == 0.0
    # dp=2, micro-batch 2 -> 64 micro-batches; pp=4 bubble = (pp - 1) / m of the compute
    piped = estimate_step_time(cfg, 32000, 4096, 256, CandidateLayout(2, 1, 4, 1, 2, "none"), H100)
    assert piped.bubble == pytest.approx(piped.compute * 3 / 64)
    assert piped.compute == pytest.approx(pure.compute)  # same FLOPs, same devices
    # interleaving 2 stages per rank halves the bubble and doubles the stage boundaries crossed
    interleaved = estimate_step_time(cfg, 32000, 4096, 256, CandidateLayout(2, 1, 4, 1, 2, "none", "interleaved-1f1b", 2),
                                     H100)
    assert interleaved.bubble == pytest.approx(piped.bubble / 2) and interleaved.pp_comm == pytest.approx(2 * piped.pp_comm)
    full = estimate_step_time(cfg, 32000, 4096, 256, CandidateLayout(8, 1, 1, 1, 1, "full"), H100)
    assert full.recompute == pytest.approx(full.compute / 3, rel=0.01)  # one extra forward of three passes
    # selective keeps every matmul and attention output: it recomputes no FLOPs
    assert estimate_step_time(cfg, 32000, 4096, 256, CandidateLayout(8, 1, 1, 1, 1, "selective"), H100).recompute == 0
    tp = estimate_step_time(cfg, 32000, 4096, 256, CandidateLayout(4, 2, 1, 1, 1, "none"), H100)
    assert tp.tp_comm > 0
    # a pipeline stage all-gathers and reduce-scatters once per step, not once per micro-batch
    assert piped.fsdp_comm < pure.fsdp_comm / 10


def test_global_batch_in_tokens_or_sequences() -> None:
    cfg = preset("1b")
    a = plan_parallelism(cfg, 32000, 2048, H100, global_batch_tokens=512 * 2048)
    b = plan_parallelism(cfg, 32000, 2048, H100, global_batch_seqs=512)
    assert a.global_batch_seqs == b.global_batch_seqs == 512
    assert a.best == b.best
    with pytest.raises(ConfigError, match="multiple of 2048"):
        plan_parallelism(cfg, 32000, 2048, H100, global_batch_tokens=1000)
    with pytest.raises(ConfigError, match="gpus_per_node"):
        plan_parallelism(cfg, 32000, 2048, ClusterSpec(), global_batch_seqs=8)


# ---- published configurations -------------------------------------------------------------------


def test_7b_trains_with_pure_fsdp_on_one_8x80gb_node() -> None:
    search = plan_parallelism(preset("7b"), 32000, 4096, H100, global_batch_seqs=1024)
    best = search.require_best()
    assert (best.layout.dp, best.layout.tp, best.layout.pp, best.layout.cp) == (8, 1, 1, 1)
    assert best.memory.total <= 80 * 2**30
    # ZeRO-3 over 8: 16 bytes x 6.74B / 8 = 12.6 GiB of weights, grads and Adam states per GPU
    # (each tensor's first dimension padded to a multiple of 8, and AdamW's step counters)
    assert best.memory.model_states == pytest.approx(16 * 6_738_415_616 / 8, rel=1e-4)
    ranked_times = [p.time.total for p in search.ranked]
    assert min(ranked_times) >= best.time.total * 0.99  # nothing materially faster was passed over
    assert all(not p.fits and p.rejected for p in search.rejected)


def test_70b_does_not_fit_on_one_8x80gb_node() -> None:
    search = plan_parallelism(preset("70b"), preset_vocab_size("70b"), 4096, H100, global_batch_seqs=1024)
    assert search.best is None
    pure = [p for p in search.rejected if p.layout.tp == p.layout.pp == p.layout.cp == 1]
    # 16 bytes x 70.55B / 8 = 131 GiB of weights, grads and Adam states per GPU before any activation
    assert pure and all(p.memory.model_states > 130 * 2**30 for p in pure)
    assert "model states alone take 131.4 GiB" in pure[0].rejected  # the lightest pure-FSDP plan
    with pytest.raises(ConfigError, match="add nodes"):
        search.require_best()
    assert "NO PLAN FITS" in render_plan_report(search)


def test_70b_fits_on_eight_nodes_by_recomputing_every_block() -> None:
    cluster = H100.model_copy(update={"nodes": 8})
    search = plan_parallelism(preset("70b"), preset_vocab_size("70b"), 4096, cluster, global_batch_seqs=1024)
    best = search.require_best()
    assert best.layout.world_size == 64
    plain = next(p for p in search.rejected if p.layout == CandidateLayout(64, 1, 1, 1, 1, "none"))
    assert "activations alone take" in plain.rejected
    # pure FSDP fits only by recomputing every block, a third more compute; FSDP's per-micro-batch
    # gathers (89 s at 50 GB/s between nodes) hide behind that compute, while TP's all-reduces
    # would add to it, so pure FSDP is the fastest
    pure = [p for p in search.ranked if p.layout.tp == p.layout.pp == p.layout.cp == 1]
    assert pure and {p.layout.checkpointing for p in pure} == {"full"}
    assert best == pure[0] and best.time.exposed_overlap_comm == 0
    with_tp = min((p for p in search.ranked if p.layout.tp > 1), key=lambda p: p.time.total)
    assert with_tp.time.total > best.time.total and with_tp.time.tp_comm > 0


def test_13b_on_8x_a100_40gb_splits_the_sequence_rather_than_recompute_blocks() -> None:
    cluster = load_section_file(ROOT / "configs" / "clusters" / "a100-40gb-1node.yaml", ClusterSpec)
    search = plan_parallelism(preset("13b"), 32000, 4096, cluster, global_batch_seqs=512)
    best = search.require_best()
    # 16 x 13.0B / 8 = 24.2 GiB of states leave too little of 40 GiB for a 4096-token sequence's
    # activations, so pure FSDP must recompute every block ...
    pure = [p for p in search.ranked if p.layout.tp == p.layout.pp == p.layout.cp == 1]
    assert pure and {p.layout.checkpointing for p in pure} == {"full"}
    # ... while splitting the sequence keeps the matmul outputs (selective: no FLOPs recomputed) and wins
    assert best.layout.checkpointing != "full" and best.layout.cp > 1 and best.time.recompute == 0
    assert "pure FSDP fits but is slower" in render_plan_report(search)


def test_report_explains_the_choice() -> None:
    report = render_plan_report(plan_parallelism(preset("7b"), 32000, 4096, H100, global_batch_seqs=1024))
    assert "Chosen: dp=8 tp=1 pp=1 cp=1 micro-batch=1 checkpointing=none" in report
    assert "model states 12.6" in report
    assert "pure FSDP needs no per-layer TP traffic" in report
    assert "Runners-up:" in report and "Best of each (dp, tp, pp, cp) shape:" in report


def test_search_serialises_for_the_run_record() -> None:
    search = plan_parallelism(preset("1b"), 32000, 2048, H100, global_batch_seqs=256)
    record = json.loads(json.dumps(search.to_dict()))
    assert record["best"]["layout"] == asdict(search.require_best().layout)
    assert record["best"]["memory"]["total"] == search.require_best().memory.total
    assert record["num_fitting"] + record["num_rejected"] == len(search.ranked) + len(search.rejected)


def test_cluster_presets_load_and_bad_keys_name_the_file(tmp_path: Path) -> None:
    for path in sorted((ROOT / "configs" / "clusters").glob("*.yaml")):
        assert load_section_file(path, ClusterSpec).nodes >= 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: 2\ngpu_per_node: 8\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*gpu_per_node"):
        load_section_file(bad, ClusterSpec)
    broken = tmp_path / "broken.yaml"
    broken.write_text("nodes: 2\ngpus_per_node: [8\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml:3: not valid YAML"):  # the config loader's message
        load_section_file(broken, ClusterSpec)


def test_presets_by_name_or_path() -> None:
    assert load_preset("7b", ModelConfig) == preset("7b")
    assert load_preset(str(ROOT / "configs" / "clusters" / "h100-1node.yaml"), ClusterSpec).gpus_per_node == 8
    assert (preset_vocab_size("8b"), preset_vocab_size("7b")) == (128256, 32000)  # the tokenizer each was published with
    with pytest.raises(ConfigError, match="use one of 125m, 13b, 1b, 350m, 405b, 70b, 7b, 8b, tiny"):
        load_preset("3b", ModelConfig)


def test_auto_layout_is_the_planners_choice_with_its_micro_batch_and_recompute() -> None:
    model, cluster = load_preset("7b", ModelConfig), load_preset("h100-1node", ClusterSpec)
    run = TrainRunConfig(batch_size=512, seq_len=4096, device="cuda")
    dims, resolved = resolve_parallel("auto", model, run, 32000, cluster)
    best = plan_parallelism(model, 32000, 4096, cluster, global_batch_seqs=512).require_best()
    assert (dims.dp, dims.tp, dims.pp, dims.cp) == (best.layout.dp, best.layout.tp, best.layout.pp, best.layout.cp)
    assert resolved.grad_accum == best.num_microbatches == 512 // (dims.dp * best.layout.micro_batch)
    assert resolved.activation_checkpointing == best.layout.checkpointing
    assert dims.pp_schedule == best.layout.schedule and dims.stages_per_rank == best.layout.stages_per_rank
    assert resolved.identity() == run.identity()  # only runtime fields moved: the key stays
    dims.check_holds_batch(resolved)


def test_auto_on_cpus_is_one_data_parallel_process_per_node_and_a_given_layout_is_kept() -> None:
    run = TrainRunConfig(batch_size=8)
    assert resolve_parallel("auto", ModelConfig(), run, 512, ClusterSpec(nodes=2)) == (ParallelDims(dp=2), run)
    given = ParallelDims(dp=2, tp=1)
    assert resolve_parallel(given, ModelConfig(), run, 512, ClusterSpec()) == (given, run)


def test_a_given_layout_that_cannot_hold_the_batch_is_a_config_error_naming_train_parallel() -> None:
    run = TrainRunConfig(batch_size=4)
    assert checked_layout(ParallelDims(dp=2), ModelConfig(), run, 512, ClusterSpec()) == (ParallelDims(dp=2), run)
    with pytest.raises(ConfigError, match=r"train.parallel=\{'dp': 3\}: train.run.batch_size=4 .* does not split"):
        checked_layout(ParallelDims(dp=3), ModelConfig(), run, 512, ClusterSpec())


# ---- forecast of a training run -----------------------------------------------------------------


def test_forecast_of_tiny_train_on_one_h100_is_step_time_times_steps() -> None:
    """configs/tiny.yaml's train run on one H100: one device, no communication, so the step is its
    FLOPs at 40% of 989 TFLOP/s."""
    model = ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=64)
    run = TrainRunConfig(steps=40, batch_size=8, seq_len=64)
    forecast = forecast_training(model, 512, run, ParallelDims(), ClusterSpec(gpus_per_node=1))
    assert flops_per_token(model, 512, 64) == 935_808
    step_s = 935_808 * 8 * 64 / (989e12 * 0.4)
    assert forecast.to_dict() == {
        "accelerator": "H100-SXM-80GB", "layout": "dp=1 tp=1 pp=1 cp=1 micro-batch=8 checkpointing=none",
        "devices": 1, "step_s": step_s, "steps": 40, "wall_s": step_s * 40, "accelerator_s": step_s * 40,
        "device_hours": step_s * 40 / 3600}


def test_forecast_of_auto_is_the_planners_choice_on_every_device() -> None:
    run = TrainRunConfig(steps=1000, batch_size=1024, seq_len=4096)  # on CPU here: the forecast is for the GPUs
    forecast = forecast_training(preset("7b"), 32000, run, "auto", H100)
    best = plan_parallelism(preset("7b"), 32000, 4096, H100, global_batch_seqs=1024).require_best()
    assert forecast.layout == best.layout and forecast.step_s == best.time.total  # what `kiln plan CONFIG` shows
    assert forecast.accelerator_s == best.time.total * 1000 * 8
    assert forecast.to_dict()["device_hours"] == pytest.approx(135.7297, abs=1e-4)


def test_forecast_of_a_given_layout_prices_its_micro_batch_and_recompute() -> None:
    run = TrainRunConfig(steps=10, batch_size=256, seq_len=4096, grad_accum=4, activation_checkpointing="full")
    forecast = forecast_training(preset("7b"), 32000, run, ParallelDims(dp=8), H100)
    layout = CandidateLayout(8, 1, 1, 1, 8, "full")  # 256 / (8 ranks x 4 micro-batches)
    step = estimate_step_time(preset("7b"), 32000, 4096, 256, layout, H100)
    assert forecast.layout == layout and forecast.step_s == step.total
    assert step.recompute == pytest.approx(step.compute / 3, rel=0.01)


def test_no_forecast_without_accelerators_or_for_a_layout_that_cannot_hold_the_batch() -> None:
    model, run = ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=64), TrainRunConfig(batch_size=8, seq_len=64)
    assert forecast_record(model, 512, run, ParallelDims(), ClusterSpec()) == {
        "skipped": "cluster.gpus_per_node is 0: the forecast prices accelerator time; describe the GPUs "
                   "(a configs/clusters/*.yaml preset) to get one"}
    skipped = forecast_record(model, 512, run, ParallelDims(dp=3), ClusterSpec(gpus_per_node=8))["skipped"]
    assert skipped.startswith("train.parallel={'dp': 3}: train.run.batch_size=8 (the global batch")


def test_a_long_context_phase_is_priced_and_gets_context_parallelism_when_a_rank_cannot_hold_it() -> None:
    model = preset("8b").model_copy(update={"max_seq_len": 262144})
    search = plan_parallelism(model, 32000, 8192, H100, global_batch_seqs=8)
    assert search.require_best().layout.cp == 1
    phases = plan_phases(search, [("base", 8192), ("x4", 32768), ("x32", 262144)])
    assert [p.name for p in phases] == ["x4", "x32"]  # a phase at the run's own length is the plan above
    x4, x32 = phases
    # 8 sequences of 262,144 tokens: the run's layout is far over 80 GiB, and no layout with cp = 1 fits
    assert not x32.fits and x32.unsplit is None and not x32.single_rank_fits
    assert x32.as_planned.memory.total > 80 * 2**30
    assert x32.suggested.fits and x32.suggested.layout.cp > 1
    assert 262144 % x32.suggested.layout.cp == 0
    text = render_phase_plans(search, [x4, x32])
    assert (f"phase 'x32': 8 sequences of 262,144 tokens (2,097,152 tokens per step): the chosen layout needs "
            f"{x32.as_planned.memory.total / 2**30:.1f} GiB per device > 80 GiB") in text
    assert (f"A rank cannot hold one 262,144-token sequence (no layout with cp=1 fits): use context parallelism, "
            f"cp={x32.suggested.layout.cp}: {x32.suggested.layout.describe()}") in text
    assert f"resume the phase under train.parallel={x32.suggested.layout_dims().model_dump(exclude_defaults=True)}" in text
    record = json.loads(json.dumps(x32.to_dict()))
    assert record["single_rank_fits"] is False and record["suggested"]["layout"]["cp"] == x32.suggested.layout.cp
    # a shorter phase the chosen layout holds says so, with its price
    small = plan_parallelism(preset("1b").model_copy(update={"max_seq_len": 8192}), 32000, 2048, H100,
                             global_batch_seqs=64)
    (fits,) = plan_phases(small, [("long", 8192)])
    assert fits.fits and fits.suggested is None
    assert "phase 'long': 64 sequences of 8,192 tokens (524,288 tokens per step): the chosen layout holds it" in \
        render_phase_plans(small, [fits])
