"""The train stage's data schedule: phase bounds, a quality curriculum, phase boundaries in training,
determinism, a resume inside a phase bit-identical to the uninterrupted run, and the token accounting."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kiln.tasks.constants import DOC_INDEX_SUFFIX
from kiln.tasks.errors import ConfigError
from kiln.tasks.stages.train import TrainConfig
from kiln.tasks.train.config import DataPhase, TrainRunConfig
from kiln.tasks.train.data_loader import Mixture, draw_batch, write_manifest
from kiln.tasks.train.data_schedule import phase_bounds, quality_ordered, scheduled_mixture
from kiln.tasks.train.loop import train_model
from kiln.tasks.train.trainer import TrainCallback
from tests.tasks.train.test_train_loop import MODEL, OPTIM, write_mixture

RUN = TrainRunConfig(steps=20, batch_size=4, seq_len=16, eval_batches=2, checkpoint_every=4, keep_checkpoints=10,
                     log_every=5, num_threads=1)
# web's tokens are 1..7, code's 20..30 (test_train_loop.write_mixture); phase b trains 8-token windows
PHASES = [DataPhase(name="a", until_step=10, mixture={"web": 1.0}),
          DataPhase(name="b", mixture={"web": 0.25, "code": 0.75}, seq_len=8)]


def test_phase_bounds_by_step_and_by_token_share() -> None:
    run = TrainRunConfig(steps=100, batch_size=2, seq_len=16)  # a budget of 3200 tokens
    phases = [DataPhase(name="a", until_step=30), DataPhase(name="b", until_tokens=0.5, seq_len=64),
              DataPhase(name="c")]
    # a: 30 steps x 32 tokens = 960; b reaches 1600 tokens after ceil(640 / 128) = 5 steps of 128 tokens
    assert phase_bounds(phases, run, "train.phases") == [(1, 30, 16), (31, 35, 64), (36, 100, 16)]
    with pytest.raises(ConfigError, match=r"train.phases\[1\] \('b'\) would train steps 31..30 of a 100-step run"):
        phase_bounds([phases[0], DataPhase(name="b", until_step=30), phases[2]], run, "train.phases")
    # a share that rounds to nothing on a short run still leaves every phase a step
    short = TrainRunConfig(steps=2, batch_size=2, seq_len=16)
    assert phase_bounds([DataPhase(name="a", until_tokens=0.8), DataPhase(name="b")], short, "p") == [
        (1, 1, 16), (2, 2, 16)]


def test_phases_are_checked_when_the_config_loads() -> None:
    assert "phases" not in TrainConfig().identity()  # no schedule: the train key does not move
    assert TrainConfig(phases=PHASES).identity()["phases"][1]["seq_len"] == 8
    with pytest.raises(ValueError, match="the last phase 'b' runs to the end"):
        TrainConfig(phases=[PHASES[0], DataPhase(name="b", until_step=15)])
    with pytest.raises(ValueError, match="phase 'a' is not the last, so it needs until_step or until_tokens"):
        TrainConfig(phases=[DataPhase(name="a"), DataPhase(name="b")])
    with pytest.raises(ValueError, match=r"until_step must grow from phase to phase, got \[10, 5\]"):
        TrainConfig(phases=[PHASES[0], DataPhase(name="c", until_step=5), DataPhase(name="d")])


def write_scored_domain(root, num_docs: int = 10, doc_len: int = 40) -> Mixture:
    """One domain whose document i holds only token 10 + i and has quality score i, written shuffled."""
    rng = np.random.default_rng(0)
    order = rng.permutation(num_docs)
    tokens = np.concatenate([np.append(np.full(doc_len, 10 + i), 0) for i in order]).astype("<u2")
    (root / "web").mkdir(parents=True)
    tokens.tofile(root / "web" / "train.bin")
    tokens[:100].tofile(root / "web" / "val.bin")
    index = np.zeros(num_docs, dtype=[("end", "<i8"), ("quality", "<f8")])
    index["end"] = np.arange(1, num_docs + 1) * (doc_len + 1)
    index["quality"] = order.astype(float)
    np.save(root / "web" / f"train{DOC_INDEX_SUFFIX}", index)
    manifest = {"format": 1, "dtype": "uint16", "vocab_size": 64, "eos_id": 0,
                "domains": {"web": {"weight": 1.0, "train": ["web/train.bin"], "val": ["web/val.bin"]}}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return Mixture.from_manifest(root / "manifest.json", root)


def test_a_quality_curriculum_walks_the_documents_in_ascending_score(tmp_path) -> None:
    base = write_scored_domain(tmp_path)
    ordered = quality_ordered(base.domains["web"].train, "uint16", tmp_path / "sorted.bin", "here")
    expected = np.concatenate([np.append(np.full(40, 10 + i), 0) for i in range(10)])
    assert np.array_equal(np.fromfile(ordered, dtype="<u2"), expected)

    run = TrainRunConfig(steps=10, batch_size=4, seq_len=8)
    mixture = scheduled_mixture(base, [DataPhase(name="rising", order="quality")], run, tmp_path / "run")
    (phase,) = mixture.phases
    assert (phase.first_step, phase.last_step, phase.domains["web"].ordered) == (1, 10, True)
    for k in range(10):  # step k + 1 of 10 reads the k-th tenth of the sorted stream: documents k - 1 .. k + 1
        x, y, domains = draw_batch(mixture.for_phase(phase), 0, k, 0, 1, 4, 8, slot=(k, 10))
        seen = set(torch.cat([x, y], 1).flatten().tolist()) - {0}
        assert seen <= {9 + k, 10 + k, 11 + k}, (k, seen)
        assert domains == ["web"] * 4


class Batches(TrainCallback):
    """Each trained step's (phase, inputs)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[str, torch.Tensor]] = {}

    def pre_step(self, trainer, batch) -> None:
        self.seen[batch.step] = (batch.phase, batch.x.clone())


def weights(out_dir) -> dict[str, torch.Tensor]:
    return torch.load(out_dir / "model" / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    mixture = scheduled_mixture(write_mixture(root), PHASES, RUN, root / "run")
    out = tmp_path_factory.mktemp("full")
    batches, logged = Batches(), []
    result = train_model(MODEL, OPTIM, RUN, mixture, out, callbacks=[batches],
                         on_metrics=lambda s, m: logged.append((s, m)))
    return mixture, out, result, batches, logged


def test_phase_boundaries_and_token_accounting(scheduled) -> None:
    mixture, out, result, batches, logged = scheduled
    for step, (phase, x) in batches.seen.items():
        assert phase == ("a" if step <= 10 else "b")
        assert x.shape == ((4, 16) if step <= 10 else (4, 8))
        if step <= 10:
            assert int(x.max()) <= 7  # web only
    assert {int(t) for step in range(11, 21) for t in batches.seen[step][1].flatten()} & set(range(20, 31))
    rows_b = result.tokens_by_phase["b"]
    assert result.tokens_by_phase["a"] == {"web": 10 * 4 * 16}
    assert rows_b["web"] + rows_b["code"] == 10 * 4 * 8 and rows_b["code"] > rows_b["web"] > 0
    assert result.tokens_seen == 10 * 4 * 16 + 10 * 4 * 8
    assert [p["name"] for p in result.phases] == ["a", "b"] and result.phases[1]["weights"] == {"web": 0.25, "code": 0.75}
    charted = {step: (m["data/phase"], m["mixture/code"]) for step, m in logged if "data/phase" in m}
    assert charted == {5: (0.0, 0.0), 10: (0.0, 0.0), 15: (1.0, 0.75), 20: (1.0, 0.75)}
    # the launched path reads the same schedule back from the manifest it writes
    manifest = write_manifest(mixture, out / "launched.json", out.parent.parent)
    assert Mixture.from_manifest(manifest, out.parent.parent) == mixture


def test_the_same_schedule_gives_the_same_run(scheduled, tmp_path) -> None:
    mixture, out, result, _, _ = scheduled
    again = train_model(MODEL, OPTIM, RUN, mixture, tmp_path)
    assert again.batch_checksum_curve == result.batch_checksum_curve
    assert again.loss_curve == result.loss_curve


def test_a_resume_inside_a_phase_is_bit_identical(scheduled, tmp_path) -> None:
    mixture, out, result, _, _ = scheduled
    stopped = train_model(MODEL, OPTIM, RUN, mixture, tmp_path, stop_after=14)  # checkpoints at 4, 8, 12
    assert stopped.model_dir is None
    state = json.loads((tmp_path / "checkpoints" / "step_0000012" / "train_state.json").read_text())
    # the loader's position: tokens per phase per source, 2 steps into phase b
    assert state["source_tokens"]["a"] == {"web": 640} and sum(state["source_tokens"]["b"].values()) == 2 * 4 * 8
    resumed = train_model(MODEL, OPTIM, RUN, mixture, tmp_path)
    assert resumed.resumed_from_step == 12
    assert resumed.loss_curve == result.loss_curve  # exact floats
    assert resumed.tokens_by_phase == result.tokens_by_phase
    full, again = weights(out), weights(tmp_path)
    assert all(torch.equal(full[name], again[name]) for name in full)
