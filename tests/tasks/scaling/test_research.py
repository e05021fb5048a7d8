"""A research study at tiny sizes on CPU, on a first-order Markov corpus (each token has 2 possible
successors, so a model can learn it in a few hundred steps): a null variant comes out inconclusive, a
crippling weight decay is rejected, a warmup the baseline lacks time for is promoted; a study killed
mid-way (SIGKILLed with its worker) trains only its unfinished runs when run again;
an LR sweep tunes each variant and scale at seed 0; the costs are priced and measured; each domain's
bits per byte uses its own bytes per token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.tasks.errors import ConfigError
from kiln.tasks.ledger import StageRecorder, SubRuns
from kiln.tasks.scaling.research import (
    BASELINE,
    RUNS_KIND,
    ResearchConfig,
    ResearchScale,
    bytes_per_token_by_domain,
    chosen_runs,
    decide_study,
    kv_cache_bytes_per_token,
    resolve_study,
    run_study,
    variant_costs,
)
from kiln.tasks.scaling.sweep import IsoFlopBudget, MixtureDesign, SweepConfig
from kiln.tasks.scaling.trial_runs import PoolTrials
from kiln.tasks.store import MANIFEST_FILE
from kiln.tasks.tracker import NullTracker
from kiln.tasks.train.config import ModelConfig, OptimConfig, TrainRunConfig
from tests.fixtures.continuous_eval import EOS, write_tokenizer
from tests.processes import kill_tree

VOCAB = 32
SCALES = [ResearchScale(width=8, flops=2e8), ResearchScale(width=12, flops=4e8), ResearchScale(width=16, flops=8e8)]
# the baseline warms its LR up over more steps than any scale trains (SLOW_WARMUP), so it ends short of what
# the chain allows: a variant without the warmup ("warm") is a planted improvement at every scale
SLOW_WARMUP = 400
# production twice the largest scale: three seeds at three scales bound a trend that far (12x beyond, a
# consistent -0.23 at every scale still extrapolated to an interval Holm's correction could not pass)
PRODUCTION_FLOPS = 1.6e9
VARIANTS = {"null": {}, "handicap": {"optim.weight_decay": 20.0}, "warm": {"optim.warmup_steps": 0},
            "deeper": {"model.n_layers": 4}}


def markov_shards(root: Path) -> dict:
    """Two domains, each a first-order chain over VOCAB tokens with 2 successors per token."""
    shards: dict = {"dtype": "uint16", "vocab_size": VOCAB, "eos_id": 0, "domains": {}}
    for i, domain in enumerate(("web", "code")):
        successors = np.random.default_rng(100 + i).integers(1, VOCAB, size=(VOCAB, 2))

        def chain(length: int, seed: int) -> np.ndarray:
            pick = np.random.default_rng(seed).integers(0, 2, length)
            out = [1]
            for k in range(length - 1):
                out.append(int(successors[out[-1], pick[k]]))
            return np.array(out, dtype="<u2")

        (root / domain).mkdir(parents=True)
        chain(60_000, i).tofile(root / domain / "train.bin")
        chain(2_000, 50 + i).tofile(root / domain / "val.bin")
        shards["domains"][domain] = {"train": {"shards": [{"path": f"{domain}/train.bin"}], "num_tokens": 60_000},
                                     "val": {"shards": [{"path": f"{domain}/val.bin"}]}}
    return shards


def sweep() -> SweepConfig:
    return SweepConfig(model=ModelConfig(d_model=8, n_layers=1, n_heads=2, max_seq_len=16), lr=0.05,
                       isoflop=[IsoFlopBudget(flops=2e8, widths=[8])], mixtures={"u": {"web": 1, "code": 1}},
                       mixture_design=MixtureDesign(num_samples=0),
                       run=TrainRunConfig(batch_size=8, seq_len=16, eval_batches=2, checkpoint_every=1000),
                       optim=OptimConfig(warmup_steps=SLOW_WARMUP))


def study(variants: dict = VARIANTS):
    return resolve_study(ResearchConfig(variants=variants, scales=SCALES, seeds=3), sweep(), None, PRODUCTION_FLOPS)


def subruns(store: Path) -> SubRuns:
    return SubRuns(StageRecorder(NullTracker(), "run", "research", "k"), store)


def committed(store: Path) -> int:
    return len(list((store / RUNS_KIND).glob(f"*/{MANIFEST_FILE}")))


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("tokenize")
    return markov_shards(root), root


@pytest.mark.slow
def test_null_handicap_and_improvement_get_their_decisions(shards, tmp_path):
    data, root = shards
    s = study()
    runs = run_study(s, data, root, subruns(tmp_path), "tok", where=PoolTrials(2))
    # 5 variants x 3 scales x 3 seeds declared; the null variant's runs are the baseline's (same content, one key)
    assert len(runs) == 45 and committed(tmp_path) == 36
    chosen = chosen_runs(runs)
    decision = decide_study(s, chosen, bytes_per_token=1.0)
    v = decision["variants"]
    assert v["null"]["decision"] == "inconclusive"
    assert all(e["mean"] == 0.0 for e in v["null"]["effect_by_scale"].values())
    assert v["handicap"]["decision"] == "reject", v["handicap"]
    assert v["warm"]["decision"] == "promote", v["warm"]
    assert not v["warm"]["crossover"]
    assert set(v["deeper"]["effect_by_scale"]) == {"w8-2e+08", "w12-4e+08", "w16-8e+08"}
    assert set(v["deeper"]["bpb_effect_by_scale"]) == {"code", "web"}
    assert decision["noise_floor"] > 0
    costs = variant_costs(s, "deeper", VOCAB, chosen)
    base = variant_costs(s, BASELINE, VOCAB, chosen)
    assert costs["parameters"] > base["parameters"]
    assert costs["kv_cache_bytes_per_token"] == 4 * base["kv_cache_bytes_per_token"]
    assert costs["train_tokens_per_s_ratio"] < 1  # four blocks instead of one
    assert costs["decode_tokens_per_s"] > 0
    json.dumps(decision)


class Counting:
    """A launcher that counts the runs it is given (a rerun's `pending` is what it still had to train)."""

    def __init__(self, inner: PoolTrials) -> None:
        self.inner, self.pending = inner, 0

    def run(self, cfg, shards, shards_root, pending, label) -> Iterator:
        self.pending += len(pending)
        yield from self.inner.run(cfg, shards, shards_root, pending, label)


def test_variants_are_checked_when_the_config_loads_and_when_the_study_resolves():
    with pytest.raises(ValueError, match=r"research.variants.bad.model.d_model: set by the study"):
        ResearchConfig(variants={"bad": {"model.d_model": 64}})
    with pytest.raises(ValueError, match=r"research.variants.bad.model.nrom: a variant overrides model"):
        ResearchConfig(variants={"bad": {"model.nrom": "layernorm"}})
    with pytest.raises(ValueError, match="at least 3 distinct"):
        ResearchConfig(scales=SCALES[:2])
    with pytest.raises(ConfigError, match=r"research.variants.odd: its overrides make an invalid config"):
        study({"odd": {"model.global_every": 2}})  # global_every without a sliding window
    with pytest.raises(ConfigError, match="not above the largest scale"):
        resolve_study(ResearchConfig(variants=VARIANTS, scales=SCALES), sweep(), None, 1e8)


def test_kv_cache_bytes_count_only_what_a_window_keeps():
    full = ModelConfig(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256)
    assert kv_cache_bytes_per_token(full) == 2 * 32 * 4 * 2  # K and V, kv_dim 32, 4 layers, bf16
    local = full.model_copy(update={"sliding_window": 64, "global_every": 2})
    assert kv_cache_bytes_per_token(local) == pytest.approx(2 * 32 * 2 * (2 * 256 + 2 * 64) / 256)  # 2 global, 2 local layers


# small budgets (16 to 66 steps): the LR sweep's choice is what is tested, not the decision
SMALL_SCALES = [ResearchScale(width=8, flops=2e7), ResearchScale(width=8, flops=4e7), ResearchScale(width=12, flops=8e7)]


@pytest.mark.slow  # 18 tiny runs in 4 process pools: ~75 s on 2 busy cores
def test_an_lr_sweep_tunes_each_variant_and_scale_at_seed_0_and_trains_the_other_seeds_at_the_best(shards, tmp_path):
    data, root = shards
    cfg = ResearchConfig(variants={"warm": {"optim.warmup_steps": 0}}, scales=SMALL_SCALES, seeds=2, lr_sweep=[8.0])
    s = resolve_study(cfg, sweep(), None, PRODUCTION_FLOPS)
    runs = run_study(s, data, root, subruns(tmp_path), "tok", where=PoolTrials(2))
    # per variant: seed 0 at multipliers 1 and 8 at 3 scales, seed 1 at the chosen one: 2 x (6 + 3)
    assert len(runs) == 18 and committed(tmp_path) == 18
    for name in (BASELINE, "warm"):
        for scale in (s.scale_name(x) for x in SMALL_SCALES):
            tried = {r.multiplier: res.val_loss for r, res in runs if (r.variant, r.scale, r.seed) == (name, scale, 0)}
            assert set(tried) == {1.0, 8.0}
            [(later, result)] = [(r, res) for r, res in runs if (r.variant, r.scale, r.seed) == (name, scale, 1)]
            assert later.multiplier == min(tried, key=tried.get)
            assert result.lr == pytest.approx(s.sweep.lr_at(later.trial.width) * later.multiplier)
    # the baseline's 400-step warmup keeps its LR far below lr in these 16-66 steps: 8x is better everywhere
    assert {r.multiplier for r, _ in runs if r.variant == BASELINE and r.seed == 1} == {8.0}
    chosen = chosen_runs(runs)
    assert len(chosen) == 12  # (2 variants x 3 scales x 2 seeds): seed 0 at the chosen multiplier only
    for (name, scale, seed), result in chosen.items():
        assert result.lr == next(res.lr for r, res in runs if (r.variant, r.scale, r.seed) == (name, scale, 1))
    decision = decide_study(s, chosen, bytes_per_token=1.0)
    assert decision["lr_sweep"] == [8.0]
    # rerun: the sweep's runs are found committed, none trains again
    again = Counting(PoolTrials(2))
    run_study(s, data, root, subruns(tmp_path), "tok", where=again)
    assert again.pending == 0


def test_bits_per_byte_divide_each_domain_by_its_own_bytes_per_token(tmp_path):
    tokenizer = write_tokenizer(tmp_path / "tokenizer.json")
    eos = tokenizer.token_to_id(EOS)
    texts = {"prose": ["the cat sat on the mat", "a dog ran"], "german": ["Grüße aus München, schöne Straße"],
             "code": ["def f(x):\n    return x * 2\n"]}
    shards: dict = {"dtype": "uint16", "domains": {}}
    expected = {}
    for domain, docs in texts.items():
        ids = [t for doc in docs for t in [*tokenizer.encode(doc).ids, eos]]
        np.array(ids, dtype="<u2").tofile(tmp_path / f"{domain}.bin")
        shards["domains"][domain] = {"val": {"shards": [{"path": f"{domain}.bin"}]}}
        expected[domain] = sum(len(doc.encode("utf-8")) for doc in docs) / len(ids)  # EOS: a token of no bytes
    ratios = bytes_per_token_by_domain(shards, tmp_path, tmp_path / "tokenizer.json")
    assert ratios == pytest.approx(expected, rel=1e-12)
    assert len(set(ratios.values())) == 3  # one corpus-wide ratio would misstate two of them


KILLED_STUDY = """
import json, sys
from pathlib import Path
from kiln.tasks.scaling.research import ResearchConfig, resolve_study, run_study
from kiln.tasks.scaling.trial_runs import PoolTrials
from tests.tasks.scaling.test_research import PRODUCTION_FLOPS, SMALL_SCALES, subruns, sweep

if __name__ == "__main__":
    root, store = Path(sys.argv[1]), Path(sys.argv[2])
    study = resolve_study(ResearchConfig(variants={"warm": {"optim.warmup_steps": 0}}, scales=SMALL_SCALES, seeds=2),
                          sweep(), None, PRODUCTION_FLOPS)
    run_study(study, json.loads((root / "shards.json").read_text()), root, subruns(store), "tok", where=PoolTrials(1))
"""


@pytest.mark.slow
def test_a_study_killed_with_sigkill_reruns_only_its_unfinished_runs(tmp_path):
    """The study's process and its trial worker SIGKILLed (a lost machine), not interrupted: their
    locks and partial folders are left behind, and the rerun still trains only what was not committed."""
    root, store = tmp_path / "tokenize", tmp_path / "store"
    (root / "shards.json").write_text(json.dumps(markov_shards(root)))
    script = tmp_path / "study.py"
    script.write_text(KILLED_STUDY)
    repo = Path(__file__).resolve().parents[3]
    study_process = subprocess.Popen([sys.executable, str(script), str(root), str(store)], cwd=repo,
                                     env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        deadline = time.monotonic() + 240
        while committed(store) < 3 and study_process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert study_process.poll() is None, "the study ended before it was killed"
    finally:
        kill_tree(study_process.pid)
        study_process.wait()
    done = committed(store)
    assert 3 <= done < 12  # 2 variants x 3 scales x 2 seeds
    s = resolve_study(ResearchConfig(variants={"warm": {"optim.warmup_steps": 0}}, scales=SMALL_SCALES, seeds=2),
                      sweep(), None, PRODUCTION_FLOPS)
    again = Counting(PoolTrials(2))
    runs = run_study(s, json.loads((root / "shards.json").read_text()), root, subruns(store), "tok", where=again)
    assert again.pending == 12 - done and committed(store) == 12 and len(runs) == 12
    assert all(res.ok for _, res in runs)
