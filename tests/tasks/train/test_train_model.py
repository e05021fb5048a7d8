"""Model shape, parameter count, FLOPs formula, config validation and save/load round trip."""

from __future__ import annotations

import pydantic
import pytest
import torch

from kiln.tasks.train.config import ModelConfig, TrainRunConfig
from kiln.tasks.train.model import build_model, count_parameters, flops_per_token, load_model, save_model

V = 97


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(d_model=64, n_layers=2, n_heads=4),
        ModelConfig(d_model=96, n_layers=3, n_heads=3, tie_embeddings=False, qk_norm=True),
        ModelConfig(d_model=48, n_layers=1, n_heads=2, ffn_multiplier=4.0),
        ModelConfig(d_model=96, n_layers=2, n_heads=6, n_kv_heads=2, tie_embeddings=False),
    ],
)
def test_count_parameters_matches_module(cfg: ModelConfig) -> None:
    model = build_model(cfg, V)
    assert count_parameters(cfg, V) == sum(p.numel() for p in model.parameters())


def test_count_parameters_exact_numbers() -> None:
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4)
    # ffn hidden: 8/3 * 64 = 170.67 -> 192; per layer 4*64^2 + 3*64*192 + 2*64 = 53376
    assert cfg.ffn_hidden == 192
    assert count_parameters(cfg, V) == V * 64 + 2 * 53376 + 64
    # untying adds a second V x d matrix
    untied = cfg.model_copy(update={"tie_embeddings": False})
    assert count_parameters(untied, V) - count_parameters(cfg, V) == V * 64


def test_ffn_hidden_rounding_ignores_float_noise() -> None:
    assert ModelConfig(d_model=96, n_heads=4).ffn_hidden == 256  # 8/3 * 96 is 255.999... in floats
    assert ModelConfig(d_model=128, n_heads=4).ffn_hidden == 352


def test_flops_per_token() -> None:
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4)
    n = count_parameters(cfg, V)
    assert flops_per_token(cfg, V, 32) == 6 * n + 12 * 2 * 64 * 32
    untied = cfg.model_copy(update={"tie_embeddings": False})
    # the untied input embedding is a lookup, so it adds no FLOPs
    assert flops_per_token(untied, V, 32) == flops_per_token(cfg, V, 32)


def test_forward_shape_and_causality() -> None:
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
    torch.manual_seed(0)
    model = build_model(cfg, V).eval()
    idx = torch.randint(0, V, (2, 10))
    logits = model(idx)
    assert logits.shape == (2, 10, V)
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % V
    # positions before the change cannot see it, not even in a last bit: the same shapes take the same kernels,
    # and a later position's scores are masked to exact zeros (exact on any CPU)
    torch.testing.assert_close(model(changed)[:, :7], logits[:, :7], rtol=0, atol=0)
    assert not torch.equal(model(changed)[:, 7:], logits[:, 7:])
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_residual_projections_use_scaled_init() -> None:
    cfg = ModelConfig(d_model=256, n_layers=8, n_heads=4)
    torch.manual_seed(0)
    model = build_model(cfg, V)
    assert model.blocks[0].attn.wq.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.02)
    assert model.blocks[0].mlp.down.weight.std().item() == pytest.approx(0.02 / 4, rel=0.02)
    assert model.lm_head.weight is model.tok_emb.weight


def test_config_validation_messages() -> None:
    with pytest.raises(pydantic.ValidationError, match="not divisible by model.n_heads=3"):
        ModelConfig(d_model=64, n_heads=3)
    with pytest.raises(pydantic.ValidationError, match="head size"):
        ModelConfig(d_model=36, n_heads=4)
    with pytest.raises(pydantic.ValidationError, match="extra"):
        ModelConfig(vocab_size=10)
    with pytest.raises(ValueError, match="seq_len=512 exceeds model.max_seq_len=256"):
        TrainRunConfig(seq_len=512).check_fits(ModelConfig())


def test_grouped_query_attention_is_multi_head_attention_with_shared_kv_heads() -> None:
    """A model with 8 query heads and 2 K/V heads computes what the 8-head model computes when
    each of its K/V heads is the GQA model's head of that query head's group (4 query heads each)."""
    gqa_cfg = ModelConfig(d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, max_seq_len=32)
    mha_cfg = gqa_cfg.model_copy(update={"n_kv_heads": None})
    gqa = build_model(gqa_cfg, V, seed=0).eval()
    state = dict(gqa.state_dict())
    for name, weight in gqa.state_dict().items():
        if name.endswith(("attn.wk.weight", "attn.wv.weight")):  # [2 heads x 8 dims, d] -> [8 heads x 8 dims, d]
            state[name] = weight.unflatten(0, (2, 8)).repeat_interleave(4, dim=0).flatten(0, 1)
    mha = build_model(mha_cfg, V, seed=1).eval()
    mha.load_state_dict(state)
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(gqa(idx), mha(idx), rtol=0, atol=1e-6)
    assert count_parameters(mha_cfg, V) - count_parameters(gqa_cfg, V) == 2 * 2 * 64 * (64 - 16)
    with pytest.raises(pydantic.ValidationError, match="model.n_kv_heads=3 does not divide model.n_heads=8"):
        ModelConfig(d_model=64, n_heads=8, n_kv_heads=3)


def test_n_kv_heads_equal_to_n_heads_is_the_model_without_it() -> None:
    """Keys (and checkpoints' identity) of models written before grouped-query attention existed stay valid."""
    plain = ModelConfig(d_model=64, n_heads=4)
    assert "n_kv_heads" not in plain.identity()
    assert plain.model_copy(update={"n_kv_heads": 4}).identity() == plain.identity()
    assert ModelConfig(d_model=64, n_heads=4, n_kv_heads=2).identity()["n_kv_heads"] == 2


def test_initialisation_is_a_function_of_seed_and_parameter_name() -> None:
    """What lets every rank fill just its shard: the same seed gives the same weights, whatever
    else is built, and each parameter has its own stream."""
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, tie_embeddings=False)
    a, b = build_model(cfg, V, seed=3), build_model(cfg.model_copy(update={"n_layers": 3}), V, seed=3)
    # bit for bit by design: one generator per (seed, name) drawing the same shape
    assert torch.equal(a.blocks[1].attn.wq.weight, b.blocks[1].attn.wq.weight)  # a deeper model, same blocks
    assert not torch.equal(a.blocks[0].attn.wq.weight, a.blocks[1].attn.wq.weight)
    assert not torch.equal(a.blocks[0].attn.wq.weight, build_model(cfg, V, seed=4).blocks[0].attn.wq.weight)


def test_runtime_fields_are_not_identity() -> None:
    ident = TrainRunConfig(device="cuda", num_threads=4, log_every=1).identity()
    assert ident == TrainRunConfig().identity()
    assert "device" not in ident and "steps" in ident


def test_save_load_round_trip(tmp_path) -> None:
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, qk_norm=True, tie_embeddings=False)
    torch.manual_seed(1)
    model = build_model(cfg, V).eval()
    save_model(model, cfg, V, tmp_path / "m")
    loaded, loaded_cfg = load_model(tmp_path / "m")
    assert loaded_cfg == cfg and loaded.cfg == cfg and loaded.vocab_size == V
    assert not loaded.training
    idx = torch.randint(0, V, (2, 12))
    with torch.no_grad():  # the saved bytes, the same input and kernels in one process: bit-identical
        assert torch.equal(loaded(idx), model(idx))


def test_model_copy_updates_are_revalidated() -> None:
    # sweeps vary widths with model_copy(update=...), which pydantic does not validate
    bad = ModelConfig(d_model=64, n_heads=4).model_copy(update={"n_heads": 5})
    with pytest.raises(pydantic.ValidationError, match="not divisible by model.n_heads=5"):
        build_model(bad, V)
