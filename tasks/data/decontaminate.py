"""The decontaminate stage: drop (or flag) training documents that share n-grams with eval sets.

Each eval set — a JSON-lines file, or an lm-eval task whose documents come through lm-eval's
`TaskManager` — becomes an index of hashed n-grams (NFKC, lowercased, punctuation stripped, so case
and layout changes in a copy do not hide it) that remembers which eval documents hold each one.
Text in scripts written with spaces gives word n-grams (`ngram_size` words); text in scripts
written without them (Chinese, Japanese kana and kanji, Thai, Lao, Khmer, Myanmar), where a
"word" would be a whole sentence, gives character n-grams (`char_ngram_size` characters, spaces
and punctuation left out). A document of mixed scripts gives both: its spaced words in order, and
character n-grams of its mixed tokens, in which each character of an unspaced script is one token
and each word of a spaced script between them (a Latin technical term, a path, a code identifier,
a version number) is one token too, so that Chinese or Japanese interleaved with Latin still forms
n-grams across the Latin words; a character n-gram holds at least one unspaced character (a window
of spaced words alone is the word n-grams' job). Invisible format characters (zero-width spaces and
joiners, soft hyphens, bidirectional marks) are dropped and non-breaking spaces are spaces, so that
neither splits nor joins a token. A training document sharing at least `min_overlap_ngrams` of
them with an eval set is contaminated by it.

The index is built once, in this process; the training shards are scanned in parallel, a task per
shard on `cluster.executor`, each writing its shard of kept and removed documents and what it found
(which n-grams, which documents, the first examples), which this process adds up in shard order.

Some eval n-grams are boilerplate, not leaked test data, and never count. Boilerplate is decided by
evidence about the text itself, never by how many training documents hold it — a benchmark item
copied into many documents is the worst contamination, not boilerplate:

- *known*: mostly made of Kiln's list of licence notices and documentation footers
  (`tasks.data.decontam_boilerplate`), if `known_boilerplate`;
- *configured*: mostly made of the paragraphs of `boilerplate_files` (your sources' footers);
- *eval-frequent*: held by at least `eval_boilerplate_min_docs` eval documents across all eval sets
  (prompt templates, answer formats, a footer the eval documents share).

The report says what was ignored and why, with examples from the training documents that held it.
It works in both directions: per benchmark, which training documents overlap (with examples), and
which eval documents any training document touches — the contamination rate the evaluate stage
records beside each task's score (`contamination_rates.json`, keyed by the evaluate stage's task names).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from kiln.tasks.accounting import DocCounts
from kiln.tasks.configbase import Section, runtime_field
from kiln.tasks.data.decontam_boilerplate import KNOWN_BOILERPLATE
from kiln.tasks.data.dedup import strip_punctuation
from kiln.tasks.data.documents import read_documents
from kiln.tasks.data.executors import LOCAL, RANKS_DIR, ExecutorSettings, map_shards, rank_ledger
from kiln.tasks.data.inspection import RemovalTally, text_bytes, write_removal_report
from kiln.tasks.data.shards import KINDS, RankShards
from kiln.tasks.errors import InputError
from kiln.tasks.evals.evaluate import Contamination, require_hub
from kiln.tasks.evals.heldout_task import read_eval_records, task_name_for

CONTAMINATION_FILE = "contamination.json"
CONTAMINATION_REPORT = "contamination.md"
RATES_FILE = "contamination_rates.json"
_NUM_EXAMPLES = 5
_SNIPPET_CONTEXT = 12  # words either side of a matched n-gram in an example's snippet
_SNIPPET_CHARS = 20  # ...or characters, for a character n-gram
WORK_DIR = "_decontaminate"  # the scan job's logs, markers and results, while the stage runs
# Scripts written without spaces between words: their text is n-grammed by character.
_UNSPACED = ("\u0e00-\u0eff"  # Thai, Lao
             "\u1000-\u109f"  # Myanmar
             "\u1780-\u17ff"  # Khmer
             "\u3040-\u30ff\u31f0-\u31ff\uff66-\uff9f"  # hiragana, katakana (and their extensions, half-width forms)
             "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f")  # CJK ideographs
_UNSPACED_RUN = re.compile(f"[{_UNSPACED}]+")
_UNSPACED_CHAR = re.compile(f"[{_UNSPACED}]")
# Invisible format characters (Unicode category Cf) that real text carries inside words: soft hyphen,
# zero-width space, non-joiner and joiner, direction marks and embeddings, word joiner, byte-order mark.
_INVISIBLE = dict.fromkeys([0x00AD, *range(0x200B, 0x2010), *range(0x202A, 0x202F), *range(0x2060, 0x2065), 0xFEFF])
_MIN_PHRASE_WORDS = 4  # shorter clauses of a boilerplate text ("and exit") would cover ordinary prose
_PHRASE_KEY_WORDS = 4  # phrases are found by their first words
# An eval n-gram is boilerplate when more than this share of its words lie in boilerplate phrases:
# one that straddles a footer and real content still counts.
_BOILERPLATE_SHARE = 0.5
KNOWN, CONFIGURED, EVAL_FREQUENT = "known_boilerplate", "configured_boilerplate", "eval_frequent"


class DecontaminateConfig(Section):
    ngram_size: int = Field(13, ge=1)  # words; 13 follows GPT-3's decontamination
    # characters, for scripts written without spaces (CJK, Thai): 13 words of English are ~70 characters,
    # and 50 characters of Chinese or Japanese carry about as much text
    char_ngram_size: int = Field(50, ge=1)
    min_overlap_ngrams: int = Field(1, ge=1)  # a doc sharing >= this many eval n-grams is contaminated
    action: Literal["remove", "flag"] = "remove"
    # Boilerplate eval n-grams never count (see the module docstring); how many training documents
    # hold an n-gram is no evidence: a widely copied benchmark item is the worst contamination.
    known_boilerplate: bool = True  # Kiln's licence notices and documentation footers
    boilerplate_files: list[str] = []  # your sources' licence/footer texts, paragraphs split by blank lines
    # An n-gram held by at least this many eval documents (all eval sets together) is template text
    # of the eval sets; None: no n-gram is boilerplate for being frequent there.
    eval_boilerplate_min_docs: int | None = Field(3, ge=2)
    num_workers: int = runtime_field(1, ge=1)  # shards scanned at once on cluster.executor


_FOLD = str.maketrans({"ı": "i"})  # Turkish dotless i: "I".lower() is "i", so a copy in capitals loses the dot


def words(text: str) -> list[str]:
    """Case-, accent- and layout-blind words: a copy in capitals or re-wrapped still matches."""
    if not text.isascii():
        text = text.translate(_INVISIBLE)
        # Accents go (NFKD, then combining marks dropped): "İ".lower() is "i" plus a combining dot.
        decomposed = unicodedata.normalize("NFKD", text)
        text = unicodedata.normalize("NFKC", "".join(c for c in decomposed if not unicodedata.combining(c)))
    text = text.casefold().translate(_FOLD)
    # Punctuation becomes nothing, not a space, so "don't" and "dont" match.
    return strip_punctuation(text).split()


def split_scripts(tokens: list[str]) -> tuple[list[str], list[str]]:
    """The words of scripts written with spaces, and the characters of those written without (CJK,
    Thai...), each in text order: `"python3のリリース"` gives the word `python3` and five characters."""
    spaced: list[str] = []
    unspaced: list[str] = []
    for token in tokens:
        if token.isascii() or not _UNSPACED_RUN.search(token):
            spaced.append(token)
            continue
        end = 0
        for run in _UNSPACED_RUN.finditer(token):
            if run.start() > end:
                spaced.append(token[end : run.start()])
            unspaced.extend(run.group())
            end = run.end()
        if end < len(token):
            spaced.append(token[end:])
    return spaced, unspaced


def mixed_tokens(tokens: list[str]) -> list[str]:
    """The text's tokens for character n-grams, in text order: each character of an unspaced script,
    and each spaced-script word between them as one token (`"用python3运行"` gives 用, python3, 运, 行).
    Empty when the text has no unspaced character."""
    mixed: list[str] = []
    found = False
    for token in tokens:
        if token.isascii() or not _UNSPACED_RUN.search(token):
            mixed.append(token)
            continue
        found = True
        end = 0
        for run in _UNSPACED_RUN.finditer(token):
            if run.start() > end:
                mixed.append(token[end : run.start()])
            mixed.extend(run.group())
            end = run.end()
        if end < len(token):
            mixed.append(token[end:])
    return mixed if found else []


def _hash(gram: str, kind: bytes = b"") -> int:
    # A stable hash (Python's hash() is salted per process); 8 bytes keeps collisions negligible.
    # `kind` keeps character n-grams apart from word n-grams.
    return int.from_bytes(hashlib.blake2b(gram.encode("utf-8"), digest_size=8, person=kind).digest(), "little")


_CHARS = b"chars"


def ngram_positions(tokens: list[str], size: int) -> dict[int, int]:
    """Hashed word n-grams of a token list, each with the position of its first occurrence."""
    positions: dict[int, int] = {}
    for i in range(len(tokens) - size + 1):
        positions.setdefault(_hash(" ".join(tokens[i : i + size])), i)
    return positions


def _mixed_piece(token: str) -> str:
    """A mixed token as it is hashed: an unspaced character as itself, a word with a space either side,
    so that an n-gram of unspaced characters alone hashes as their text and words never run together."""
    return token if len(token) == 1 and _UNSPACED_CHAR.match(token) else f" {token} "


def char_ngram_positions(tokens: list[str], size: int) -> dict[int, int]:
    """Hashed character n-grams of `mixed_tokens` that hold at least one unspaced character, each with
    the position of its first occurrence."""
    positions: dict[int, int] = {}
    pieces = [_mixed_piece(token) for token in tokens]
    if all(len(piece) == 1 for piece in pieces):  # unspaced characters only: slices of the text
        text = "".join(pieces)
        for i in range(len(text) - size + 1):
            positions.setdefault(_hash(text[i : i + size], _CHARS), i)
        return positions
    if len(pieces) < size:
        return positions
    unspaced = np.cumsum([0] + [len(piece) == 1 for piece in pieces])
    for i in np.flatnonzero(unspaced[size:] > unspaced[: len(pieces) - size + 1]).tolist():
        positions.setdefault(_hash("".join(pieces[i : i + size]), _CHARS), i)
    return positions


@dataclass
class Grams:
    """A text's n-grams: words of spaced scripts, characters of unspaced ones (see the module docstring)."""

    words: list[str]
    chars: list[str]  # `mixed_tokens`: unspaced characters and the spaced words between them
    word_grams: dict[int, int]  # hash -> first position in `words`
    char_grams: dict[int, int]  # hash -> first position in `chars`

    @classmethod
    def of(cls, text: str, word_size: int, char_size: int) -> Grams:
        tokens = words(text)
        spaced, mixed = split_scripts(tokens)[0], mixed_tokens(tokens)
        return cls(spaced, mixed, ngram_positions(spaced, word_size), char_ngram_positions(mixed, char_size))

    def hashes(self) -> set[int]:
        return self.word_grams.keys() | self.char_grams.keys()

    def example(self, doc_id: str, gram: int, word_size: int, char_size: int) -> dict[str, str]:
        """The n-gram `gram` and the normalised text around it."""
        if gram in self.word_grams:
            start, tokens, size, context, sep = self.word_grams[gram], self.words, word_size, _SNIPPET_CONTEXT, " "
        else:
            start, tokens, size, context, sep = self.char_grams[gram], self.chars, char_size, _SNIPPET_CHARS, ""
        lo, hi = max(0, start - context), start + size + context

        def join(part: list[str]) -> str:
            return " ".join(part) if sep else "".join(map(_mixed_piece, part)).strip().replace("  ", " ")

        return {
            "doc_id": doc_id,
            "ngram": join(tokens[start : start + size]),
            "snippet": ("… " if lo else "") + join(tokens[lo:hi]) + (" …" if hi < len(tokens) else ""),
        }


def _phrase_token(token: str) -> str:
    """Numbers match any number in a boilerplate phrase: years and versions change, the notice does not."""
    return "#" if token.isdigit() else token


class Phrases:
    """Boilerplate texts as normalised word sequences (their sentences and clauses), found by their first words."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, ...], list[tuple[tuple[str, ...], str]]] = {}
        self.num_phrases = 0

    def add_text(self, text: str, reason: str) -> None:
        """Every clause of `text` of at least `_MIN_PHRASE_WORDS` words; `#` lines are comments."""
        for paragraph in re.split(r"\n\s*\n", text):
            paragraph = "\n".join(line for line in paragraph.splitlines() if not line.lstrip().startswith("#"))
            for clause in re.split(r"(?<=[.;:!?])\s+", paragraph):
                phrase = tuple(_phrase_token(t) for t in words(clause))
                if len(phrase) >= _MIN_PHRASE_WORDS:
                    self._by_key.setdefault(phrase[:_PHRASE_KEY_WORDS], []).append((phrase, reason))
                    self.num_phrases += 1

    def cover(self, tokens: list[str]) -> list[str | None]:
        """For each token, the reason of a phrase occurrence covering it (None: ordinary text)."""
        covered: list[str | None] = [None] * len(tokens)
        if not self._by_key:
            return covered
        keyed = [_phrase_token(t) for t in tokens]
        for i in range(len(keyed) - _MIN_PHRASE_WORDS + 1):
            for phrase, reason in self._by_key.get(tuple(keyed[i : i + _PHRASE_KEY_WORDS]), ()):
                if tuple(keyed[i : i + len(phrase)]) == phrase:
                    covered[i : i + len(phrase)] = [reason] * len(phrase)
        return covered


def boilerplate_phrases(cfg: DecontaminateConfig) -> Phrases:
    """Kiln's known boilerplate (if `known_boilerplate`) and the paragraphs of `boilerplate_files`."""
    phrases = Phrases()
    if cfg.known_boilerplate:
        phrases.add_text(KNOWN_BOILERPLATE, KNOWN)
    for i, name in enumerate(cfg.boilerplate_files):
        path = Path(name)
        if not path.is_file():
            raise InputError(f"decontaminate.boilerplate_files[{i}]: {path} does not exist; fix the path or remove it")
        try:
            phrases.add_text(path.read_text(encoding="utf-8"), CONFIGURED)
        except UnicodeDecodeError as err:
            raise InputError(f"decontaminate.boilerplate_files[{i}]: {path} is not UTF-8 ({err})") from err
    return phrases


@dataclass
class Findings:
    """What training documents held of one eval set's n-grams: a shard's, or all shards' added up."""

    shared: set[int] = field(default_factory=set)  # n-grams any training document holds (not boilerplate)
    matched: set[int] = field(default_factory=set)  # n-grams held by contaminated training documents
    num_docs_contaminated: int = 0
    examples: list[dict[str, str]] = field(default_factory=list)
    # what boilerplate the training data held: reason -> n-grams found, documents holding them, examples
    ignored_found: dict[str, set[int]] = field(default_factory=dict)
    ignored_docs: Counter = field(default_factory=Counter)
    ignored_examples: dict[str, list[dict[str, str]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"shared": sorted(self.shared), "matched": sorted(self.matched),
                "num_docs_contaminated": self.num_docs_contaminated, "examples": self.examples,
                "ignored_found": {r: sorted(grams) for r, grams in self.ignored_found.items()},
                "ignored_docs": dict(self.ignored_docs), "ignored_examples": self.ignored_examples}

    def merge(self, other: dict[str, Any]) -> None:
        """Add a later shard's findings (`to_json`): examples stay the first ones in input order."""
        self.shared.update(other["shared"])
        self.matched.update(other["matched"])
        self.num_docs_contaminated += other["num_docs_contaminated"]
        self.examples = (self.examples + other["examples"])[:_NUM_EXAMPLES]
        for reason, grams in other["ignored_found"].items():
            self.ignored_found.setdefault(reason, set()).update(grams)
        self.ignored_docs.update(other["ignored_docs"])
        for reason, examples in other["ignored_examples"].items():
            self.ignored_examples[reason] = (self.ignored_examples.get(reason, []) + examples)[:_NUM_EXAMPLES]


@dataclass
class EvalIndex:
    """The n-grams of one eval set, which eval documents hold them, and what training data matched."""

    name: str  # report key and removal reason (`contaminated:<name>`)
    task_name: str  # the evaluate stage's lm-eval task name, the key of its contamination rate
    source: str  # the eval file's path, or `lm-eval:<task>`
    doc_ids: list[str]
    holders: dict[int, list[int]]  # n-gram hash -> indices of the eval documents holding it
    num_eval_docs_too_short: int  # shorter than one n-gram: cannot be detected
    boilerplate: dict[int, str] = field(default_factory=dict)  # n-gram hash -> why it never counts
    found: Findings = field(default_factory=Findings)  # in the training data

    def contaminated_eval_docs(self) -> list[str]:
        """Eval documents sharing any n-gram with the training data, in eval order."""
        indices = {i for gram in self.found.shared for i in self.holders[gram]}
        return [self.doc_ids[i] for i in sorted(indices)]

    def contamination_rate(self) -> float:
        return len(self.contaminated_eval_docs()) / len(self.doc_ids)

    def report(self) -> dict[str, Any]:
        contaminated = self.contaminated_eval_docs()
        found = self.found
        return {
            "source": self.source,
            "task_name": self.task_name,
            "num_eval_docs": len(self.doc_ids),
            "num_eval_docs_too_short": self.num_eval_docs_too_short,
            "num_eval_ngrams": len(self.holders),
            "num_eval_ngrams_boilerplate": dict(sorted(Counter(self.boilerplate.values()).items())),
            "num_eval_docs_contaminated": len(contaminated),
            "contamination_rate": len(contaminated) / len(self.doc_ids),
            "contaminated_eval_docs": contaminated,
            "num_docs_contaminated": found.num_docs_contaminated,
            "num_overlapping_ngrams": len(found.matched),
            "examples": found.examples,
            "ignored": {reason: {"num_ngrams": len(grams), "num_training_docs": found.ignored_docs[reason],
                                 "examples": found.ignored_examples.get(reason, [])}
                        for reason, grams in sorted(found.ignored_found.items())},
        }


def _index(name: str, task: str, source: str, docs: Iterable[tuple[str, str]], cfg: DecontaminateConfig,
           phrases: Phrases) -> EvalIndex:
    doc_ids: list[str] = []
    holders: dict[int, list[int]] = {}
    boilerplate: dict[int, str] = {}
    too_short = 0
    size = cfg.ngram_size
    for i, (doc_id, text) in enumerate(docs):
        doc_ids.append(doc_id)
        grams = Grams.of(text, size, cfg.char_ngram_size)
        hashes = grams.hashes()
        too_short += not hashes
        for gram in (*grams.word_grams, *grams.char_grams):
            holders.setdefault(gram, []).append(i)
        tokens = grams.words
        covered = phrases.cover(tokens)
        if any(covered):
            for start in range(len(tokens) - size + 1):
                window = [reason for reason in covered[start : start + size] if reason]
                if len(window) > _BOILERPLATE_SHARE * size:
                    gram = _hash(" ".join(tokens[start : start + size]))
                    boilerplate.setdefault(gram, Counter(window).most_common(1)[0][0])
    if not doc_ids:
        raise InputError(f"eval set {source!r} holds no documents; point the suite at a non-empty one")
    return EvalIndex(name, task, source, doc_ids, holders, too_short, boilerplate)


def _task_docs(names: Sequence[str], include_path: Path | None) -> dict[str, list[tuple[str, str]]]:
    """(id, text) of each evaluation document of each lm-eval task: its prompt and its answer."""
    from lm_eval.tasks import TaskManager  # lm-eval takes seconds to import; only task names need it

    path = str(include_path) if include_path else None
    if path is None:
        require_hub(names)  # before indexing lm-eval's tasks (seconds) to find out the data cannot come
    manager = TaskManager(include_path=path, include_defaults=False) if path else None
    if manager is None or any(name not in manager.all_tasks for name in names):
        manager = TaskManager(include_path=path)  # indexing every built-in task takes several seconds
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise InputError(f"decontaminate eval tasks {unknown} are not lm-eval tasks; see `lm_eval ls tasks`")
    docs: dict[str, list[tuple[str, str]]] = {}
    for name in names:
        try:
            tasks = manager.load([name])["tasks"]
        except ConnectionError as err:  # huggingface_hub's OfflineModeIsEnabled is one
            raise InputError(
                f"lm-eval task {name!r}: its data could not be loaded ({err}). Built-in tasks download "
                "from the Hugging Face hub and need network access: run online, or give the eval set "
                "as a local JSON-lines file"
            ) from err
        docs[name] = [
            (f"{task_name}/{i}", _task_doc_text(task, doc))
            for task_name, task in sorted(tasks.items())
            for i, doc in enumerate(task.eval_docs)
        ]
    return docs


def _task_doc_text(task: Any, doc: dict) -> str:
    """What a model is shown and scored on: the prompt and the correct answer's text."""
    target = task.doc_to_target(doc)
    if task.OUTPUT_TYPE == "multiple_choice" and isinstance(target, int):
        target = task.doc_to_choice(doc)[target]
    parts = [task.doc_to_text(doc), *(target if isinstance(target, list) else [target])]
    return " ".join(str(part) for part in parts)


def index_ngrams(
    eval_files: Sequence[Path], eval_tasks: Sequence[str], cfg: DecontaminateConfig, *,
    task_include_path: Path | None = None, phrases: Phrases | None = None,
) -> list[EvalIndex]:
    """One n-gram index per eval file (named by its stem) and per lm-eval task (named by the task), each
    with its boilerplate n-grams: mostly made of `phrases`, or held by at least
    `cfg.eval_boilerplate_min_docs` eval documents of all the sets together.

    `task_include_path` is a folder of extra lm-eval task YAMLs (lm-eval's `include_path`).
    """
    phrases = phrases or Phrases()
    indexes = [
        _index(Path(path).stem, task_name_for(Path(path)), str(path), read_eval_records(Path(path)), cfg, phrases)
        for path in eval_files
    ]
    for name, docs in _task_docs(eval_tasks, task_include_path).items() if eval_tasks else ():
        indexes.append(_index(name, name, f"lm-eval:{name}", docs, cfg, phrases))
    by_name: dict[str, str] = {}
    for index in indexes:
        if index.name in by_name:
            raise InputError(
                f"eval sets {by_name[index.name]!r} and {index.source!r} share the name {index.name!r}; "
                "reports and removal reasons are keyed by it: rename one"
            )
        by_name[index.name] = index.source
    if cfg.eval_boilerplate_min_docs is not None:
        num_docs = Counter()
        for index in indexes:
            for gram, docs in index.holders.items():
                num_docs[gram] += len(docs)
        for index in indexes:
            for gram in index.holders:
                if num_docs[gram] >= cfg.eval_boilerplate_min_docs:
                    index.boilerplate.setdefault(gram, EVAL_FREQUENT)
    return indexes


@dataclass
class Lookup:
    """What a scan needs of one eval set: its n-grams and which of them are boilerplate."""

    name: str
    grams: set[int]
    boilerplate: dict[int, str]


def save_lookups(indexes: list[EvalIndex], path: Path) -> None:
    """The eval sets' n-grams for the scan's ranks, as arrays (a file, not the ranks' pickled pipeline:
    datatrove copies and logs a pipeline per rank)."""
    arrays: dict[str, np.ndarray] = {"names": np.array([index.name for index in indexes], dtype=str)}
    for i, index in enumerate(indexes):
        arrays[f"grams_{i}"] = np.array(sorted(index.holders), dtype=np.uint64)
        arrays[f"boilerplate_{i}"] = np.array(list(index.boilerplate), dtype=np.uint64)
        arrays[f"reasons_{i}"] = np.array(list(index.boilerplate.values()), dtype=str)
    np.savez(path, **arrays)


def load_lookups(path: Path) -> list[Lookup]:
    with np.load(path, allow_pickle=False) as arrays:
        return [Lookup(str(name), set(arrays[f"grams_{i}"].tolist()),
                       dict(zip(arrays[f"boilerplate_{i}"].tolist(), arrays[f"reasons_{i}"].tolist())))
                for i, name in enumerate(arrays["names"].tolist())]


@dataclass(frozen=True)
class _Scan:
    """Rank r: scan input shard r against the eval sets' n-grams, writing shard r of the kept and removed documents."""

    cfg: DecontaminateConfig
    lookups: Path  # `save_lookups`' file
    shards: list[Path]
    out_dir: Path

    def __call__(self, rank: int) -> dict[str, Any]:
        with RankShards(self.out_dir, rank) as shards:
            result = scan_shard(self.cfg, load_lookups(self.lookups), self.shards[rank], shards)
            return result | {"shards": shards.close()}


def scan_shard(cfg: DecontaminateConfig, lookups: list[Lookup], shard: Path, out: RankShards) -> dict[str, Any]:
    """Remove (or flag) the documents of `shard` that overlap an eval set; its counts, tally and findings."""
    counts = DocCounts()
    tally = RemovalTally()
    found = {lookup.name: Findings() for lookup in lookups}
    num_flagged = 0
    for doc in read_documents(shard):
        counts.num_in += 1
        overlaps: dict[str, int] = {}
        grams = Grams.of(doc.text, cfg.ngram_size, cfg.char_ngram_size)
        hashes = grams.hashes()
        for lookup in lookups:
            hits = lookup.grams & hashes
            if not hits:
                continue
            findings = found[lookup.name]
            ignored = hits & lookup.boilerplate.keys()
            if ignored:
                _note_ignored(lookup, findings, doc.id, grams, ignored, cfg)
            shared = hits - ignored
            findings.shared |= shared
            if len(shared) < cfg.min_overlap_ngrams:
                continue
            overlaps[lookup.name] = len(shared)
            findings.matched |= shared
            findings.num_docs_contaminated += 1
            if len(findings.examples) < _NUM_EXAMPLES:
                findings.examples.append(grams.example(doc.id, min(shared), cfg.ngram_size, cfg.char_ngram_size))
        if overlaps:
            doc.metadata["contamination"] = overlaps
        if overlaps and cfg.action == "remove":
            reason = f"contaminated:{next(iter(overlaps))}"  # the first eval set, in the given order
            out.removed.add(reason, vars(doc))
            counts.removed[reason] += 1
            tally.add("removed", doc.domain, text_bytes(doc.text), reason)
            continue
        num_flagged += bool(overlaps)
        out.kept.write_line(doc.to_json_line())
        counts.num_kept += 1
        tally.add("kept", doc.domain, text_bytes(doc.text))
    return {"counts": counts.as_dict(), "tally": tally.table(), "num_flagged": num_flagged,
            "found": {name: findings.to_json() for name, findings in found.items()}}


def decontaminate_documents(
    cfg: DecontaminateConfig,
    inputs: list[Path],
    eval_files: list[Path],
    out_dir: Path,
    *,
    eval_tasks: Sequence[str] = (),
    task_include_path: Path | None = None,
    executor: ExecutorSettings = LOCAL,
) -> dict:
    """Remove (or flag) the documents of the shards `inputs` that overlap the eval sets, a task per shard
    on `executor`; write the contamination reports."""
    indexes = index_ngrams(eval_files, eval_tasks, cfg, task_include_path=task_include_path,
                           phrases=boilerplate_phrases(cfg))
    # Absolute: Slurm and Ray workers do not share this process's working directory.
    inputs, out_dir = [path.resolve() for path in inputs], out_dir.resolve()
    work = out_dir / WORK_DIR
    lookups = work / "eval_ngrams.npz"
    work.mkdir(exist_ok=True)
    save_lookups(indexes, lookups)
    scan = work / "scan"
    ledger = rank_ledger(scan / RANKS_DIR, "kiln_decontaminate", {"config": cfg.identity(), "evals": _digest(indexes)},
                         [{"shard": shard} for shard in inputs])
    run = map_shards(_Scan(cfg, lookups, inputs, out_dir), scan, ledger, settings=executor, jobs=cfg.num_workers,
                     job_name="kiln_decontaminate", outputs=[out_dir / kind for kind in KINDS])
    counts, tally = run.counts(), run.tally()
    num_flagged = run.total("num_flagged") or 0
    for result in run.results:  # in shard order: examples are the first ones in input order
        for index in indexes:
            index.found.merge(result["found"][index.name])
    shutil.rmtree(work, ignore_errors=True)
    report = {
        "ngram_size": cfg.ngram_size,
        "char_ngram_size": cfg.char_ngram_size,
        "min_overlap_ngrams": cfg.min_overlap_ngrams,
        "action": cfg.action,
        "boilerplate": {"known_boilerplate": cfg.known_boilerplate, "boilerplate_files": list(cfg.boilerplate_files),
                        "eval_boilerplate_min_docs": cfg.eval_boilerplate_min_docs},
        "benchmarks": {index.name: index.report() for index in indexes},
    }
    (out_dir / CONTAMINATION_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out_dir / CONTAMINATION_REPORT).write_text(contamination_markdown(report), encoding="utf-8")
    rates = {index.task_name: index.contamination_rate() for index in indexes}
    (out_dir / RATES_FILE).write_text(json.dumps(rates, indent=2) + "\n", encoding="utf-8")
    table = write_removal_report(out_dir, "decontaminate", tally.table())  # removals by domain and eval set
    return {
        **counts.as_dict(),
        "accounting": table,
        "num_flagged": num_flagged,
        "contamination": {
            index.name: {
                "num_docs_contaminated": index.found.num_docs_contaminated,
                "num_overlapping_ngrams": len(index.found.matched),
                "contamination_rate": index.contamination_rate(),
                "num_training_docs_with_ignored_boilerplate": dict(index.found.ignored_docs),
            }
            for index in indexes
        },
        "shards": run.listing(out_dir),
        "executor_cpu_s": run.outside_cpu_s,
    }


def _digest(indexes: list[EvalIndex]) -> str:
    """The eval sets' n-grams and boilerplate, in each scan rank's key: finished ranks are reused only under the same."""
    digest = hashlib.sha256()
    for index in indexes:
        digest.update(index.name.encode() + b"\0")
        digest.update(b"".join(gram.to_bytes(8, "little") for gram in sorted(index.holders)))
        digest.update(json.dumps(sorted(index.boilerplate.items())).encode())
    return digest.hexdigest()


def _note_ignored(lookup: Lookup, found: Findings, doc_id: str, grams: Grams, ignored: set[int],
                  cfg: DecontaminateConfig) -> None:
    """Count a training document holding boilerplate n-grams of an eval set, by reason, with a few examples."""
    by_reason: dict[str, set[int]] = {}
    for gram in ignored:
        by_reason.setdefault(lookup.boilerplate[gram], set()).add(gram)
    for reason, hashes in by_reason.items():
        found.ignored_found.setdefault(reason, set()).update(hashes)
        found.ignored_docs[reason] += 1
        examples = found.ignored_examples.setdefault(reason, [])
        if len(examples) < _NUM_EXAMPLES:
            examples.append(grams.example(doc_id, min(hashes), cfg.ngram_size, cfg.char_ngram_size))


def contamination_markdown(report: dict[str, Any]) -> str:
    """The contamination report as a Markdown table per benchmark, with its examples."""
    lines = [
        "# Contamination",
        "",
        f"{report['ngram_size']}-word n-grams ({report['char_ngram_size']}-character n-grams in scripts written "
        "without spaces); a training document sharing at least "
        f"{report['min_overlap_ngrams']} with a benchmark is contaminated "
        f"({ {'remove': 'removed', 'flag': 'flagged'}[report['action']] }). "
        "Contamination rate: eval documents sharing any n-gram with the training data / eval documents.",
        "",
        "| benchmark | eval docs | contaminated eval docs | rate | contaminated training docs | overlapping n-grams |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    benchmarks = report["benchmarks"]
    for name, b in benchmarks.items():
        lines.append(
            f"| {name} | {b['num_eval_docs']} | {b['num_eval_docs_contaminated']} | {b['contamination_rate']:.2%} "
            f"| {b['num_docs_contaminated']} | {b['num_overlapping_ngrams']} |"
        )
    for name, b in benchmarks.items():
        if not b["examples"] and not b["ignored"]:
            continue
        lines += ["", f"## {name}", ""]
        lines += [f"- `{e['doc_id']}`: \"{e['ngram']}\" — {e['snippet']}" for e in b["examples"]]
        if b["ignored"]:
            lines += ["", "Ignored as boilerplate (these n-grams never count as contamination):", "",
                      "| reason | eval n-grams | found in training data | training docs holding them |",
                      "|---|---:|---:|---:|"]
            lines += [f"| {reason} | {b['num_eval_ngrams_boilerplate'].get(reason, 0)} | {i['num_ngrams']} "
                      f"| {i['num_training_docs']} |" for reason, i in b["ignored"].items()]
            for reason, i in b["ignored"].items():
                lines += ["", f"Examples ({_REASON_TEXT[reason]}):", ""]
                lines += [f"- `{e['doc_id']}`: \"{e['ngram']}\"" for e in i["examples"]]
    return "\n".join(lines) + "\n"


_REASON_TEXT = {
    KNOWN: "mostly Kiln's known licence and documentation-footer text",
    CONFIGURED: "mostly text of decontaminate.boilerplate_files",
    EVAL_FREQUENT: "held by at least decontaminate.eval_boilerplate_min_docs eval documents",
}


def read_contamination(out_dir: Path) -> Contamination:
    """What a decontaminate output found, keyed as the evaluate stage names its tasks: each eval file's
    contaminated documents (by its bits-per-byte task's name) and each lm-eval task's rate."""
    report = json.loads((out_dir / CONTAMINATION_FILE).read_text(encoding="utf-8"))
    rates = json.loads((out_dir / RATES_FILE).read_text(encoding="utf-8"))
    ids = {b["task_name"]: set(b["contaminated_eval_docs"]) for b in report["benchmarks"].values()
           if not b["source"].startswith("lm-eval:")}
    return Contamination(rates=rates, contaminated_ids=ids)
