"""Mix: materialise the chosen mixture as the manifest the training data loader reads.

Per domain: weight, token budget (weight × the train run's tokens), available tokens, the
repetition (epoch) count that implies, and shard paths relative to the store root.
"""

from __future__ import annotations

from pydantic import Field

from kiln.tasks.configbase import Section
from kiln.tasks.errors import ConfigError

MIXTURE_FILE = "mixture.json"


class MixConfig(Section):
    max_epochs: float = Field(
        10.0, gt=0, description="refuse a plan that repeats any domain's tokens more often than this"
    )


def build_mixture_manifest(cfg: MixConfig, shards: dict, shards_rel_root: str, weights: dict[str, float],
                           train_tokens: int, seq_len: int) -> dict:
    total = sum(weights.values())
    domains = {}
    for name, split in sorted(shards["domains"].items()):
        weight = weights.get(name, 0.0) / total
        available = split["train"]["num_tokens"]
        budget = round(weight * train_tokens)
        epochs = budget / available if available else float("inf") if budget else 0.0
        if epochs > cfg.max_epochs:
            raise ConfigError(
                f"mixture repeats domain {name!r} {epochs:.1f} times (budget {budget} tokens, {available} available), "
                f"over mix.max_epochs={cfg.max_epochs}: lower train.run.steps or the domain's weight, add data, "
                f"or raise mix.max_epochs"
            )
        domains[name] = {
            "weight": weight,
            "token_budget": budget,
            "num_tokens": available,
            "epochs": round(epochs, 4),
            "train": [f"{shards_rel_root}/{shard['path']}" for shard in split["train"]["shards"]],
            "val": [f"{shards_rel_root}/{shard['path']}" for shard in split["val"]["shards"]],
        }
    return {"format": 1, "dtype": shards["dtype"], "vocab_size": shards["vocab_size"], "eos_id": shards["eos_id"],
            "seq_len": seq_len, "train_tokens": train_tokens, "domains": domains}
