"""Mixture manifests, pure training batches and fixed validation windows over real memmapped shards."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.tasks.errors import ConfigError, InputError
from kiln.tasks.train.data_loader import Mixture, batch_for_step, mixture_with_weights, validation_batches

# each domain's tokens live in its own id range, so a token tells which domain it came from
RANGES = {"web": (0, 100), "code": (100, 200), "books": (200, 300)}


def write_shards(root: Path, weights: dict[str, float], train_tokens: int = 2000, val_tokens: int = 500) -> Path:
    domains = {}
    for i, (name, w) in enumerate(weights.items()):
        lo, hi = RANGES[name]
        rng = np.random.default_rng(i)
        rel = Path("tokenize/k/shards") / name
        (root / rel).mkdir(parents=True)
        # two train shards so windows cross a shard boundary
        half = train_tokens // 2
        for j, n in enumerate((half, train_tokens - half)):
            rng.integers(lo, hi, n).astype("<u2").tofile(root / rel / f"train_{j}.bin")
        (lo + np.arange(val_tokens) % (hi - lo)).astype("<u2").tofile(root / rel / "val.bin")
        domains[name] = {
            "weight": w,
            "token_budget": 1000,
            "num_tokens": train_tokens,
            "epochs": 0.5,
            "train": [str(rel / "train_0.bin"), str(rel / "train_1.bin")],
            "val": [str(rel / "val.bin")],
        }
    manifest = {"format": 1, "dtype": "uint16", "vocab_size": 300, "eos_id": 0, "seq_len": 16, "domains": domains}
    path = root / "manifest.json"
    path.write_text(json.dumps(manifest))
    return path


def domain_of(row: torch.Tensor) -> str:
    (name,) = {n for n, (lo, hi) in RANGES.items() if lo <= int(row[0]) < hi}
    assert all(RANGES[name][0] <= int(t) < RANGES[name][1] for t in row)
    return name


def test_from_manifest(tmp_path) -> None:
    mix = Mixture.from_manifest(write_shards(tmp_path, {"web": 0.75, "code": 0.25}), tmp_path)
    assert (mix.dtype, mix.vocab_size, mix.eos_id) == ("uint16", 300, 0)
    assert list(mix.domains) == ["web", "code"]
    web = mix.domains["web"]
    assert web.weight == 0.75
    assert web.train == (tmp_path / "tokenize/k/shards/web/train_0.bin", tmp_path / "tokenize/k/shards/web/train_1.bin")
    assert web.val == (tmp_path / "tokenize/k/shards/web/val.bin",)


def test_manifest_errors_are_clear(tmp_path) -> None:
    path = write_shards(tmp_path, {"web": 0.5, "code": 0.4})
    with pytest.raises(InputError, match=r"domain weights sum to 0\.9, not 1 \(web=0\.5, code=0\.4\)"):
        Mixture.from_manifest(path, tmp_path)
    raw = json.loads(path.read_text())
    raw["domains"]["code"]["weight"] = 0.5
    raw["domains"]["code"]["val"] = ["tokenize/k/shards/code/nope.bin"]
    path.write_text(json.dumps(raw))
    with pytest.raises(InputError, match=r"domains\.code\.val shard .*nope\.bin does not exist"):
        Mixture.from_manifest(path, tmp_path)
    del raw["vocab_size"]
    raw["domains"]["code"]["val"] = []
    path.write_text(json.dumps(raw))
    with pytest.raises(InputError, match="missing key 'vocab_size'"):
        Mixture.from_manifest(path, tmp_path)
    with pytest.raises(InputError, match="manifest not found"):
        Mixture.from_manifest(tmp_path / "other.json", tmp_path)


def test_batch_for_step_is_pure_and_shifted(tmp_path) -> None:
    mix = Mixture.from_manifest(write_shards(tmp_path, {"web": 0.5, "code": 0.5}), tmp_path)
    x, y = batch_for_step(mix, seed=3, step=7, rank=0, world_size=1, batch_size=4, seq_len=16)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, y2 = batch_for_step(mix, seed=3, step=7, rank=0, world_size=1, batch_size=4, seq_len=16)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = batch_for_step(mix, seed=3, step=8, rank=0, world_size=1, batch_size=4, seq_len=16)
    x4, _ = batch_for_step(mix, seed=4, step=7, rank=0, world_size=1, batch_size=4, seq_len=16)
    assert not torch.equal(x, x3) and not torch.equal(x, x4)
    # the global batch does not depend on how it is split over ranks
    full, _ = batch_for_step(mix, seed=3, step=7, rank=0, world_size=1, batch_size=8, seq_len=16)
    r0, _ = batch_for_step(mix, seed=3, step=7, rank=0, world_size=2, batch_size=4, seq_len=16)
    r1, _ = batch_for_step(mix, seed=3, step=7, rank=1, world_size=2, batch_size=4, seq_len=16)
    assert torch.equal(full, torch.cat([r0, r1]))
    with pytest.raises(ValueError, match="rank 2 is outside world_size 2"):
        batch_for_step(mix, seed=3, step=7, rank=2, world_size=2, batch_size=4, seq_len=16)


def test_windows_match_the_concatenated_shards(tmp_path) -> None:
    mix = Mixture.from_manifest(write_shards(tmp_path, {"web": 1.0}, train_tokens=40), tmp_path)
    stream = np.concatenate([np.fromfile(p, dtype="<u2") for p in mix.domains["web"].train]).astype(np.int64)
    seen_starts = set()
    for step in range(200):
        x, y = batch_for_step(mix, seed=0, step=step, rank=0, world_size=1, batch_size=2, seq_len=16)
        for row_x, row_y in zip(x.numpy(), y.numpy()):
            window = np.concatenate([row_x, row_y[-1:]])
            starts = [s for s in range(len(stream) - 16) if np.array_equal(stream[s : s + 17], window)]
            assert starts, "every row is a contiguous window of the domain's train stream"
            seen_starts.update(starts)
    # 40 tokens give 24 possible windows; 400 draws hit all of them, including ones across the
    # shard boundary at token 20
    assert seen_starts == set(range(24))


def test_weights_respected_and_zero_weight_never_sampled(tmp_path) -> None:
    mix = Mixture.from_manifest(write_shards(tmp_path, {"web": 0.75, "code": 0.25, "books": 0.0}), tmp_path)
    counts = {"web": 0, "code": 0, "books": 0}
    for step in range(100):
        x, _ = batch_for_step(mix, seed=0, step=step, rank=0, world_size=1, batch_size=20, seq_len=8)
        for row in x:
            counts[domain_of(row)] += 1
    assert counts["books"] == 0
    assert counts["web"] + counts["code"] == 2000
    # binomial(2000, 0.75): sd ~ 19.4, so +/- 80 is a > 4 sigma band
    assert abs(counts["web"] - 1500) < 80


def test_too_short_weighted_domain_is_an_error(tmp_path) -> None:
    mix = Mixture.from_manifest(write_shards(tmp_path, {"web": 1.0}, train_tokens=10), tmp_path)
    with pytest.raises(InputError, match="'web' has 10 train tokens, fewer than one window of seq_len \\+ 1 = 17"):
        batch_for_step(mix, seed=0, step=0, rank=0, world_size=1, batch_size=2, seq_len=16)


def test_validation_batches_fixed_windows_all_domains(tmp_path) -> None:
    mix = Mixture.from_manifest(write_shards(tmp_path, {"web": 1.0, "code": 0.0}, val_tokens=67), tmp_path)
    batches = validation_batches(mix, seq_len=16, eval_batches=3, batch_size=2)
    assert list(batches) == ["web", "code"]  # zero-weight domains are still validated
    for name in ("web", "code"):
        pairs = batches[name]
        assert len(pairs) == 3 and all(x.shape == (2, 16) for x, _ in pairs)
        starts = [int(x[i, 0]) - RANGES[name][0] for x, _ in pairs for i in range(2)]
        # 6 windows evenly spaced over starts 0..50 (67 tokens, windows of 17)
        assert starts == [0, 10, 20, 30, 40, 50]
        assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in pairs)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches["web"], validation_batches(mix, 16, 3, 2)["web"]))


def test_validation_skips_short_domain_with_warning(tmp_path) -> None:
    mix = Mixture.from_manifest(write_shards(tmp_path, {"web": 1.0}, val_tokens=10), tmp_path)
    with pytest.warns(UserWarning, match="'web': validation has 10 tokens"):
        assert validation_batches(mix, seq_len=16, eval_batches=2, batch_size=2) == {}


SHARDS = {"dtype": "uint16", "vocab_size": 300, "eos_id": 0, "domains": {
    name: {"train": {"shards": [{"path": f"{name}/train.bin"}]}, "val": {"shards": [{"path": f"{name}/val.bin"}]}}
    for name in RANGES}}


def test_mixture_with_weights_normalises_and_zeroes_the_domains_left_out(tmp_path) -> None:
    mixture = mixture_with_weights(SHARDS, tmp_path, {"web": 3, "code": 1}, "anneal.mixture")
    assert {n: d.weight for n, d in mixture.domains.items()} == {"web": 0.75, "code": 0.25, "books": 0.0}
    assert mixture.domains["code"].train == (tmp_path / "code" / "train.bin",) and mixture.vocab_size == 300


@pytest.mark.parametrize("weights, error", [({"wiki": 1}, r"anneal\.mixture: domains \['wiki'\] are not in the corpus"),
                                            ({"web": 0}, "must sum to more than 0")])
def test_mixture_with_weights_refuses_unknown_domains_and_zero_weights(tmp_path, weights, error) -> None:
    with pytest.raises(ConfigError, match=error):
        mixture_with_weights(SHARDS, tmp_path, weights, "anneal.mixture")
