"""Tokenize: shards decode back to the documents, splits are deterministic, the tokenizer trains on a
sample, shards are encoded in parallel to what one shard gives, accounting holds."""

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from kiln.tasks.constants import SHARDS_FILE, TOKENIZER_FILE
from kiln.tasks.data.documents import Document
from kiln.tasks.data.tokenize import TokenizeConfig, split_of, tokenize_corpus
from tests.fixtures.shards import records, write_stage
from tests.fixtures.splits import expected_splits

README = Path("/usr/share/doc")


def real_paragraphs(limit: int) -> list[str]:
    texts = []
    for path in sorted(README.glob("*/README*")) + sorted(README.glob("*/copyright")):
        if path.is_file() and path.suffix != ".gz":
            text = path.read_text(errors="ignore").strip()
            if len(text) > 300:
                texts.append(text[:3000])
        if len(texts) >= limit:
            break
    return texts


def make_docs(n: int = 24) -> list[Document]:
    texts = real_paragraphs(n)
    assert len(texts) >= 12, "need real text on this machine"
    domains = ["prose", "code"]
    return [Document(f"src/{i}", t, "src", domains[i % 2], "MIT") for i, t in enumerate(texts)]


def _tokenize(tmp_path: Path, name: str, docs: list[Document], num_shards: int, **cfg) -> tuple[dict, Path]:
    out = tmp_path / name
    out.mkdir()
    stats = tokenize_corpus(TokenizeConfig(**cfg), write_stage(tmp_path / f"{name}-in", docs, num_shards), out)
    return stats, out


def _decoded(out: Path) -> dict[str, dict[str, list[str]]]:
    """domain → split → the texts its shards hold, in shard order."""
    shards = json.loads((out / SHARDS_FILE).read_text())
    tokenizer = Tokenizer.from_file(str(out / TOKENIZER_FILE))
    decoded: dict[str, dict[str, list[str]]] = {}
    for domain, info in shards["domains"].items():
        for split in ("train", "val"):
            ids = np.concatenate([np.fromfile(out / s["path"], dtype=shards["dtype"]) for s in info[split]["shards"]]
                                 or [np.zeros(0, shards["dtype"])])
            assert len(ids) == info[split]["num_tokens"] == sum(s["num_tokens"] for s in info[split]["shards"])
            pieces = np.split(ids, np.flatnonzero(ids == shards["eos_id"]) + 1)[:-1]
            decoded.setdefault(domain, {})[split] = [tokenizer.decode(p[:-1].tolist()) for p in pieces]
    return decoded


def test_shards_decode_to_documents(tmp_path):
    docs = make_docs()
    stats, out = _tokenize(tmp_path, "one", docs, 1, vocab_size=600, val_fraction=0.2)
    assert stats["num_in"] == stats["num_kept"] == len(docs)
    splits = expected_splits(docs, 0.2)
    assert _decoded(out) == {d: {s: [doc.text for doc in docs_] for s, docs_ in by_split.items()}
                             for d, by_split in splits.items()}
    shards = json.loads((out / SHARDS_FILE).read_text())
    assert stats["num_tokens"] == sum(i[s]["num_tokens"] for i in shards["domains"].values() for s in ("train", "val"))
    assert stats["tokenizer_sample"]["num_docs"] == len(docs)  # the corpus is smaller than the sample: all of it


def test_shards_encoded_in_parallel_equal_one_shard(tmp_path):
    """Four input shards, encoded two at a time: a domain's token shards read in order are the tokens of one
    input shard; the tokenizer (trained on the whole small corpus either way) is the same."""
    docs = make_docs()
    one_stats, one = _tokenize(tmp_path, "one", docs, 1, vocab_size=600, val_fraction=0.2)
    four_stats, four = _tokenize(tmp_path, "four", docs, 4, vocab_size=600, val_fraction=0.2, num_workers=2)
    assert (one / TOKENIZER_FILE).read_bytes() == (four / TOKENIZER_FILE).read_bytes()
    assert _decoded(one) == _decoded(four)
    shards = json.loads((four / SHARDS_FILE).read_text())
    assert len(shards["domains"]["prose"]["train"]["shards"]) == 4
    for stats in (one_stats, four_stats):
        stats.pop("shards"), stats.pop("executor_cpu_s")
    assert one_stats == four_stats


def test_the_tokenizer_trains_on_a_deterministic_sample_of_every_shard(tmp_path):
    docs = make_docs()
    first, out = _tokenize(tmp_path, "first", docs, 3, vocab_size=600, train_sample_bytes=9000)
    again, _ = _tokenize(tmp_path, "again", docs, 3, vocab_size=600, train_sample_bytes=9000)
    sample = first["tokenizer_sample"]
    assert sample == again["tokenizer_sample"] and 9000 <= sample["num_bytes"] < 9000 + 3 * 3000 * 3
    assert sample["num_docs"] < len(docs) and sample["num_docs"] >= 3  # at least one document of each shard
    assert (out / TOKENIZER_FILE).read_bytes() == (tmp_path / "again" / TOKENIZER_FILE).read_bytes()
    assert first["num_kept"] == len(docs)  # every document is encoded, sampled or not


def test_split_is_deterministic_and_every_domain_validates(tmp_path):
    docs = make_docs()
    _, forward = _tokenize(tmp_path, "forward", docs, 3, vocab_size=600, val_fraction=0.05)
    _, backward = _tokenize(tmp_path, "backward", list(reversed(docs)), 2, vocab_size=600, val_fraction=0.05)
    first, second = _decoded(forward), _decoded(backward)
    for domain in first:
        assert sorted(first[domain]["val"]) == sorted(second[domain]["val"])
        assert first[domain]["val"] and first[domain]["train"]  # the hash alone left a split empty: one moved there
    expected = expected_splits(docs, 0.05)
    assert {d: {s: [doc.text for doc in docs_] for s, docs_ in by_split.items()} for d, by_split in expected.items()} == first
    moved = [d.id for splits in expected.values() for d in splits["val"] if split_of(d.id, 0.05) == "train"]
    assert moved  # a shard was encoded again with its document moved to validation


def test_a_document_without_tokens_is_quarantined(tmp_path):
    docs = make_docs(12)[:4] + [Document("empty", "", "src", "prose", "MIT")]
    stats, out = _tokenize(tmp_path, "q", docs, 2, vocab_size=400)
    assert (stats["num_kept"], stats["quarantined"]) == (4, {"no_tokens": 1})
    assert [(r["id"], r["reason"]) for r in records(out, "quarantine")] == [("empty", "no_tokens")]


def test_token_shards_written_by_worker_processes_are_committed_without_being_read_again(tmp_path, monkeypatch):
    # issue 34: each rank hashes its token shards and document indexes as it writes them, in its own worker
    # process; the ledger carries the digests to this process, whose commit lists them without reading them
    from kiln.tasks import store as store_module

    store = store_module.Store(tmp_path / "store")
    out = store.begin("tokenize", "k")
    tokenize_corpus(TokenizeConfig(vocab_size=600, val_fraction=0.2, num_workers=2),
                    write_stage(tmp_path / "in", make_docs(), 4), out)
    written = {p.relative_to(out).as_posix() for p in (out / "shards").rglob("*") if p.suffix in (".bin", ".npy")}
    assert len(written) == 26  # a token file and an index per shard, domain and split that got documents
    real_sha256, read = store_module.file_sha256, []
    monkeypatch.setattr(store_module, "file_sha256", lambda path: read.append(path) or real_sha256(path))
    final = store.commit("tokenize", "k", {"stats": {}})
    assert final.exists()
    assert not {p.relative_to(out).as_posix() for p in read} & written
    monkeypatch.undo()
    assert store.problems("tokenize", "k", checksums=True) == []  # the digests listed are the files' own
