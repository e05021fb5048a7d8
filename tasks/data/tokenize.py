"""Tokenize: train a byte-level BPE tokenizer on the corpus and write token shards per domain.

Shards are raw little-endian numpy arrays (memory-mapped by the loader), documents
concatenated with an end-of-text token after each. A deterministic hash of each document id
puts it in the train or validation split, so the split survives re-ordering and re-runs.

Beside each shard, a document index (`<split>.docs.npy`) gives each document's end offset in the
shard (tokens, its end-of-text included) and the clean stage's `quality_score` (NaN for a
document the classifier did not score): the anneal selects the best documents by it without
tokenizing anything again.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from pydantic import Field
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tasks.accounting import DocCounts
from tasks.configbase import Section
from tasks.data.dedup import quality_score
from tasks.data.documents import Document, read_documents

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
SHARDS_FILE = "shards.json"
SHARDS_FORMAT = 2  # 2: each shard has a document index (DOC_INDEX_DTYPE)
DOC_INDEX_DTYPE = np.dtype([("end", "<i8"), ("quality", "<f8")])
_ENCODE_BATCH = 256


class TokenizeConfig(Section):
    vocab_size: int = Field(4096, ge=260, description="BPE vocabulary size including the 256 byte tokens")
    min_frequency: int = Field(2, ge=1)
    val_fraction: float = Field(0.05, gt=0, lt=0.5, description="share of each domain's documents held out for validation")


def train_tokenizer(texts: list[str], cfg: TokenizeConfig) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def split_of(doc_id: str, val_fraction: float) -> str:
    bucket = int(hashlib.sha1(doc_id.encode()).hexdigest()[:8], 16) / 2**32
    return "val" if bucket < val_fraction else "train"


def assign_splits(docs: list[Document], val_fraction: float) -> dict[str, dict[str, list[Document]]]:
    """domain → split → documents; every domain with ≥ 2 docs gets ≥ 1 validation and ≥ 1 train doc."""
    by_domain: dict[str, dict[str, list[Document]]] = defaultdict(lambda: {"train": [], "val": []})
    for doc in docs:
        by_domain[doc.domain][split_of(doc.id, val_fraction)].append(doc)
    for splits in by_domain.values():
        for empty, full in (("val", "train"), ("train", "val")):
            if not splits[empty] and len(splits[full]) >= 2:
                moved = min(splits[full], key=lambda d: hashlib.sha1(d.id.encode()).hexdigest())
                splits[full].remove(moved)
                splits[empty].append(moved)
    return dict(sorted(by_domain.items()))


def tokenize_corpus(cfg: TokenizeConfig, input_file: Path, out_dir: Path) -> dict:
    docs = list(read_documents(input_file))
    counts = DocCounts(num_in=len(docs))
    tokenizer = train_tokenizer([d.text for d in docs], cfg)
    tokenizer.save(str(out_dir / TOKENIZER_FILE))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    vocab_size = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max else np.uint32

    domains: dict[str, dict] = {}
    num_tokens = 0
    num_bytes = 0
    for domain, splits in assign_splits(docs, cfg.val_fraction).items():
        domains[domain] = {}
        for split, split_docs in splits.items():
            rel = Path("shards") / domain / f"{split}.bin"
            (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            split_tokens = 0
            index: list[tuple[int, float]] = []
            with open(out_dir / rel, "wb") as handle:
                for start in range(0, len(split_docs), _ENCODE_BATCH):
                    batch = split_docs[start:start + _ENCODE_BATCH]
                    for doc, encoding in zip(batch, tokenizer.encode_batch([d.text for d in batch])):
                        if not encoding.ids:
                            counts.quarantined["no_tokens"] += 1
                            continue
                        ids = np.asarray(encoding.ids + [eos_id], dtype=dtype)
                        handle.write(ids.astype(ids.dtype.newbyteorder("<"), copy=False).tobytes())
                        split_tokens += len(ids)
                        index.append((split_tokens, quality_score(doc)))
                        num_bytes += len(doc.text.encode("utf-8"))
                        counts.num_kept += 1
            index_rel = rel.with_suffix(".docs.npy")
            np.save(out_dir / index_rel, np.array(index, dtype=DOC_INDEX_DTYPE))
            domains[domain][split] = {"path": rel.as_posix(), "index": index_rel.as_posix(),
                                      "num_tokens": split_tokens, "num_docs": len(split_docs)}
            num_tokens += split_tokens

    shards = {"format": SHARDS_FORMAT, "dtype": np.dtype(dtype).name, "vocab_size": vocab_size, "eos_id": eos_id, "domains": domains}
    (out_dir / SHARDS_FILE).write_text(json.dumps(shards, indent=2))
    return {
        **counts.as_dict(),
        "vocab_size": vocab_size,
        "num_tokens": num_tokens,
        "bytes_per_token": round(num_bytes / max(num_tokens, 1), 3),
        "tokens_by_domain": {d: s["train"]["num_tokens"] + s["val"]["num_tokens"] for d, s in domains.items()},
    }
