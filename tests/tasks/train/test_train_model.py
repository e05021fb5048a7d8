"""Model shape, parameter count, FLOPs formula, config validation and save/load round trip."""

from __future__ import annotations

import pydantic
import pytest
import torch

from tasks.train.config import ModelConfig, TrainRunConfig
from tasks.train.model import build_model, count_parameters, flops_per_token, load_model, save_model

V = 97


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(d_model=64, n_layers=2, n_heads=4),
        ModelConfig(d_model=96, n_layers=3, n_heads=3, tie_embeddings=False, qk_norm=True),
        ModelConfig(d_model=48, n_layers=1, n_heads=2, ffn_multiplier=4.0),
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
    # positions before the change cannot see it
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
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))


def test_model_copy_updates_are_revalidated() -> None:
    # sweeps vary widths with model_copy(update=...), which pydantic does not validate
    bad = ModelConfig(d_model=64, n_heads=4).model_copy(update={"n_heads": 5})
    with pytest.raises(pydantic.ValidationError, match="not divisible by model.n_heads=5"):
        build_model(bad, V)
