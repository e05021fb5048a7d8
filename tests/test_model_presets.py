"""Model size presets in configs/models/: each is a valid ModelConfig whose size matches its name,
with the vocabulary it was published with (the preset's `vocab_size`, `kiln plan`'s default)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.tasks.train.config import ModelConfig
from kiln.tasks.train.model import count_parameters
from kiln.tasks.train.planner import load_preset, preset_vocab_size

MODELS = Path(__file__).resolve().parent.parent / "configs" / "models"
NOMINAL = {"125m": 125e6, "350m": 350e6, "1b": 1e9, "7b": 7e9, "13b": 13e9, "8b": 8e9, "70b": 70e9, "405b": 405e9}


def load(name: str) -> ModelConfig:
    return load_preset(name, ModelConfig)


def test_every_preset_file_is_covered() -> None:
    assert sorted(p.stem for p in MODELS.glob("*.yaml")) == sorted([*NOMINAL, "tiny"])


@pytest.mark.parametrize("name", sorted(NOMINAL))
def test_preset_size_matches_its_name(name: str) -> None:
    n = count_parameters(load(name), preset_vocab_size(name))
    assert abs(n / NOMINAL[name] - 1) <= 0.10, f"{name}: {n / 1e9:.3f}B parameters"


def test_llama2_presets_have_the_published_sizes() -> None:
    # Llama-2 7B and 13B (untied embeddings, vocab 32000): 6,738,415,616 and 13,015,864,320
    assert preset_vocab_size("7b") == preset_vocab_size("13b") == 32000
    assert count_parameters(load("7b"), 32000) == 6_738_415_616
    assert count_parameters(load("13b"), 32000) == 13_015_864_320
    assert load("7b").ffn_hidden == 11008 and load("13b").ffn_hidden == 13824


@pytest.mark.parametrize(("name", "shape", "ffn", "published"), [
    ("8b", (4096, 32, 32, 8), 14336, 8_030_261_248),
    ("70b", (8192, 80, 64, 8), 28672, 70_553_706_496),
    ("405b", (16384, 126, 128, 8), 53248, 405_853_388_800),
])
def test_llama3_presets_have_the_published_shapes(name: str, shape: tuple, ffn: int, published: int) -> None:
    """Llama 3 (8B, 70B) and 3.1 (405B): 8 K/V heads, their FFN widths, the 128,256-token
    tokenizer, RoPE theta 500,000, and their published parameter counts to the unit."""
    cfg = load(name)
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == shape
    assert cfg.ffn_hidden == ffn and cfg.rope_theta == 500_000 and not cfg.tie_embeddings
    assert preset_vocab_size(name) == 128_256
    assert count_parameters(cfg, 128_256) == published


def test_tiny_preset_is_tiny() -> None:
    assert count_parameters(load("tiny"), 32000) == 4_899_968
