"""New data batches during production (issue 33): a batch goes through collect, clean, dedup against the
persisted index, decontaminate and tokenize (the batch stage), joins a production run at an adjustment
point (`train.batches` with `train.branch`), is counted exactly per phase, and a contaminated document
planted in it never reaches a training step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from kiln.tasks.config import load_config
from kiln.tasks.constants import SHARDS_FILE, TOKENIZER_FILE
from kiln.tasks.data.dedup import DedupConfig
from kiln.tasks.data.dedup_job import dedup_documents
from kiln.tasks.data.documents import Document
from kiln.tasks.errors import ConfigError
from kiln.tasks.lineage import lineage
from kiln.tasks.runner import run_stage
from kiln.tasks.scaling.mix import MIXTURE_FILE
from kiln.tasks.store import Store
from kiln.tasks.train.data_loader import Mixture, draw_batch
from kiln.tasks.train.data_schedule import NewBatch, batch_source, scheduled_mixture, with_batches
from kiln.tasks.train.distributed import batch_checksum
from kiln.tasks.train.health import data_index
from tests.fixtures.continuous_eval import TEXTS
from tests.fixtures.validate_inputs import KEYS, commit, commit_fit_and_gate, commit_mix

REPO = Path(__file__).resolve().parents[2]
DATA_KEYS = {"clean": "c1ea00000011", "dedup": "dedb00000012", "decontaminate": "dec000000013"}
BATCH_KEY = "ba7c00000014"
RUN = ["train.run.steps=8", "train.run.checkpoint_every=2", "train.run.keep_every=2", "train.run.eval_batches=1",
       "train.run.num_threads=1", "anneal_ablation.from_step=null", "train.phases=[]"]

# The held-out passage the eval suite scores; the planted document quotes it inside otherwise clean prose.
EVAL_PASSAGE = ("The lighthouse keeper counted forty seven ships passing the northern cape during the long winter "
                "storm of that year, and wrote each name in a green ledger that still hangs beside the harbour office door.")
CLEAN_DOCS = [
    "Farmers in the valley have started planting their spring crops earlier than in previous years. The soil is "
    "warmer, and the rains arrive in March rather than April. Many of them now grow beans and maize side by side, "
    "because the two plants help each other and the harvest is larger. The local cooperative buys most of what "
    "they produce and sells it in the towns along the river, where the markets are open every day of the week. "
    "The harvest festival is held at the end of the summer. Families come from the hills to dance and to eat together.",
    "The new library opened on the corner of the main square last month. It has a reading room with large windows, "
    "a small cafe, and a section for children with books in four languages. Volunteers teach evening classes there "
    "for adults who want to learn to read or to use a computer. The building was once a bank, and the old vault "
    "now holds the archive of the town newspaper, which goes back more than one hundred years. "
    "The mayor says the library is the best thing the town has built in years. It is open every day except Sunday.",
    "Cycling to work has become popular in the city since the council built protected lanes on the busiest roads. "
    "Shops near the lanes report more customers, and the number of accidents has fallen. Some drivers complained "
    "at first about the lost parking spaces, but most people now agree that the streets are quieter and the air "
    "is cleaner. The council plans to extend the network to the suburbs over the next three years. "
    "Parents say their children now ride to school on their own. The schools have added racks for several hundred bikes.",
    "Bakers say that good bread needs only flour, water, salt and time. The dough should rest for many hours so "
    "that the flavour can develop and the crust becomes dark and crisp in the oven. A small bakery near the station "
    "sells out every morning before nine o'clock, and its owner still gets up at three to light the wood fire that "
    "heats the old brick oven her grandfather built when he opened the shop after the war. "
    "Customers queue in the dark on winter mornings. Some of them have bought their bread there for forty years.",
]
PLANTED = ("Museums along the coast collect the diaries of sailors and the letters they sent home to their families. "
           "One of the most visited rooms shows a page copied from an old record, which reads as follows. "
           + EVAL_PASSAGE + " Visitors often stop in front of it for a long time before they walk on to the maps "
           "and the models of ships that sailed from the harbour in the last century. The museum is free on the first "
           "Monday of every month. School classes visit it in the spring and write about what they have seen.")


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _inputs(tmp_path: Path) -> tuple[Store, list[str]]:
    """A store holding the stages a batch and a production run read, and the config overrides naming them."""
    store = Store(tmp_path / "store")
    commit_mix(store, inputs={"tokenize": KEYS["tokenize"]})
    tokenizer = store.path("mix", KEYS["mix"]) / "tokenizer.json"
    commit(store, "tokenize", lambda out: (out / TOKENIZER_FILE).write_bytes(tokenizer.read_bytes()),
           inputs={"decontaminate": DATA_KEYS["decontaminate"]})
    commit_fit_and_gate(store, 0.02)
    keys = {**KEYS, **DATA_KEYS}
    corpus = _jsonl(tmp_path / "corpus.jsonl", [vars(Document(f"c{i}", t, "corpus", "prose", "MIT"))
                                                for i, t in enumerate(TEXTS)])
    for stage, write in (("clean", lambda out: None), ("decontaminate", lambda out: None),
                         ("dedup", lambda out: dedup_documents(DedupConfig(), [corpus], out))):
        out = store.begin(stage, keys[stage])
        write(out)
        store.commit(stage, keys[stage], {"stage": stage, "key": keys[stage], "format_version": 1, "inputs": {},
                                          "identity": {}, "stats": {}, "wall_s": 0.1, "mlflow_run_id": "untracked",
                                          "created_at": "2026-01-01T00:00:00Z"})
    evals = _jsonl(tmp_path / "evals.jsonl", [{"id": "harbour", "text": EVAL_PASSAGE, "domain": "prose"}])
    delivered = _jsonl(tmp_path / "june" / "docs.jsonl",
                       [{"id": f"june-{i}", "text": t} for i, t in enumerate(CLEAN_DOCS)]
                       + [{"id": "june-planted", "text": PLANTED}])
    overrides = [f"work_dir={tmp_path / 'work'}", f"evaluate.eval_files=[{evals}]", "evaluate.suite.categories=[]",
                 "clean.quality_model=null", "clean.quality_training=null", "batch.name=june",
                 f"batch.sources=[{{name: june, path: {delivered.parent}, format: jsonl, domain: prose, licence: MIT}}]",
                 *RUN]
    return store, overrides


def _windows(ids: list[int], size: int) -> set[tuple[int, ...]]:
    return {tuple(ids[i:i + size]) for i in range(len(ids) - size + 1)}


def test_a_new_batch_joins_at_the_adjustment_counted_per_phase_and_its_contaminated_document_never_trains(
        tmp_path) -> None:
    store, overrides = _inputs(tmp_path)
    tiny = REPO / "configs" / "tiny.yaml"
    keys = {**KEYS, **DATA_KEYS, "batch": BATCH_KEY}

    # The batch stage: 5 documents delivered; the one quoting the eval passage is removed by decontamination,
    # the 4 others are tokenized with the corpus's tokenizer into the train split.
    with pytest.raises(ConfigError, match="needs batch.name=NAME and batch.sources"):
        run_stage("batch", load_config(tiny, [o for o in overrides if not o.startswith("batch.")]), store=store,
                  keys={**keys, "batch": "ba7c000000ff"})
    run_stage("batch", load_config(tiny, overrides), store=store, keys=keys)
    batch = store.manifest("batch", BATCH_KEY)
    stats = batch["stats"]
    assert batch["inputs"] == {"clean": DATA_KEYS["clean"], "dedup": DATA_KEYS["dedup"],
                               "decontaminate": DATA_KEYS["decontaminate"], "tokenize": KEYS["tokenize"]}
    assert {step: (s["in"], s["kept"]) for step, s in stats["docs_by_step"].items()} == {
        "collect": (5, 5), "clean": (5, 5), "dedup-batch": (5, 5), "decontaminate": (5, 4), "tokenize": (4, 4)}
    assert stats["num_contaminated"] == 1
    shards = json.loads((store.path("batch", BATCH_KEY) / "tokenize" / SHARDS_FILE).read_text())
    assert shards["domains"]["prose"]["val"]["num_tokens"] == 0  # a batch is all train
    tokenizer = Tokenizer.from_file(str(store.path("mix", KEYS["mix"]) / "tokenizer.json"))
    planted = tokenizer.encode(EVAL_PASSAGE).ids
    assert stats["tokens_by_domain"] == {"prose": sum(len(tokenizer.encode(t).ids) + 1 for t in CLEAN_DOCS)}
    # what the loader may draw from: every clean document whole, nothing of the planted one
    batch_tokens = np.fromfile(store.path("batch", BATCH_KEY) / "tokenize" / shards["domains"]["prose"]["train"]
                               ["shards"][0]["path"], dtype=shards["dtype"]).tolist()
    assert all(_windows(tokenizer.encode(doc).ids, 8) <= _windows(batch_tokens, 8) for doc in CLEAN_DOCS)
    assert not _windows(planted, 8) & _windows(batch_tokens, 8)

    # The production run, 8 steps, then an adjustment from its step-4 checkpoint that takes the batch in.
    run_stage("train", load_config(tiny, overrides), store=store, keys=keys)
    joined = [*overrides, f"train.batches=[{BATCH_KEY}]", f"train.branch={{prefix: '{KEYS['train']}', from_step: 4}}"]
    cfg = load_config(tiny, joined)
    adjusted = "ad1000000009"
    run_stage("train", cfg, store=store, keys={**keys, "train": adjusted})
    train = store.manifest("train", adjusted)["stats"]
    metrics = json.loads((store.path("train", adjusted) / "metrics.json").read_text())
    prefix = json.loads((store.path("train", KEYS["train"]) / "metrics.json").read_text())
    assert (train["resumed_from_step"], train["steps_trained"]) == (4, 4)
    assert metrics["batch_checksum_curve"][:4] == prefix["batch_checksum_curve"][:4]  # the prefix, not retrained

    # What steps 5..8 trained, drawn again: the loader's rows, checked against the run's own batch checksums.
    run = cfg.train.run
    base = Mixture.from_manifest(store.path("mix", KEYS["mix"]) / MIXTURE_FILE, store.root)
    folder = store.path("batch", BATCH_KEY) / "tokenize"
    mixture = with_batches(scheduled_mixture(base, cfg.train.phases, run, tmp_path),
                           [NewBatch("june", {"prose": (folder / shards["domains"]["prose"]["train"]["shards"][0]["path"],)})])
    rows_from_batch, trained = 0, []
    for step in range(5, run.steps + 1):
        x, y, sources = draw_batch(mixture, run.seed, data_index(step, []), 0, 1, run.batch_size, run.seq_len)
        assert batch_checksum(x, y, 0) == dict(metrics["batch_checksum_curve"])[step]
        rows_from_batch += sources.count(batch_source("june", "prose"))
        trained += [[*row_x, row_y[-1]] for row_x, row_y in zip(x.tolist(), y.tolist())]
    # exact accounting: the tokens the batch gave, per phase, are the rows it gave times the row length
    assert rows_from_batch > 0, "the batch gave no row: the check below would prove nothing"
    assert train["batches"] == {"june": {"key": BATCH_KEY, "tokens_by_phase": {"all": rows_from_batch * run.seq_len}}}
    assert metrics["tokens_by_phase"]["all"][batch_source("june", "prose")] == rows_from_batch * run.seq_len
    # the planted document never trained: no trained row holds 8 consecutive tokens of the eval passage, while
    # rows of the batch's clean documents did train
    trained_windows = set().union(*(_windows(row, 8) for row in trained))
    assert not _windows(planted, 8) & trained_windows
    assert any(_windows(tokenizer.encode(doc).ids, 8) & trained_windows for doc in CLEAN_DOCS)

    # The lineage says what joined; a batch key the store lacks is refused before anything trains.
    assert lineage(store, "train", adjusted)[-1].continues == (
        f"train {KEYS['train']} up to step 4, then schedule the mix stage's mixture, with new batches {BATCH_KEY} "
        f"to step {run.steps}")
    with pytest.raises(ConfigError, match="no complete batch of that key"):
        run_stage("train", load_config(tiny, [*joined[:-2], "train.batches=[abcdef]", joined[-1]]), store=store,
                  keys={**keys, "train": "ad100000000a"})
