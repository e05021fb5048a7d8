"""The parallelism planner: its memory model against memory measured on a real model, its
constraints, its step-time terms, and the verdicts it must reach on published configurations."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tasks.errors import ConfigError
from tasks.launch.cluster import ClusterSpec
from tasks.train.config import ModelConfig, ParallelDims, TrainRunConfig
from tasks.train.model import build_model, count_parameters, flops_per_token
from tasks.train.planner import (
    CandidateLayout,
    activation_bytes_per_layer,
    checked_layout,
    estimate_memory,
    estimate_step_time,
    forecast_record,
    forecast_training,
    gathered_param_bytes,
    head_activation_bytes,
    legal_layouts,
    load_preset,
    load_section_file,
    model_state_bytes,
    plan_parallelism,
    render_plan_report,
    resolve_parallel,
)

ROOT = Path(__file__).resolve().parents[3]
V = 97
H100 = ClusterSpec(gpus_per_node=8)  # the defaults describe an H100 SXM node


def preset(name: str) -> ModelConfig:
    return load_section_file(ROOT / "configs" / "models" / f"{name}.yaml", ModelConfig)


SMALL = [
    ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=64),
    ModelConfig(d_model=96, n_layers=3, n_heads=3, max_seq_len=64, tie_embeddings=False),
]


# ---- memory model vs. measured ------------------------------------------------------------------


@pytest.mark.parametrize("cfg", SMALL)
def test_model_states_match_a_real_adamw_step(cfg: ModelConfig) -> None:
    torch.manual_seed(0)
    model = build_model(cfg, V)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, V, (2, 16))
    F.cross_entropy(model(idx).view(-1, V), idx.view(-1)).backward()
    opt.step()
    params = list(model.parameters())  # tied weights appear once
    measured = sum(nbytes(p) + nbytes(p.grad) for p in params)
    measured += sum(nbytes(s["exp_avg"]) + nbytes(s["exp_avg_sq"]) for s in opt.state.values())
    # AdamW's per-tensor `step` counters (one fp32 scalar each) are the only bytes the model omits
    steps = sum(nbytes(s["step"]) for s in opt.state.values())
    assert steps == 4 * len(params)
    assert measured == model_state_bytes(cfg, V) == 16 * count_parameters(cfg, V)
    assert gathered_param_bytes(cfg, shard=1, precision="fp32") == 0  # fp32 on one rank: no copies


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _saved_activation_bytes(cfg: ModelConfig, batch: int, seq: int, full_checkpointing: bool) -> int:
    """Bytes autograd keeps for backward after one fp32 forward + loss, counted per storage.

    Storages are counted once (views share them) and weights and buffers are excluded: they are
    model state, not activations.
    """
    torch.manual_seed(0)
    model = build_model(cfg, V)
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    idx = torch.randint(0, V, (batch, seq))
    cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x = model.tok_emb(idx)
        for block in model.blocks:
            x = checkpoint(block, x, cos, sin, use_reentrant=True) if full_checkpointing else block(x, cos, sin)
        loss = F.cross_entropy(model.lm_head(model.norm(x)).view(-1, V), idx.view(-1))
    loss.backward()  # the saved graph is a real one
    return sum(saved.values())


LOSS_SCALAR = 4  # cross-entropy keeps its fp32 scalar result; too small for the model to count


@pytest.mark.parametrize("cfg", SMALL)
@pytest.mark.parametrize(("checkpointing", "full"), [("none", False), ("full", True)])
def test_activation_formula_matches_saved_tensors(cfg: ModelConfig, checkpointing: str, full: bool) -> None:
    batch, seq = 2, 32
    measured = _saved_activation_bytes(cfg, batch, seq, full_checkpointing=full)
    predicted = cfg.n_layers * activation_bytes_per_layer(cfg, batch, seq, checkpointing=checkpointing,
                                                          precision="fp32")
    predicted += head_activation_bytes(cfg, V, batch, seq, precision="fp32")
    assert measured == predicted + LOSS_SCALAR


def test_activation_exact_numbers_and_sharding() -> None:
    cfg = SMALL[0]  # d 64, f 192, 4 heads
    # none, fp32: 64 tokens x (4 x (11 x 64 + 4 x 192) + 4 x (2 + 4)) = 64 x 5912
    assert activation_bytes_per_layer(cfg, 2, 32, precision="fp32") == 64 * 5912
    assert activation_bytes_per_layer(cfg, 2, 32, checkpointing="full", precision="bf16-mixed") == 64 * 2 * 64
    # sequence-parallel TP splits every activation evenly; CP splits the tokens but keeps the other
    # chunk's gathered K and V: 32 tokens x 2 x 64 dims x 2 bytes (bf16)
    whole = activation_bytes_per_layer(cfg, 2, 32)
    assert activation_bytes_per_layer(cfg, 2, 32, tp=2) * 2 == whole
    assert activation_bytes_per_layer(cfg, 2, 32, cp=2) == whole // 2 + 32 * 2 * 64 * 2
    assert activation_bytes_per_layer(cfg, 2, 32, checkpointing="selective") < whole


def test_pipeline_first_stage_holds_pp_microbatches_in_flight() -> None:
    cfg = preset("7b")
    one = estimate_memory(cfg, 32000, 4096, CandidateLayout(1, 1, 1, 1, 1, "none"), 8, H100)
    four = estimate_memory(cfg, 32000, 4096, CandidateLayout(1, 1, 4, 1, 1, "none"), 8, H100)
    # 1F1B: stage 0 holds 4 micro-batches of its 8 layers = the whole model's activations
    assert four.activations == one.activations
    only_two = estimate_memory(cfg, 32000, 4096, CandidateLayout(1, 1, 4, 1, 1, "none"), 2, H100)
    assert only_two.activations * 2 == one.activations
    # weights: 8 of 32 layers plus one V x d matrix, instead of everything
    assert four.model_states < one.model_states / 3


# ---- constraints and time model -----------------------------------------------------------------


def test_legal_layouts_respect_the_constraints() -> None:
    cfg = ModelConfig(d_model=768, n_layers=12, n_heads=12, max_seq_len=2048)
    cluster = ClusterSpec(gpus_per_node=8, nodes=2)
    layouts = legal_layouts(cfg, 2048, 96, cluster)
    assert {lo.tp for lo in layouts} == {1, 2, 4}  # 8 does not divide 12 heads; 16 leaves the node
    assert {lo.pp for lo in layouts} == {1, 2, 4}  # 8 and 16 do not divide 12 layers
    for lo in layouts:
        assert lo.world_size == 16
        assert 96 % (lo.dp * lo.micro_batch) == 0
    assert {lo.checkpointing for lo in layouts} == {"none", "selective", "full"}


def test_step_time_terms() -> None:
    cfg = preset("7b")
    pure = estimate_step_time(cfg, 32000, 4096, 256, CandidateLayout(8, 1, 1, 1, 1, "none"), H100)
    assert pure.tp_comm == pure.pp_comm == pure.cp_comm == pure.bubble == 0.0
    # dp=2, micro-batch 2 -> 64 micro-batches; pp=4 bubble = (pp - 1) / m of the compute
    piped = estimate_step_time(cfg, 32000, 4096, 256, CandidateLayout(2, 1, 4, 1, 2, "none"), H100)
    assert piped.bubble == pytest.approx(piped.compute * 3 / 64)
    assert piped.compute == pytest.approx(pure.compute)  # same FLOPs, same devices
    full = estimate_step_time(cfg, 32000, 4096, 256, CandidateLayout(8, 1, 1, 1, 1, "full"), H100)
    assert full.recompute == pytest.approx(full.compute / 3, rel=0.01)  # one extra forward of three passes
    tp = estimate_step_time(cfg, 32000, 4096, 256, CandidateLayout(4, 2, 1, 1, 1, "none"), H100)
    assert tp.tp_comm > 0


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
    # ZeRO-3 over 8: 16 bytes x 6.74B / 8 = 12.6 GiB of states per GPU
    assert best.memory.model_states == 16 * -(-6_738_415_616 // 8)
    ranked_times = [p.time.total for p in search.ranked]
    assert min(ranked_times) >= best.time.total * 0.99  # nothing materially faster was passed over
    assert all(not p.fits and p.rejected for p in search.rejected)


def test_70b_does_not_fit_on_one_8x80gb_node() -> None:
    search = plan_parallelism(preset("70b"), 32000, 4096, H100, global_batch_seqs=1024)
    assert search.best is None
    pure = [p for p in search.rejected if p.layout.tp == p.layout.pp == p.layout.cp == 1]
    # 16 bytes x 70.3B / 8 = 131 GiB of weights, grads and Adam states per GPU before any activation
    assert pure and all(p.memory.model_states > 130 * 2**30 for p in pure)
    assert "model states alone take 131.0 GiB" in pure[0].rejected  # the lightest pure-FSDP plan
    with pytest.raises(ConfigError, match="add nodes"):
        search.require_best()
    assert "NO PLAN FITS" in render_plan_report(search)


def test_70b_fits_on_eight_nodes_but_not_with_plain_fsdp_and_no_recompute() -> None:
    cluster = H100.model_copy(update={"nodes": 8})
    search = plan_parallelism(preset("70b"), 32000, 4096, cluster, global_batch_seqs=1024)
    best = search.require_best()
    assert best.layout.world_size == 64
    plain = next(p for p in search.rejected if p.layout == CandidateLayout(64, 1, 1, 1, 1, "none"))
    assert "activations" in plain.rejected
    # pure FSDP only fits by recomputing every block, which costs a third more compute
    pure = [p for p in search.ranked if p.layout.tp == p.layout.pp == p.layout.cp == 1]
    assert pure and {p.layout.checkpointing for p in pure} == {"full"}
    assert best.layout.tp * best.layout.pp > 1 and best.time.total < pure[0].time.total


def test_13b_on_8x_a100_40gb_shards_activations_rather_than_recompute() -> None:
    cluster = load_section_file(ROOT / "configs" / "clusters" / "a100-40gb-1node.yaml", ClusterSpec)
    search = plan_parallelism(preset("13b"), 32000, 4096, cluster, global_batch_seqs=512)
    best = search.require_best()
    # 16 x 13.0B / 8 = 24.2 GiB of states leave too little of 40 GiB for a 4096-token sequence's
    # activations, so pure FSDP must recompute every block ...
    pure = [p for p in search.ranked if p.layout.tp == p.layout.pp == p.layout.cp == 1]
    assert pure and {p.layout.checkpointing for p in pure} == {"full"}
    # ... while splitting the sequence or the heads avoids recompute and wins
    assert best.layout.checkpointing == "none" and best.layout.tp * best.layout.cp > 1
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
    with pytest.raises(ConfigError, match="use one of 125m, 13b, 1b, 350m, 70b, 7b, tiny"):
        load_preset("3b", ModelConfig)


def test_auto_layout_is_the_planners_choice_with_its_micro_batch_and_recompute() -> None:
    model, cluster = load_preset("7b", ModelConfig), load_preset("h100-1node", ClusterSpec)
    run = TrainRunConfig(batch_size=512, seq_len=4096, device="cuda")
    dims, resolved = resolve_parallel("auto", model, run, 32000, cluster)
    best = plan_parallelism(model, 32000, 4096, cluster, global_batch_seqs=512).require_best()
    assert (dims.dp, dims.tp, dims.pp, dims.cp) == (best.layout.dp, best.layout.tp, best.layout.pp, best.layout.cp)
    assert resolved.grad_accum == best.num_microbatches == 512 // (dims.dp * best.layout.micro_batch)
    assert resolved.activation_checkpointing == (best.layout.checkpointing != "none")
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
    run = TrainRunConfig(steps=10, batch_size=256, seq_len=4096, grad_accum=4, activation_checkpointing=True)
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
