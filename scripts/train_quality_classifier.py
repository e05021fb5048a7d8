"""Train the clean stage's fastText quality classifier from the bundled corpus and save it quantized.

    .venv/bin/python scripts/train_quality_classifier.py [--out data/models/quality_classifier.ftz]

Labelling. The bundled corpus (data/sample/) holds no books or papers; its best text is curated
reference prose (Python docs, Debian maint-guide, Valgrind manual, coreutils/util-linux man
pages), and its worst is the boilerplate a documentation site is made of (index pages, tables of
contents, navigation, disclaimers repeated on every page). The rule filters already tell them
apart, so the classifier distils them into a model that scores any text:

1. collect the corpus with `configs/default.yaml` (licence-excluded sources never enter) and run
   the clean stage's language ID and Gopher rules on it (no classifier, no PII redaction);
2. `hq`: every web or prose document the rules keep;
   `lq`: every English *web* document they remove (navigation and index pages, tables of
   contents, pages of repeated boilerplate). Removed man pages are not negatives: they are
   rejected for repetition or a low language-ID score, not for being boilerplate; nor are German
   or French pages, which the English Gopher rules reject for their language, not their quality;
3. each document becomes windows of `WINDOW` words (a shorter tail of at least `MIN_WORDS`
   words is kept), one fastText example each, so that long and short pages both contribute.

Documents are split 80/20 by a hash of their id; the model is trained on the 80 % and the
held-out accuracy printed. fastText 0.9.x needs `thread >= 10` and `dim` divisible by 10
(otherwise "Encountered NaN"), and threaded training is not reproducible: the model is trained
once by this script and committed; the clean stage only applies it, deterministically.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import tempfile
from pathlib import Path

import fasttext

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kiln.tasks.config import load_config  # noqa: E402
from kiln.tasks.data.clean import clean_documents  # noqa: E402
from kiln.tasks.data.collect import collect_documents  # noqa: E402
from kiln.tasks.data.documents import read_shards  # noqa: E402
from kiln.tasks.data.quality import SHIPPED_MODEL, fasttext_text  # noqa: E402
from kiln.tasks.data.shards import REMOVED, shard_paths  # noqa: E402

WINDOW = 64
MIN_WORDS = 16
FIT = dict(lr=0.5, epoch=25, wordNgrams=2, dim=10, bucket=200_000, minCount=1, thread=10, seed=0, verbose=0)


def _windows(text: str) -> list[str]:
    words = fasttext_text(text).lower().split()
    chunks = [words[i:i + WINDOW] for i in range(0, len(words), WINDOW)]
    return [" ".join(chunk) for chunk in chunks if len(chunk) >= MIN_WORDS]


def _held_out(doc_id: str) -> bool:
    return hashlib.sha256(doc_id.encode()).digest()[0] < 256 // 5


def labelled_documents(work: Path) -> list[tuple[str, str, str]]:
    """(label, doc id, text) for every labelled document of the bundled corpus."""
    cfg = load_config(REPO / "configs" / "default.yaml")  # its source paths are relative to the repository
    rules_only = cfg.clean.model_copy(update={"quality_model": None, "quality_training": None,
                                              "quality_top_fraction": None, "pii_redaction": False})
    (work / "collect").mkdir()
    (work / "clean").mkdir()
    collect_documents(cfg.collect, work / "collect")
    clean_documents(rules_only, work / "collect", work / "clean")
    kept = [("hq", d.id, d.text) for d in read_shards(shard_paths(work / "clean")) if d.domain in ("web", "prose")]
    removed = [("lq", d.id, d.text) for d in read_shards(shard_paths(work / "clean", REMOVED))
               if d.domain == "web" and d.metadata["language"] == "en"]
    return kept + removed


def _write(path: Path, docs: list[tuple[str, str, str]]) -> int:
    lines = [f"__label__{label} {window}" for label, _, text in docs for window in _windows(text)]
    random.Random(0).shuffle(lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / SHIPPED_MODEL)
    args = parser.parse_args()
    os.chdir(REPO)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        docs = labelled_documents(work)
        train = [d for d in docs if not _held_out(d[1])]
        test = [d for d in docs if _held_out(d[1])]
        num_train, num_test = _write(work / "train.txt", train), _write(work / "test.txt", test)
        for name, split in (("train", train), ("held out", test)):
            print(f"{name}: {sum(d[0] == 'hq' for d in split)} hq + {sum(d[0] == 'lq' for d in split)} lq documents")
        print(f"examples: {num_train} train, {num_test} held out")
        model = fasttext.train_supervised(str(work / "train.txt"), **FIT)
        model.quantize(input=str(work / "train.txt"), qnorm=True, retrain=True, cutoff=50_000,
                       epoch=FIT["epoch"], lr=FIT["lr"], thread=FIT["thread"], verbose=0)
        _, precision, _ = model.test(str(work / "test.txt"))
        print(f"held-out window accuracy: {precision:.3f}")
        correct = sum(
            (model.predict([fasttext_text(text)])[0][0][0] == f"__label__{label}") for label, _, text in test
        )
        print(f"held-out document accuracy: {correct}/{len(test)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model.save_model(str(args.out))
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
