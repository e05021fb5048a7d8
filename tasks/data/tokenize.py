"""Tokenize: train a byte-level BPE tokenizer on a sample of the corpus and write token shards per domain.

The tokenizer trains on `train_sample_bytes` of text taken from every input shard in proportion to
its size (each shard's first documents, so the sample is the same on every run and reads only what
it takes); a corpus no larger than the sample is read whole. The training streams the sample: its
memory is the tokenizer's word counts, not the text. Then each input shard is encoded as a task on
`cluster.executor` (the fast tokenizer's batch API) into token shards per domain and split:
`shards/<domain>/<split>/NNNNN.bin`, raw little-endian token ids (memory-mapped by the loader),
documents concatenated with an end-of-text token after each. Read in shard order, a domain's
shards are its documents in corpus order. A deterministic hash of each document id puts it in the
train or validation split, so the split survives re-ordering and re-runs; a domain whose hash
leaves a split empty has its first document by hash moved there (its shard encoded again).

Beside each token shard, a document index (`NNNNN.docs.npy`) gives each document's end offset in
the shard (tokens, its end-of-text included) and the clean stage's `quality_score` (NaN for a
document the classifier did not score): the anneal selects the best documents by it without
tokenizing anything again. A document with no tokens (empty text) is quarantined.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kiln.tasks.accounting import DocCounts
from kiln.tasks.configbase import Section, runtime_field
from kiln.tasks.constants import DOC_INDEX_SUFFIX, EOS_TOKEN, SHARDS_FILE, TOKENIZER_FILE
from kiln.tasks.data.dedup import quality_score
from kiln.tasks.data.documents import Document, read_documents
from kiln.tasks.data.executors import LOCAL, RANKS_DIR, ExecutorSettings, ShardRun, map_shards, rank_ledger
from kiln.tasks.data.shards import KINDS, QUARANTINE, RankShards, ShardInfo, read_listing
from kiln.tasks.store import HashingFile

SHARDS_FORMAT = 3  # 2: each shard has a document index (DOC_INDEX_DTYPE); 3: a list of shards per domain and split
DOC_INDEX_DTYPE = np.dtype([("end", "<i8"), ("quality", "<f8")])
SPLITS = ("train", "val")
WORK_DIR = "_tokenize"  # the encode jobs' logs, markers and results, while the stage runs
_ENCODE_BATCH = 256


class TokenizeConfig(Section):
    vocab_size: int = Field(4096, ge=260, description="BPE vocabulary size including the 256 byte tokens")
    min_frequency: int = Field(2, ge=1)
    val_fraction: float = Field(0.05, gt=0, lt=0.5, description="share of each domain's documents held out for validation")
    # The text the tokenizer trains on, taken from every input shard in proportion to its size; a
    # corpus no larger is read whole. 1 GB is plenty for a BPE vocabulary of tens of thousands.
    train_sample_bytes: int = Field(1_000_000_000, ge=1)
    num_workers: int = runtime_field(1, ge=1)  # shards encoded at once on cluster.executor


def train_tokenizer(texts: Iterable[str], cfg: TokenizeConfig) -> Tokenizer:
    """A byte-level BPE tokenizer trained on `texts`, streamed (their order does not matter)."""
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
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


@dataclass
class Sample:
    """What the tokenizer trained on."""

    num_docs: int = 0
    num_bytes: int = 0


def training_sample(shards: list[tuple[Path, ShardInfo]], sample_bytes: int, sample: Sample) -> Iterator[str]:
    """The texts of each shard's first documents, up to its share of `sample_bytes` (in proportion to its
    size); every document when the shards hold no more than that. Counts what it yields in `sample`."""
    total = sum(info.num_bytes for _, info in shards)
    for path, info in shards:
        share = info.num_bytes if sample_bytes >= total else sample_bytes * info.num_bytes / total
        taken = 0
        for doc in read_documents(path):
            if taken >= share:
                break
            size = len(doc.text.encode("utf-8", errors="surrogatepass"))
            taken += size
            sample.num_docs += 1
            sample.num_bytes += size
            yield doc.text


def split_of(doc_id: str, val_fraction: float) -> str:
    bucket = int(hashlib.sha1(doc_id.encode()).hexdigest()[:8], 16) / 2**32
    return "val" if bucket < val_fraction else "train"


def _order(doc_id: str) -> str:
    """Which document of a domain's split moves to fill the other, empty, one: the smallest by this."""
    return hashlib.sha1(doc_id.encode()).hexdigest()


@dataclass
class _SplitFile:
    """The token shard and document index of one domain and split, written by one rank."""

    rel: Path  # shards/<domain>/<split>/NNNNN.bin
    handle: HashingFile
    num_tokens: int = 0
    num_docs: int = 0
    index: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class _Encode:
    """Rank i: encode input shard `ranks[i]` (every shard's own rank, without `ranks`) with the trained
    tokenizer into its token shards; `moves` puts documents (by id) into the other split."""

    tokenizer: Path
    inputs: list[Path]
    out_dir: Path
    val_fraction: float
    moves: dict[str, str] = field(default_factory=dict)
    ranks: list[int] | None = None

    def __call__(self, rank: int) -> dict[str, Any]:
        shard = rank if self.ranks is None else self.ranks[rank]
        tokenizer = Tokenizer.from_file(str(self.tokenizer))
        eos_id = tokenizer.token_to_id(EOS_TOKEN)
        dtype = token_dtype(tokenizer.get_vocab_size())
        files: dict[tuple[str, str], _SplitFile] = {}
        for old in (self.out_dir / "shards").glob(f"*/*/{shard:05d}.*"):  # an earlier attempt's
            old.unlink()
        counts = DocCounts()
        num_bytes = 0
        firsts: dict[str, dict[str, tuple[str, str]]] = {}  # domain -> split -> (order, id) of its first by `_order`
        with RankShards(self.out_dir, shard) as out:
            batch: list[tuple[Document, str]] = []

            def encode() -> None:
                nonlocal num_bytes
                for (doc, split), encoding in zip(batch, tokenizer.encode_batch([d.text for d, _ in batch])):
                    target = files.get((doc.domain, split))
                    if target is None:
                        rel = Path("shards") / doc.domain / split / f"{shard:05d}.bin"
                        (self.out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                        target = files[(doc.domain, split)] = _SplitFile(rel, HashingFile(self.out_dir / rel))
                    target.num_docs += 1
                    if not encoding.ids:
                        out.quarantine.add("no_tokens", vars(doc))
                        counts.quarantined["no_tokens"] += 1
                        continue
                    ids = np.asarray(encoding.ids + [eos_id], dtype=dtype)
                    target.handle.write(ids.astype(ids.dtype.newbyteorder("<"), copy=False).tobytes())
                    target.num_tokens += len(ids)
                    target.index.append((target.num_tokens, quality_score(doc)))
                    num_bytes += len(doc.text.encode("utf-8"))
                    counts.num_kept += 1
                batch.clear()

            for doc in read_documents(self.inputs[shard]):
                counts.num_in += 1
                split = self.moves.get(doc.id) or split_of(doc.id, self.val_fraction)
                order = (_order(doc.id), doc.id)
                first = firsts.setdefault(doc.domain, {}).get(split)
                if first is None or order < first:
                    firsts[doc.domain][split] = order
                batch.append((doc, split))
                if len(batch) == _ENCODE_BATCH:
                    encode()
            if batch:
                encode()
            quarantined = out.close()[QUARANTINE]
        splits = {}
        for (domain, split), target in sorted(files.items()):
            target.handle.close()
            index_rel = target.rel.with_suffix(DOC_INDEX_SUFFIX)
            index_file = HashingFile(self.out_dir / index_rel)  # hashed as written: the commit need not reread it
            np.save(index_file, np.array(target.index, dtype=DOC_INDEX_DTYPE))
            index_file.close()
            splits.setdefault(domain, {})[split] = {"path": target.rel.as_posix(), "index": index_rel.as_posix(),
                                                    "num_tokens": target.num_tokens, "num_docs": target.num_docs}
        return {"shard": shard, "counts": counts.as_dict(), "num_bytes": num_bytes, "splits": splits,
                "firsts": firsts, "shards": {QUARANTINE: quarantined}}


def token_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max else np.uint32


def _moves(results: list[dict[str, Any]]) -> tuple[dict[str, str], set[int]]:
    """Documents to move so that every domain with >= 2 documents has both splits, and the shards they are in."""
    num_docs: dict[str, dict[str, int]] = {}
    firsts: dict[str, dict[str, tuple[tuple[str, str], int]]] = {}
    for result in results:
        for domain, splits in result["splits"].items():
            for split, info in splits.items():
                num_docs.setdefault(domain, dict.fromkeys(SPLITS, 0))[split] += info["num_docs"]
        for domain, splits in result["firsts"].items():
            for split, order in splits.items():
                best = firsts.setdefault(domain, {}).get(split)
                if best is None or tuple(order) < best[0]:
                    firsts[domain][split] = (tuple(order), result["shard"])
    moves: dict[str, str] = {}
    shards: set[int] = set()
    for domain, counts in num_docs.items():
        for empty, full in (("val", "train"), ("train", "val")):
            if counts[empty] == 0 and counts[full] >= 2:
                (_, doc_id), shard = firsts[domain][full]
                moves[doc_id] = empty
                shards.add(shard)
                counts[empty], counts[full] = 1, counts[full] - 1
    return moves, shards


def tokenize_corpus(cfg: TokenizeConfig, input_dir: Path, out_dir: Path, executor: ExecutorSettings = LOCAL,
                    tokenizer_file: Path | None = None) -> dict:
    """Train the tokenizer on a sample of the shards of `input_dir` (a data stage's folder) and encode
    them, a task per shard on `executor`, into `out_dir`. Given `tokenizer_file` (a new batch joining a
    tokenized corpus), encode with that tokenizer instead, every document into the train split: a
    batch's documents are for training, and the corpus's validation documents stay what they were."""
    input_dir, out_dir = input_dir.resolve(), out_dir.resolve()  # absolute: Slurm and Ray workers
    listing = read_listing(input_dir)["documents"]
    inputs = [input_dir / info.path for info in listing]
    sample = Sample()
    if tokenizer_file is None:
        tokenizer = train_tokenizer(training_sample(list(zip(inputs, listing)), cfg.train_sample_bytes, sample), cfg)
    else:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.save(str(out_dir / TOKENIZER_FILE))
    vocab_size = tokenizer.get_vocab_size()
    val_fraction = cfg.val_fraction if tokenizer_file is None else 0.0  # split_of: no bucket is below 0

    encoder = _Encode(out_dir / TOKENIZER_FILE, inputs, out_dir, val_fraction)
    settings = {"config": cfg.identity(), "tokenizer": hashlib.sha256(tokenizer.to_str().encode()).hexdigest()}
    encode = out_dir / WORK_DIR / "encode"
    ledger = rank_ledger(encode / RANKS_DIR, "kiln_tokenize", settings, [{"shard": shard} for shard in inputs])
    run = map_shards(encoder, encode, ledger, settings=executor, jobs=cfg.num_workers, job_name="kiln_tokenize",
                     outputs=[out_dir / "shards", *(out_dir / kind for kind in KINDS)])
    results = list(run.results)
    executor_cpu_s = run.outside_cpu_s
    moves, moved_shards = _moves(results) if tokenizer_file is None else ({}, set())
    if moves:  # rare (a domain of a few documents): encode the shards holding them again
        ranks = sorted(moved_shards)
        again = out_dir / WORK_DIR / "moves"
        fix = map_shards(_Encode(out_dir / TOKENIZER_FILE, inputs, out_dir, val_fraction, moves, ranks), again,
                         rank_ledger(again / RANKS_DIR, "kiln_tokenize_moves", {**settings, "moves": moves},
                                     [{"shard": inputs[shard]} for shard in ranks]),
                         settings=executor, jobs=cfg.num_workers, job_name="kiln_tokenize_moves")
        for result in fix.results:
            results[result["shard"]] = result
        executor_cpu_s += fix.outside_cpu_s
    shutil.rmtree(out_dir / WORK_DIR, ignore_errors=True)  # none with no shard to encode (a batch deduplicated away)
    run = ShardRun(results, executor_cpu_s)

    counts = run.counts()
    num_bytes = run.total("num_bytes") or 0
    domains: dict[str, dict[str, Any]] = {}
    for result in results:
        for domain, splits in result["splits"].items():
            for split, info in splits.items():
                entry = domains.setdefault(domain, {s: {"shards": [], "num_tokens": 0, "num_docs": 0} for s in SPLITS})
                entry[split]["shards"].append(info)
                entry[split]["num_tokens"] += info["num_tokens"]
                entry[split]["num_docs"] += info["num_docs"]
    domains = dict(sorted(domains.items()))
    shards = {"format": SHARDS_FORMAT, "dtype": np.dtype(token_dtype(vocab_size)).name, "vocab_size": vocab_size,
              "eos_id": tokenizer.token_to_id(EOS_TOKEN), "domains": domains}
    (out_dir / SHARDS_FILE).write_text(json.dumps(shards, indent=2))
    num_tokens = sum(split["num_tokens"] for splits in domains.values() for split in splits.values())
    return {
        **counts.as_dict(),
        "vocab_size": vocab_size,
        "num_tokens": num_tokens,
        "bytes_per_token": round(num_bytes / max(num_tokens, 1), 3),
        "tokens_by_domain": {d: s["train"]["num_tokens"] + s["val"]["num_tokens"] for d, s in domains.items()},
        "tokenizer_sample": {"num_docs": sample.num_docs, "num_bytes": sample.num_bytes},
        "shards": run.listing(out_dir),
        "executor_cpu_s": executor_cpu_s,
    }

