"""Tokenize: shards decode back to the documents, splits are deterministic, accounting holds."""

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from tasks.data.documents import Document, write_documents
from tasks.data.tokenize import SHARDS_FILE, TOKENIZER_FILE, TokenizeConfig, assign_splits, tokenize_corpus

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


def test_shards_decode_to_documents(tmp_path):
    docs = make_docs()
    write_documents(tmp_path / "in.jsonl", docs)
    out = tmp_path / "out"
    out.mkdir()
    stats = tokenize_corpus(TokenizeConfig(vocab_size=600, val_fraction=0.2), tmp_path / "in.jsonl", out)
    assert stats["num_in"] == stats["num_kept"] == len(docs)
    shards = json.loads((out / SHARDS_FILE).read_text())
    tokenizer = Tokenizer.from_file(str(out / TOKENIZER_FILE))
    eos = shards["eos_id"]
    splits = assign_splits(docs, 0.2)
    for domain, info in shards["domains"].items():
        for split in ("train", "val"):
            ids = np.fromfile(out / info[split]["path"], dtype=shards["dtype"])
            assert len(ids) == info[split]["num_tokens"] > 0
            pieces = np.split(ids, np.flatnonzero(ids == eos) + 1)[:-1]
            decoded = [tokenizer.decode(p[:-1].tolist()) for p in pieces]
            assert decoded == [d.text for d in splits[domain][split]]
    assert stats["num_tokens"] == sum(i[s]["num_tokens"] for i in shards["domains"].values() for s in ("train", "val"))


def test_split_is_deterministic_and_every_domain_validates():
    docs = make_docs()
    first = assign_splits(docs, 0.05)
    second = assign_splits(list(reversed(docs)), 0.05)
    for domain in first:
        assert sorted(d.id for d in first[domain]["val"]) == sorted(d.id for d in second[domain]["val"])
        assert first[domain]["val"] and first[domain]["train"]
