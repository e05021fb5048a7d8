"""The anneal's quality selections: the top share of scored documents by the clean stage's quality_score,
cut from the tokenize stage's shards through its document index, unscored documents never taken."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from kiln.tasks.constants import SHARDS_FILE, TOKENIZER_FILE
from kiln.tasks.data.documents import Document
from kiln.tasks.data.tokenize import TokenizeConfig, tokenize_corpus
from kiln.tasks.errors import ConfigError
from kiln.tasks.train.anneal import QualitySelection
from kiln.tasks.train.anneal_data import anneal_mixture, select_by_quality, top_quality_cutoff
from tests.fixtures.shards import write_stage
from tests.fixtures.splits import expected_splits

MAN_PAGES = sorted((Path(__file__).resolve().parents[3] / "data/sample/prose/coreutils-man").glob("*.txt"))
# web: 6 scored (two tied at 0.8) and one unscored; prose: 4 scored, one unscored; code: never scored
SCORES = {"web": [0.9, 0.8, 0.8, 0.7, 0.2, 0.1, None], "prose": [0.95, 0.6, 0.5, 0.05, None],
          "code": [None, None, None]}
VAL_FRACTION = 0.01  # each domain's one validation document is the one moved there to fill it


def fixture_docs() -> list[Document]:
    docs, pages = [], iter(MAN_PAGES)
    for domain, scores in SCORES.items():
        for i, score in enumerate(scores):
            metadata = {} if score is None else {"quality_score": score}
            docs.append(Document(f"{domain}/{i}", next(pages).read_text(encoding="utf-8")[:1500], "src", domain,
                                 "GPL-3.0-or-later", metadata))
    return docs


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory) -> tuple[dict, Path, list[Document]]:
    root = tmp_path_factory.mktemp("tokenized")
    docs = fixture_docs()
    (root / "out").mkdir()
    # three input shards: web and prose lie in two each, so selections read several token shards
    tokenize_corpus(TokenizeConfig(vocab_size=400, val_fraction=VAL_FRACTION), write_stage(root / "in", docs, 3),
                    root / "out")
    return json.loads((root / "out" / SHARDS_FILE).read_text()), root / "out", docs


def test_the_cutoff_keeps_the_top_share_and_every_tie_at_it():
    nan = math.nan
    scores = np.array([0.9, nan, 0.5, 0.5, 0.1])
    assert top_quality_cutoff(scores, 0.5) == 0.5  # 2 of the 4 scored, and the tie with the second
    assert top_quality_cutoff(scores, 0.01) == 0.9  # at least one
    assert top_quality_cutoff(scores, 1.0) == 0.1
    # 0.3 * 10 is 3.0000000000000004 in floats: still three documents, not four
    assert top_quality_cutoff(np.arange(10, 0, -1) / 10, 0.3) == 0.8
    assert top_quality_cutoff(np.array([nan, nan]), 0.5) is None


def test_tokenize_indexes_each_documents_tokens_and_score(tokenized):
    shards, root, docs = tokenized
    splits = expected_splits(docs, VAL_FRACTION)
    for domain, info in shards["domains"].items():
        for split in ("train", "val"):
            indexes = [np.load(root / shard["index"]) for shard in info[split]["shards"]]
            expected = [d.metadata.get("quality_score", math.nan) for d in splits[domain][split]]
            np.testing.assert_array_equal(np.concatenate([index["quality"] for index in indexes]), np.array(expected))
            assert [index["end"][-1] for index in indexes] == [shard["num_tokens"] for shard in info[split]["shards"]]
    assert shards["format"] == 3
    assert [len(shards["domains"][d]["train"]["shards"]) for d in ("web", "prose", "code")] == [2, 2, 1]


def test_a_selection_takes_the_best_train_documents_of_its_domains(tokenized, tmp_path):
    shards, root, docs = tokenized
    splits = expected_splits(docs, VAL_FRACTION)
    val_ids = sorted(d.id for s in splits.values() for d in s["val"])
    assert val_ids == ["code/0", "prose/0", "web/5"]  # the hash's choice: prose loses its best to validation
    # train: web 0.9 0.8 0.8 0.7 0.2 + unscored, prose 0.6 0.5 0.05 + unscored: 8 scored; top 0.25 = 2,
    # the cutoff is 0.8 and the tied third document is in too
    selection = QualitySelection(quality_top=0.25, weight=1.0, domains=["web", "prose"])
    path, stats = select_by_quality(shards, root, selection, "best", "anneal.mixture", tmp_path)
    assert stats == {"quality_top": 0.25, "score_cutoff": 0.8, "num_tokens": stats["num_tokens"], "num_scored": 8,
                     "num_selected": 3, "num_selected_by_domain": {"web": 3, "prose": 0},
                     "num_unscored_by_domain": {"web": 1, "prose": 1}}
    tokenizer = Tokenizer.from_file(str(root / TOKENIZER_FILE))
    ids = np.fromfile(path, dtype=shards["dtype"])
    assert len(ids) == stats["num_tokens"]
    pieces = np.split(ids, np.flatnonzero(ids == shards["eos_id"]) + 1)[:-1]
    texts = {d.id: d.text for d in docs}
    assert [tokenizer.decode(p[:-1].tolist()) for p in pieces] == [texts["web/0"], texts["web/1"], texts["web/2"]]

    # every scored domain by default: code is never scored, so it adds only to the unscored count
    _, stats = select_by_quality(shards, root, QualitySelection(quality_top=0.5, weight=1.0), "half", "w", tmp_path)
    assert (stats["num_scored"], stats["num_selected"], stats["score_cutoff"]) == (8, 4, 0.7)
    assert stats["num_selected_by_domain"] == {"code": 0, "prose": 0, "web": 4}
    assert stats["num_unscored_by_domain"] == {"code": 2, "prose": 1, "web": 1}


def test_unscored_and_unknown_domains_are_refused_with_the_reason(tokenized, tmp_path):
    shards, root, _ = tokenized
    with pytest.raises(ConfigError, match=r"anneal.mixture.best.domains: \['code'\] have no document with a quality_score"):
        select_by_quality(shards, root, QualitySelection(quality_top=0.5, weight=1.0, domains=["code", "web"]), "best",
                          "anneal.mixture", tmp_path)
    with pytest.raises(ConfigError, match=r"anneal.mixture.best.domains: \['news'\] are not in the corpus"):
        select_by_quality(shards, root, QualitySelection(quality_top=0.5, weight=1.0, domains=["news"]), "best",
                          "anneal.mixture", tmp_path)
    with pytest.raises(ConfigError, match=r"anneal.mixture: \['web'\] name quality selections but are domains"):
        anneal_mixture(shards, root, {"web": QualitySelection(quality_top=0.5, weight=1.0)}, "anneal.mixture", tmp_path)
    with pytest.raises(ConfigError, match=r"anneal.mixture: quality selection names \['\.\./best', 'top web'\] name files"):
        anneal_mixture(shards, root, {"top web": QualitySelection(quality_top=0.5, weight=1.0),
                                      "../best": QualitySelection(quality_top=0.5, weight=1.0)}, "anneal.mixture", tmp_path)


def test_the_mixture_weighs_domains_and_selections_together(tokenized, tmp_path):
    shards, root, _ = tokenized
    mixture, stats = anneal_mixture(shards, root, {"prose": 1.0, "web": 2.0,
                                                   "best": QualitySelection(quality_top=0.25, weight=1.0)},
                                    "anneal.mixture", tmp_path)
    assert {n: d.weight for n, d in mixture.domains.items()} == {"code": 0.0, "prose": 0.25, "web": 0.5, "best": 0.25}
    assert mixture.domains["best"].val == () and mixture.domains["best"].train[0].parent == tmp_path / "quality_selections"
    assert stats["best"]["num_selected"] == 3
    only, _ = anneal_mixture(shards, root, {"best": QualitySelection(quality_top=1.0, weight=0.3)}, "w", tmp_path)
    assert only.domains["best"].weight == 1.0 and only.domains["web"].weight == 0.0
