"""The anneal from any kept train checkpoint, and the anneal ablation: real tokenizer, real training, real
lm-eval, on a train run of a few steps built here (the stage bodies run on a hand-made StageContext)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.tasks.config import load_config
from kiln.tasks.constants import SHARDS_FILE
from kiln.tasks.data.documents import Document
from kiln.tasks.data.tokenize import TokenizeConfig, tokenize_corpus
from kiln.tasks.errors import ConfigError
from kiln.tasks.ledger import StageRecorder
from kiln.tasks.runner import stage_forecast
from kiln.tasks.stage import StageContext
from kiln.tasks.stages import anneal, anneal_ablation
from kiln.tasks.store import Store
from kiln.tasks.tracker import NullTracker
from kiln.tasks.train.config import ModelConfig, OptimConfig, TrainRunConfig
from kiln.tasks.train.data_loader import mixture_with_weights
from kiln.tasks.train.loop import train_model
from kiln.tasks.train.model import load_model
from kiln.tasks.train.planner import forecast_training
from tests.fixtures.shards import write_stage

REPO = Path(__file__).resolve().parents[3]
MODEL = ModelConfig(d_model=16, n_layers=1, n_heads=2, max_seq_len=64)
CANDIDATES = '{prose_only: {prose: 1}, best_web: {web: 1, best: {quality_top: 0.5, weight: 1, domains: [web]}}}'


def corpus() -> list[Document]:
    docs = []
    for domain, folder in (("prose", "data/sample/prose/coreutils-man"), ("web", "data/sample/prose/util-linux-man")):
        for i, path in enumerate(sorted((REPO / folder).glob("*.txt"))[:12]):
            docs.append(Document(f"{domain}/{i}", path.read_text(encoding="utf-8")[:3000], "src", domain, "GPL-3.0",
                                 {"quality_score": round(0.05 + 0.075 * i, 4)} if domain == "web" else {}))
    return docs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """tokenize, train (4 steps, checkpoints at 2 and 4 kept) and decontaminate (nothing found) outputs."""
    root = tmp_path_factory.mktemp("inputs")
    tokenize, train, decontaminate = root / "tokenize", root / "train", root / "decontaminate"
    for folder in (tokenize, train, decontaminate):
        folder.mkdir()
    tokenize_corpus(TokenizeConfig(vocab_size=300, val_fraction=0.1), write_stage(root / "docs", corpus()), tokenize)
    cfg = config(root)
    mixture = mixture_with_weights(json.loads((tokenize / SHARDS_FILE).read_text()), tokenize, {"prose": 1, "web": 1}, "t")
    run = cfg.train.run.model_copy(update={"steps": 4, "checkpoint_every": 2, "keep_every": 2, "eval_batches": 1})
    train_model(MODEL, OptimConfig(lr=0.01, warmup_steps=1), run, mixture, train)
    (decontaminate / "contamination.json").write_text(json.dumps({"benchmarks": {}}))
    (decontaminate / "contamination_rates.json").write_text("{}")
    return {"tokenize": tokenize, "train": train, "decontaminate": decontaminate, "root": root}


def config(root: Path, *overrides: str):
    return load_config(REPO / "configs/tiny.yaml", [
        f"work_dir={root / 'work'}", "train.lr=0.01", "evaluate.limit=2", "evaluate.lines.domains=[]",
        f"evaluate.eval_files=[{REPO / 'data/evals/heldout.jsonl'}]", *overrides])


def context(inputs: dict[str, Path], out: Path, *overrides: str) -> StageContext:
    out.mkdir(parents=True)
    cfg = config(inputs["root"], *overrides)
    return StageContext(cfg, out, {k: v for k, v in inputs.items() if k != "root"}, Store(cfg.store_root),
                        StageRecorder(NullTracker(), "run", "stage", "key"))


def test_the_anneal_starts_from_a_kept_checkpoint_and_refuses_one_that_is_not(inputs, tmp_path):
    assert anneal.kept_train_steps(inputs["train"]) == [2, 4]
    ctx = context(inputs, tmp_path / "a")
    with pytest.raises(ConfigError, match=r"anneal.from_step=3: the train run kept no checkpoint of step 3; "
                                          r"it kept steps \[2, 4\]"):
        anneal.start_model(ctx, 3, "anneal.from_step")
    start = anneal.start_model(ctx, 2, "anneal.from_step")
    assert (start.step, start.is_final, start.model_dir) == (2, False, tmp_path / "a" / anneal.START_MODEL_DIR)
    # step 2's weights, not the final model's
    at_two, final = load_model(start.model_dir)[0], load_model(inputs["train"] / "model")[0]
    assert not torch.equal(at_two.state_dict()["tok_emb.weight"], final.state_dict()["tok_emb.weight"])
    final_start = anneal.start_model(ctx, None, "anneal.from_step")
    assert (final_start.step, final_start.is_final, final_start.model_dir) == (4, True, inputs["train"] / "model")


def test_the_ablation_anneals_each_candidate_from_one_checkpoint_and_ranks_them(inputs, tmp_path):
    ctx = context(inputs, tmp_path / "ablation", f"anneal_ablation.candidates={CANDIDATES}",
                  "anneal_ablation.steps=3", "anneal_ablation.from_step=2", "cluster.gpus_per_node=1",
                  # the train run of `inputs`, whose step 2 the config's keep policy must keep
                  "train.run.steps=4", "train.run.checkpoint_every=2", "train.run.keep_every=2")
    stats = anneal_ablation.run(ctx)
    assert stats["from_step"] == 2 and stats["steps"] == 3
    assert stats["num_accelerators"] == 0  # what the runner prices its wall time by: the anneals ran on CPU
    # each anneal's forecast (for the cluster's one GPU) is in the stage's, which the runner sums
    run = TrainRunConfig(steps=3, batch_size=8, seq_len=64)
    expected = forecast_training(MODEL, 300, run, ctx.cfg.train.parallel, ctx.cfg.cluster).to_dict()
    assert ctx.recorder.forecasts == {"branches/prose_only": expected, "branches/best_web": expected}
    assert stage_forecast(ctx.recorder.forecasts)["accelerator_s"] == expected["accelerator_s"] * 2
    assert set(stats["ranking"]) == {"prose_only", "best_web"} and stats["best"] == next(iter(stats["ranking"]))
    summary = json.loads((ctx.out_dir / anneal_ablation.SUMMARY_FILE).read_text())
    # each candidate's change is the mean over the suite's bits-per-byte tasks of its score minus the start's
    bpb_rows = [r for r in summary["rows"] if r["metric"] == "bits_per_byte"]
    row = next(r for r in bpb_rows if r["task"] == "kiln_heldout")
    for name, change in stats["ranking"].items():
        assert all(r[f"{name} - start"] == r[name] - r["start"] for r in bpb_rows)
        assert change == pytest.approx(sum(r[f"{name} - start"] for r in bpb_rows) / len(bpb_rows), rel=1e-12)
    # the quality selection took the top half of the 8 web train documents (web/2, 5, 7 and 10 validate):
    # web/11, 9, 8 and 6, scored 0.875, 0.725, 0.65 and 0.5
    selection = stats["candidates"]["best_web"]["quality_selections"]["best"]
    assert (selection["num_scored"], selection["num_selected"], selection["score_cutoff"]) == (8, 4, 0.5)
    metrics = json.loads((ctx.out_dir / "branches/prose_only/metrics.json").read_text())
    assert len(metrics["lr_curve"]) == 3 and metrics["lr_curve"][-1][1] == 0.0  # 1-sqrt to exactly 0
    report = (ctx.out_dir / anneal_ablation.REPORT_FILE).read_text()
    assert f"**Best: `{stats['best']}`**" in report and "| prose_only |" in report and "prose_only − start" in report
    # the evaluate stage reads each branch as a model of its own
    branches = anneal_ablation.ablation_results(ctx.out_dir)
    assert set(branches) == {"ablation/prose_only", "ablation/best_web"}
    assert branches["ablation/prose_only"]["metrics"]["kiln_heldout/bits_per_byte"] == row["prose_only"]
    # a resumed attempt on the same folder trains and evaluates nothing already finished
    model_file = ctx.out_dir / "branches/prose_only/model/model.pt"
    written = model_file.stat().st_mtime_ns
    assert anneal_ablation.run(ctx) == stats and model_file.stat().st_mtime_ns == written


def test_no_candidates_is_a_no_op_that_says_so(inputs, tmp_path):
    ctx = context(inputs, tmp_path / "none", "anneal_ablation.candidates={}")
    assert anneal_ablation.run(ctx) == {"best": None, "ranking": {}, "from_step": None, "steps": 5, "candidates": {},
                                        "num_accelerators": 0}
    assert "nothing was run" in (ctx.out_dir / anneal_ablation.REPORT_FILE).read_text()
    assert anneal_ablation.ablation_results(ctx.out_dir) == {}
    assert sorted(p.name for p in ctx.out_dir.iterdir()) == [anneal_ablation.SUMMARY_FILE, anneal_ablation.REPORT_FILE]
