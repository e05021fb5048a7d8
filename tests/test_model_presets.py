"""Model size presets in configs/models/: each is a valid ModelConfig whose size matches its name."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tasks.train.config import ModelConfig
from tasks.train.model import count_parameters

MODELS = Path(__file__).resolve().parent.parent / "configs" / "models"
VOCAB = 32000  # the Llama tokenizer's size, which the published parameter counts assume
NOMINAL = {"125m": 125e6, "350m": 350e6, "1b": 1e9, "7b": 7e9, "13b": 13e9, "70b": 70e9}


def load(name: str) -> ModelConfig:
    return ModelConfig.model_validate(yaml.safe_load((MODELS / f"{name}.yaml").read_text()))


def test_every_preset_file_is_covered() -> None:
    assert sorted(p.stem for p in MODELS.glob("*.yaml")) == sorted([*NOMINAL, "tiny"])


@pytest.mark.parametrize("name", sorted(NOMINAL))
def test_preset_size_matches_its_name(name: str) -> None:
    n = count_parameters(load(name), VOCAB)
    assert abs(n / NOMINAL[name] - 1) <= 0.10, f"{name}: {n / 1e9:.3f}B parameters"


def test_llama2_presets_have_the_published_sizes() -> None:
    # Llama-2 7B and 13B (untied embeddings, vocab 32000): 6,738,415,616 and 13,015,864,320
    assert count_parameters(load("7b"), VOCAB) == 6_738_415_616
    assert count_parameters(load("13b"), VOCAB) == 13_015_864_320
    assert load("7b").ffn_hidden == 11008 and load("13b").ffn_hidden == 13824


def test_tiny_preset_is_tiny() -> None:
    assert count_parameters(load("tiny"), VOCAB) == 4_899_968
