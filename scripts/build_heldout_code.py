"""Builds `data/evals/heldout_code.jsonl`: held-out Python source for the code-domain eval tasks.

The training corpus's code domain holds the *top-level* modules of the CPython 3.11.7 standard
library (`scripts/build_sample_corpus.py`). This script takes modules from its *subpackages*
(`json/decoder.py`, `email/utils.py`, ...), which training never sees, with the same size rules
(at least 1,000 characters, cut at a line break before 5,000), and keeps a file only if it shares
no 13-word run with the bundled training text or with a file already kept. At most three files
per package, packages in sorted order, so a rerun on the same install writes the same file:

    python scripts/build_heldout_code.py [--data-dir data] [--stdlib /root/.pyenv/versions/3.11.7/lib/python3.11]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

from build_sample_corpus import truncate  # this folder is on sys.path when a script runs: cut as the corpus does

NUM_DOCS, PER_PACKAGE = 40, 3
MIN_CHARS, MAX_CHARS = 1_000, 5_000
NGRAM = 13
# Generated tables, tests and vendored tools: not code a person wrote to be read.
SKIPPED_PACKAGES = {"test", "idlelib", "lib2to3", "site-packages", "ensurepip", "encodings", "pydoc_data",
                    "config-3.11-x86_64-linux-gnu", "tkinter"}
SKIPPED_FILES = {"html/entities.py", "re/_casefix.py", "curses/has_key.py"}  # generated lookup tables
DEFAULT_STDLIB = Path("/root/.pyenv/versions/3.11.7/lib/python3.11")


def ngrams(text: str) -> set[int]:
    words = re.findall(r"\w+", text.lower())
    return {hash(tuple(words[i:i + NGRAM])) for i in range(len(words) - NGRAM + 1)}


def training_texts(sample: Path) -> list[str]:
    texts = [json.loads(line)["text"] for name in ("code/code.jsonl", "multilingual/multilingual.jsonl")
             for line in (sample / name).read_text(encoding="utf-8").splitlines() if line.strip()]
    texts += [p.read_text(encoding="utf-8", errors="replace") for p in sorted(sample.glob("prose/*/*.txt"))]
    texts += [re.sub(r"<[^>]+>", " ", p.read_text(encoding="utf-8", errors="replace"))
              for p in sorted(sample.glob("web/*/*.html"))]
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=Path(__file__).resolve().parent.parent / "data")
    parser.add_argument("--stdlib", type=Path, default=DEFAULT_STDLIB)
    args = parser.parse_args()

    seen: set[int] = set()
    for text in training_texts(args.data_dir / "sample"):
        seen |= ngrams(text)
    by_package: dict[str, list[Path]] = defaultdict(list)
    for path in sorted(args.stdlib.glob("*/*.py")):
        if path.parent.name not in SKIPPED_PACKAGES and f"{path.parent.name}/{path.name}" not in SKIPPED_FILES:
            by_package[path.parent.name].append(path)
    docs = []
    for package in sorted(by_package):
        kept = 0
        for path in by_package[package]:
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            text = truncate(text, MAX_CHARS)
            grams = ngrams(text)
            if len(text) < MIN_CHARS or grams & seen:
                continue
            seen |= grams
            docs.append({"id": f"heldout-code/cpython-3.11.7/{package}/{path.name}", "text": text,
                         "source": "cpython-3.11.7 (pyenv)", "domain": "code", "licence": "PSF-2.0"})
            kept += 1
            if kept == PER_PACKAGE or len(docs) == NUM_DOCS:
                break
        if len(docs) == NUM_DOCS:
            break
    out = args.data_dir / "evals" / "heldout_code.jsonl"
    with open(out, "w", encoding="utf-8") as handle:
        for doc in docs:
            handle.write(json.dumps(doc, ensure_ascii=False) + "\n")
    print(f"{out}: {len(docs)} documents from {len({d['id'].split('/')[2] for d in docs})} packages, "
          f"{out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
