"""Subprocess entry for the kill-and-resume test: train a tiny model from a JSON spec."""

import json
import sys
from pathlib import Path

from kiln.tasks.train.config import ModelConfig, OptimConfig, TrainRunConfig
from kiln.tasks.train.data_loader import Mixture
from kiln.tasks.train.loop import train_model

spec = json.loads(Path(sys.argv[1]).read_text())
train_model(ModelConfig(**spec["model"]), OptimConfig(**spec["optim"]), TrainRunConfig(**spec["run"]),
            Mixture.from_manifest(Path(spec["manifest"]), Path(spec["root"])), Path(spec["out_dir"]))
