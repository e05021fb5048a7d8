"""The dedup stage's driver memory as the corpus grows (issue 34: nothing corpus-sized in the driver).

Runs `dedup_documents` (the fast engine, `--workers` local worker processes) on a synthetic corpus of
short documents at N (`--docs`) and `--scale` x N documents, in shards of `--shard-docs`, each size in
a fresh process. Documents are `--words` words drawn from a 5,000-word vocabulary; 5% are exact
copies (upper-cased) and 5% near copies (one word replaced) of an earlier document of any shard.
With `--index`, the measured run is a second batch of the same size deduplicated against the
first's saved index (`lsh_index/`).

For each size it prints the driver's peak resident memory, sampled every 5 ms during the stage,
and its growth over what the driver held just before (imports done, corpus written); the peak of
the largest worker process; the stage's seconds, by phase, and its counts. Last line:
`RESULT dedup_driver_peak_rss_ratio <driver peak at scale x N / driver peak at N>`.

    .venv/bin/python benchmarks/dedup_memory.py                # 20,000 and 320,000 documents: 1-2 minutes
    .venv/bin/python benchmarks/dedup_memory.py --docs 2000 --scale 4   # seconds
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

_VOCABULARY = 5000
_COPY_SHARE = 0.05  # exact copies, and as many near copies


def _words(doc: int, seed: int, words: int) -> list[int]:
    """Document `doc`'s words (vocabulary positions): regenerated from its number, so a copy of any
    earlier document costs no memory."""
    return random.Random(f"{seed}:{doc}").choices(range(_VOCABULARY), k=words)


def documents(first: int, count: int, seed: int, words: int) -> Iterator[object]:
    """Documents `first`..`first + count - 1` of the corpus numbered from 0."""
    from kiln.tasks.data.documents import Document

    for doc in range(first, first + count):
        draw = int.from_bytes(hashlib.blake2b(f"copy:{seed}:{doc}".encode(), digest_size=8).digest(), "little")
        share, source = (draw % 10_000) / 10_000, (draw >> 16) % max(1, doc)
        if doc > 0 and share < _COPY_SHARE:
            text = " ".join(f"w{w}" for w in _words(source, seed, words)).upper()
        elif doc > 0 and share < 2 * _COPY_SHARE:
            chosen = _words(source, seed, words)
            chosen[draw % words] = (chosen[draw % words] + 1) % _VOCABULARY
            text = " ".join(f"w{w}" for w in chosen)
        else:
            text = " ".join(f"w{w}" for w in _words(doc, seed, words))
        yield Document(f"d{seed}-{doc:08d}", text, "synthetic", "prose", "CC0-1.0", {})


def _write_corpus(folder: Path, num_docs: int, shard_docs: int, seed: int, words: int) -> list[Path]:
    from kiln.tasks.data.documents import write_documents

    folder.mkdir(parents=True, exist_ok=True)
    shards = []
    for start in range(0, num_docs, shard_docs):
        shards.append(folder / f"{start // shard_docs:05d}.jsonl")
        write_documents(shards[-1], documents(start, min(shard_docs, num_docs - start), seed, words))
    return shards


def _measure(args: argparse.Namespace) -> dict[str, object]:
    """One size, in this process: the corpus (and the first batch, with --index), then the measured stage."""
    import gc

    import psutil

    from kiln.tasks.data.dedup import DedupConfig
    from kiln.tasks.data.dedup_job import dedup_documents

    work = Path(args.work)
    cfg = DedupConfig(num_workers=args.workers)
    index_dir = None
    if args.index:
        first = _write_corpus(work / "first", args.child, args.shard_docs, 1, args.words)
        (work / "first-out").mkdir()
        dedup_documents(cfg, first, work / "first-out", plots=False)
        index_dir = work / "first-out" / "lsh_index"
    inputs = _write_corpus(work / "in", args.child, args.shard_docs, 2 if args.index else 1, args.words)
    (work / "out").mkdir()
    gc.collect()
    me = psutil.Process()
    before = me.memory_info().rss
    peaks = {"driver": before, "worker": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peaks["driver"] = max(peaks["driver"], me.memory_info().rss)
            for child in me.children(recursive=True):
                try:
                    peaks["worker"] = max(peaks["worker"], child.memory_info().rss)
                except psutil.Error:  # gone between the listing and the reading
                    pass
            done.wait(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    phases: dict[str, float] = {}
    stats = dedup_documents(cfg, inputs, work / "out", index_dir=index_dir, phase_s=phases, plots=False)
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    return {"docs": args.child, "shards": len(inputs), "seconds": round(seconds, 2),
            "driver_before_mb": round(before / 2**20, 1), "driver_peak_mb": round(peaks["driver"] / 2**20, 1),
            "driver_growth_mb": round((peaks["driver"] - before) / 2**20, 1),
            "worker_peak_mb": round(peaks["worker"] / 2**20, 1), "num_kept": stats["num_kept"],
            "removed": stats["removed"], "num_clusters": stats["num_clusters"],
            "num_indexed_before": stats["num_indexed_before"], "phase_s": phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Expected duration: 1-2 minutes with the defaults on 2 shared cores (the "
                                            "320,000 documents most of it), about 3 with --index; seconds at "
                                            "--docs 2000 --scale 4.")
    parser.add_argument("--docs", type=int, default=20_000, help="N, the smaller corpus (default: 20,000)")
    parser.add_argument("--scale", type=int, default=16, help="the larger corpus is scale x N (default: 16)")
    parser.add_argument("--shard-docs", type=int, default=5_000, help="documents per input shard (default: 5,000)")
    parser.add_argument("--words", type=int, default=40, help="words per document (default: 40)")
    parser.add_argument("--workers", type=int, default=2, help="dedup.num_workers: local worker processes (default: 2)")
    parser.add_argument("--index", action="store_true", help="measure a second batch against the first's index")
    parser.add_argument("--child", type=int, help="measure this many documents in this process, printing one JSON "
                        "line (what each size's fresh process runs; default: run both sizes)")
    parser.add_argument("--work", help="with --child: an empty work folder (default: none; required with --child)")
    args = parser.parse_args()
    if args.child is not None and not args.work:
        parser.error("--child needs --work DIR (an empty folder for the corpus and the outputs)")
    if args.child is not None:
        print(json.dumps(_measure(args)))
        return
    results = []
    for num_docs in (args.docs, args.docs * args.scale):
        with tempfile.TemporaryDirectory() as work:
            command = [sys.executable, __file__, "--child", str(num_docs), "--work", work,
                       "--shard-docs", str(args.shard_docs), "--words", str(args.words), "--workers", str(args.workers)]
            output = subprocess.run(command + (["--index"] if args.index else []), check=True, capture_output=True,
                                    text=True).stdout
            results.append(json.loads(output.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    small, large = results
    print(f"driver peak RSS: {small['driver_peak_mb']} MB at {small['docs']} documents, {large['driver_peak_mb']} MB at "
          f"{large['docs']} ({large['docs'] // small['docs']}x); growth during the stage {small['driver_growth_mb']} "
          f"-> {large['driver_growth_mb']} MB; largest worker {small['worker_peak_mb']} -> {large['worker_peak_mb']} MB")
    print(f"RESULT dedup_driver_peak_rss_ratio {large['driver_peak_mb'] / small['driver_peak_mb']:.2f}")


if __name__ == "__main__":
    main()
